//! The binding profile's vectors: `tests/data/binding-vectors.json`, the one
//! file every adapter (Python, TypeScript, …) tests its binding v2 digest
//! against. This test regenerates it from the implementation and compares;
//! after an intended change run `STATESEAL_REGENERATE_BINDING=1 cargo test
//! --test it binding_vectors::` and review the diff. It also checks the
//! properties the vectors stand for: exact numbers never collide, spellings
//! of one value always agree.
#![allow(clippy::unwrap_used)]

use crate::common::hex;
use stateseal::internals::binding::{params_digest_v2, Method};

/// (method, params text, what it shows)
const CASES: &[(&str, &str, &str)] = &[
    (
        "tools/call",
        r#"{"name":"transfer","arguments":{"amount":42}}"#,
        "basic",
    ),
    (
        "tools/call",
        r#"{"arguments":{"amount":42},"name":"transfer"}"#,
        "key order: same digest as basic",
    ),
    (
        "tools/call",
        "{ \"name\" : \"transfer\" ,\n \"arguments\" : { \"amount\" : 42.0 } }",
        "whitespace and 42.0: same digest as basic",
    ),
    (
        "tools/call",
        r#"{"name":"transfer","arguments":{"amount":42},"_meta":{"progressToken":1},"requestState":"x","inputResponses":{"a":1},"task":{"ttl":1}}"#,
        "extra members ignored: same digest as basic",
    ),
    ("tools/call", r#"{"name":"t"}"#, "absent arguments"),
    (
        "tools/call",
        r#"{"name":"t","arguments":null}"#,
        "null arguments: same as absent",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{}}"#,
        "empty arguments: same as absent",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":9007199254740992}}"#,
        "2^53",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":9007199254740993}}"#,
        "2^53+1: differs from 2^53",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":18446744073709551615}}"#,
        "2^64-1",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":18446744073709551616}}"#,
        "2^64: differs from 2^64-1",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":1e20}}"#,
        "1e20",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":100000000000000000001}}"#,
        "1e20+1: differs from 1e20",
    ),
    ("tools/call", r#"{"name":"t","arguments":{"n":1}}"#, "1"),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":1.00000000000000001}}"#,
        "1.00000000000000001: differs from 1",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":1e400}}"#,
        "beyond the double range: accepted, exact",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":-0}}"#,
        "-0: same value as 0",
    ),
    ("tools/call", r#"{"name":"t","arguments":{"n":0}}"#, "0"),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":0.1}}"#,
        "0.1 (RFC 8785 form)",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":1E-7}}"#,
        "1e-7 (RFC 8785 form)",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"n":333333333.33333329}}"#,
        "a decimal a double cannot hold exactly: exact form",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"s":"é😀\u00e9\ud83d\ude00\u001f"}}"#,
        "unicode and escapes",
    ),
    (
        "tools/call",
        r#"{"name":"t","arguments":{"b":[1,{"z":true,"a":null}],"a":"x"}}"#,
        "nested key order",
    ),
    (
        "prompts/get",
        r#"{"name":"greet","arguments":{"who":"world"}}"#,
        "prompts/get",
    ),
    (
        "resources/read",
        r#"{"uri":"file:///tmp/a.txt","_meta":{"x":1}}"#,
        "resources/read binds the uri only",
    ),
];

fn digest(method: &str, params: &str) -> String {
    hex(&params_digest_v2(Method::parse(method).unwrap(), params)
        .unwrap()
        .0)
}

#[test]
fn vectors_file_matches_the_implementation() {
    let vectors: Vec<serde_json::Value> = CASES
        .iter()
        .map(|(m, p, note)| {
            serde_json::json!({"method": m, "params": p, "digest_hex": digest(m, p), "note": note})
        })
        .collect();
    let doc = serde_json::json!({
        "profile": "stateseal MCP binding v2 (docs/token-format.md)",
        "digest": "SHA-256 of the canonical form of {\"arguments\":A,\"name\":N} (tools/call, prompts/get; A = {} when absent or null) or {\"uri\":U} (resources/read); RFC 8785 with exact numbers",
        "refused": [
            {"method": "tools/call", "params": "{\"arguments\":{}}", "why": "no name"},
            {"method": "tools/call", "params": "{\"name\":\"t\",\"arguments\":[1]}", "why": "arguments not an object"},
            {"method": "tools/call", "params": "{\"name\":\"t\",\"name\":\"u\"}", "why": "duplicate key"},
            {"method": "resources/read", "params": "{\"uri\":1}", "why": "uri not a string"}
        ],
        "vectors": vectors,
    });
    let text = serde_json::to_string_pretty(&doc).unwrap() + "\n";
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/binding-vectors.json"
    );
    if std::env::var_os("STATESEAL_REGENERATE_BINDING").is_some() {
        std::fs::write(path, &text).unwrap();
    }
    let committed = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e}; regenerate with STATESEAL_REGENERATE_BINDING=1"));
    assert_eq!(
        committed, text,
        "binding vectors changed; regenerate and review"
    );
    for r in doc["refused"].as_array().unwrap() {
        let m = Method::parse(r["method"].as_str().unwrap()).unwrap();
        assert!(
            params_digest_v2(m, r["params"].as_str().unwrap()).is_err(),
            "{r}"
        );
    }
}

#[test]
fn what_the_notes_say_holds() {
    let d = |i: usize| digest(CASES[i].0, CASES[i].1);
    // Same value, other spelling or extra members: same digest.
    assert_eq!(d(0), d(1));
    assert_eq!(d(0), d(2));
    assert_eq!(d(0), d(3));
    assert_eq!(d(4), d(5));
    assert_eq!(d(4), d(6));
    assert_eq!(d(16), d(17));
    // Different values: different digests.
    assert_ne!(d(7), d(8));
    assert_ne!(d(9), d(10));
    assert_ne!(d(11), d(12));
    assert_ne!(d(13), d(14));
    // Every other pair differs.
    let all: Vec<String> = (0..CASES.len()).map(d).collect();
    let same = [
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 2),
        (1, 3),
        (2, 3),
        (4, 5),
        (4, 6),
        (5, 6),
        (16, 17),
    ];
    for i in 0..all.len() {
        for j in i + 1..all.len() {
            if !same.contains(&(i, j)) {
                assert_ne!(all[i], all[j], "{} vs {}", CASES[i].2, CASES[j].2);
            }
        }
    }
}
