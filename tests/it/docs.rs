//! The documentation stays true to the code: every rejection reason is in
//! the README's error table, and every `serve` flag is documented in docs/.
#![allow(clippy::unwrap_used)]

fn read(p: &str) -> String {
    std::fs::read_to_string(format!("{}/{p}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

#[test]
fn every_reason_is_in_the_readme_error_table() {
    let readme = read("README.md");
    for r in stateseal::internals::error::Reject::ALL {
        let row = format!("| `{}` | `", r.reason());
        assert!(
            readme.contains(&row),
            "README lacks the error row for {}",
            r.reason()
        );
    }
}

#[test]
fn every_serve_flag_is_documented() {
    let out = crate::common::process::command()
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    let docs = [
        "docs/configuration.md",
        "docs/operations.md",
        "docs/security.md",
    ]
    .map(read)
    .join("\n");
    let flags: Vec<&str> = help
        .split_whitespace()
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric() && c != '-'))
        .filter(|w| *w != "--help")
        .collect();
    assert!(flags.len() > 20, "{help}");
    for f in flags {
        assert!(
            docs.contains(&format!("`{f}")),
            "{f} is not documented in docs/"
        );
    }
}

/// `proto/stateseal/v1/reasons.json` is the one source of the rejection
/// reasons: the service's (reason, gRPC code, message) match it one for one,
/// and the README's error table gives each its code. The client packages'
/// tests check their tables against the same file.
#[test]
fn reasons_match_the_one_source() {
    let src: serde_json::Value =
        serde_json::from_str(&read("proto/stateseal/v1/reasons.json")).unwrap();
    let listed = src["reasons"].as_array().unwrap();
    assert_eq!(listed.len(), stateseal::internals::error::Reject::ALL.len());
    let screaming = |c: tonic::Code| {
        let mut out = String::new();
        for (i, ch) in format!("{c:?}").chars().enumerate() {
            if ch.is_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(ch.to_ascii_uppercase());
        }
        out
    };
    let readme = read("README.md");
    for (r, want) in stateseal::internals::error::Reject::ALL.iter().zip(listed) {
        assert_eq!(want["reason"], r.reason());
        assert_eq!(want["code"], screaming(r.code()).as_str(), "{}", r.reason());
        assert_eq!(want["message"], r.message(), "{}", r.reason());
        let side = want["side"].as_str().unwrap();
        assert!(side == "client" || side == "transient", "{side}");
        let row = format!(
            "| `{}` | `{}` |",
            r.reason(),
            want["code"].as_str().unwrap()
        );
        assert!(readme.contains(&row), "README row {row}");
    }
}

/// Every file of the repository the docs name exists: a move or a rename
/// updates the docs with it.
#[test]
fn every_file_the_docs_name_exists() {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut docs = vec!["README.md".to_owned()];
    for e in std::fs::read_dir(format!("{root}/docs")).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".md") {
            docs.push(format!("docs/{name}"));
        }
    }
    let mut missing = Vec::new();
    for d in &docs {
        let text = read(d);
        for w in text.split(|c: char| !(c.is_ascii_alphanumeric() || "/_.-".contains(c))) {
            let named = [
                "src/", "tests/", "benches/", "fuzz/", "clients/", "deploy/", "proto/",
            ]
            .iter()
            .any(|p| w.starts_with(p));
            let file = [".rs", ".py", ".ts", ".json", ".sh", ".proto", ".yaml"]
                .iter()
                .any(|x| w.ends_with(x));
            if named && file && !std::path::Path::new(&format!("{root}/{w}")).exists() {
                missing.push(format!("{d}: {w}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "named in the docs but missing: {missing:#?}"
    );
}
