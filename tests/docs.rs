//! The documentation stays true to the code: every rejection reason is in
//! the README's error table, and every `serve` flag is documented in docs/.
#![allow(clippy::unwrap_used)]

mod common;

fn read(p: &str) -> String {
    std::fs::read_to_string(format!("{}/{p}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

#[test]
fn every_reason_is_in_the_readme_error_table() {
    let readme = read("README.md");
    for r in stateseal::error::Reject::ALL {
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
    let out = common::process::command()
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
