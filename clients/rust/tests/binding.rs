//! Binding v2 and the subject computed in Rust against the service's
//! vectors file (`tests/data/binding-vectors.json`) and the other packages.
use stateseal_rmcp::binding::{canonical, params_digest_of_text, subject_for};

fn vectors() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/binding-vectors.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("the vectors file")).expect("JSON")
}

fn hex(d: [u8; 32]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The vectors whose number serde_json (rmcp's parser) cannot hold: beyond
/// u64, or a decimal no double has. rmcp hands the handler the rounded
/// double (or refuses 1e400 outright), so the digest binds what the handler
/// sees and differs from the service's exact digest of the text.
const NOT_HELD: &[&str] = &[
    "2^64: differs from 2^64-1",
    "1e20+1: differs from 1e20",
    "1.00000000000000001: differs from 1",
    "beyond the double range: accepted, exact",
    "a decimal a double cannot hold exactly: exact form",
];

#[test]
fn every_vector_serde_json_can_hold_matches_the_service() {
    let v = vectors();
    let list = v["vectors"].as_array().expect("vectors");
    assert!(list.len() > 20);
    let mut matched = 0;
    for case in list {
        let note = case["note"].as_str().expect("note");
        let method = case["method"].as_str().expect("method");
        let got = params_digest_of_text(method, case["params"].as_str().expect("params"));
        let want = case["digest_hex"].as_str().expect("digest");
        if NOT_HELD.contains(&note) {
            assert_ne!(
                got.map(hex).ok().as_deref(),
                Some(want),
                "{note}: serde_json holds it after all"
            );
        } else {
            assert_eq!(got.map(hex).as_deref(), Ok(want), "{note}");
            matched += 1;
        }
    }
    assert_eq!(
        matched,
        list.len() - NOT_HELD.len(),
        "a NOT_HELD note is stale"
    );
}

#[test]
fn refused_vectors_are_refused_except_duplicate_keys() {
    let v = vectors();
    for case in v["refused"].as_array().expect("refused") {
        let why = case["why"].as_str().expect("why");
        let got = params_digest_of_text(
            case["method"].as_str().expect("m"),
            case["params"].as_str().expect("p"),
        );
        if why == "duplicate key" {
            // serde_json (and so rmcp) keeps the last of duplicate keys, as
            // Python's and ECMAScript's parsers do: the digest binds what the
            // handler sees, {"name":"u"}.
            assert_eq!(
                got,
                params_digest_of_text("tools/call", r#"{"name":"u"}"#),
                "{why}"
            );
        } else {
            assert!(got.is_err(), "{why}");
        }
    }
}

#[test]
fn exact_numbers() {
    let c = |t: &str| canonical(&serde_json::from_str(t).expect("json")).expect("canonical");
    assert_eq!(c("9007199254740993"), "9007199254740993E0");
    assert_eq!(c("-9007199254740993"), "-9007199254740993E0");
    assert_eq!(c("9007199254740992"), "9007199254740992");
    assert_eq!(c("1152921504606846976"), "1152921504606846976E0");
    assert_eq!(c("9007199254740994"), "9007199254740994");
    assert_eq!(c("18446744073709551615"), "18446744073709551615E0");
    assert_eq!(c("100000000000000000000"), "100000000000000000000");
    assert_eq!(c("-0"), "0");
    assert_eq!(c("-0.0"), "0");
    assert_eq!(c("1e21"), "1e+21");
    assert_eq!(c("42.0"), "42");
    assert_eq!(c("0.1"), "0.1");
    assert_eq!(c("1E-7"), "1e-7");
}

#[test]
fn nesting_deeper_than_the_service_allows_is_refused() {
    use stateseal_rmcp::binding::{params_digest, Bound};
    // Built in memory: serde_json's parser stops at 128 levels by itself.
    let nested = |arrays: usize| {
        let mut v = serde_json::json!(1);
        for _ in 0..arrays {
            v = serde_json::Value::Array(vec![v]);
        }
        serde_json::json!({ "a": v })
            .as_object()
            .cloned()
            .expect("object")
    };
    // params (0) > arguments (1) > 126 arrays (2..=127): the service's limit.
    let ok = nested(126);
    assert!(params_digest(Bound::Named {
        name: "t",
        arguments: Some(&ok)
    })
    .is_ok());
    let deep = nested(127);
    assert!(params_digest(Bound::Named {
        name: "t",
        arguments: Some(&deep)
    })
    .is_err());
}

#[test]
fn subject_matches_the_python_and_typescript_packages() {
    let cases = [
        (
            "transfer-service",
            None,
            "b38d9b19dbcdf908b7b429ef9990b3ec09537f9b4cbb3b6c9b49862cd943c347",
        ),
        (
            "transfer-service",
            Some("[\"c\",null,\"ü\"]"),
            "10e5d7a890f146ff0ba8f1e469b5b1764095bdfe24853648c8983994d651e02b",
        ),
        (
            "dienst-ü",
            Some("[\"c\",\"i\",\"s\"]"),
            "90f8c4fccfea5bcaea6e89c7ba9d05c672ff3ffe232d5a77e3c0b8c4aa37c1ad",
        ),
    ];
    for (audience, principal, hex) in cases {
        assert_eq!(subject_for(audience, principal), format!("mcp:{hex}"));
    }
}
