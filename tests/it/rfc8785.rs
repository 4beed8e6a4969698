//! The params digest must match RFC 8785 byte for byte: every reference input
//! canonicalizes to exactly its reference output (vectors in tests/data/rfc8785,
//! from the JCS author's test set).
#![allow(clippy::unwrap_used)]

use sha2::{Digest, Sha256};
use stateseal::internals::binding::{canonical_json, params_digest};

const NAMES: [&str; 6] = [
    "arrays",
    "french",
    "structures",
    "unicode",
    "values",
    "weird",
];

fn read(kind: &str, name: &str) -> Vec<u8> {
    let p = format!(
        "{}/tests/data/rfc8785/{kind}/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

#[test]
fn every_reference_input_canonicalizes_to_its_reference_output() {
    for name in NAMES {
        let input = String::from_utf8(read("input", name)).unwrap();
        let want = read("output", name);
        let got = canonical_json(&input).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&want),
            "vector {name}"
        );
        assert_eq!(Sha256::digest(&got), Sha256::digest(&want), "vector {name}");
    }
}

#[test]
fn params_digest_of_an_object_vector_is_sha256_of_its_canonical_form() {
    // Object vectors carry none of the excluded members, so the params digest
    // is exactly SHA-256 of the reference output.
    for name in ["french", "structures", "unicode", "values", "weird"] {
        let input = String::from_utf8(read("input", name)).unwrap();
        let want: [u8; 32] = Sha256::digest(read("output", name)).into();
        assert_eq!(params_digest(&input).unwrap().0, want, "vector {name}");
    }
}

#[test]
fn number_forms_and_escapes() {
    let cases = [
        (r#"[1.0, 1e0, 10E-1, 0.1e1, -0]"#, "[1,1,1,1,0]"),
        (
            r#"[1e21, 1e20, 0.000001, 1e-7]"#,
            "[1e+21,100000000000000000000,0.000001,1e-7]",
        ),
        (r#"[9007199254740993]"#, "[9007199254740992]"),
        (r#"["\u0041\u00e9\ud83d\ude00", "\/"]"#, "[\"Aé😀\",\"/\"]"),
        (
            r#"{"b":1,"a":{"d":2,"c":3}}"#,
            r#"{"a":{"c":3,"d":2},"b":1}"#,
        ),
        // Keys sort by UTF-16 code units: U+FB33 sorts before U+1F602 in UTF-16.
        (r#"{"😂":1,"דּ":2}"#, r#"{"דּ":2,"😂":1}"#),
    ];
    for (input, want) in cases {
        let got = canonical_json(input).unwrap();
        assert_eq!(String::from_utf8(got).unwrap(), want, "input {input}");
    }
}
