//! The sealed manifest of what was asked, end to end over gRPC: Seal
//! validates `inputRequests` (BAD_INPUT_REQUESTS), Open filters
//! `inputResponses` against the questions sealed in the token.
#![allow(clippy::unwrap_used)]

use crate::common::*;
use serde_json::{json, Value};
use stateseal::internals::manifest::CredentialPolicy;
use stateseal::internals::sealer::Limits;
use stateseal::proto::{OpenRequest, SealRequest};
use tonic::Code;

/// Every kind of question the 2026-07-28 schema allows.
fn questions() -> Value {
    json!({
        "confirm": {"method": "elicitation/create", "params": {
            "mode": "form", "message": "Transfer 42?",
            "requestedSchema": {"type": "object",
                "properties": {"confirm": {"type": "boolean"}},
                "required": ["confirm"]}}},
        "profile": {"method": "elicitation/create", "params": {
            "message": "Who are you?",
            "requestedSchema": {"type": "object", "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 8},
                "email": {"type": "string", "format": "email"},
                "born": {"type": "string", "format": "date"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "score": {"type": "number", "maximum": 1.5},
                "color": {"type": "string", "enum": ["red", "green"]},
                "size": {"type": "string", "oneOf": [{"const": "s", "title": "Small"}, {"const": "l", "title": "Large"}]},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 2}
            }, "required": ["name"]}}},
        "login": {"method": "elicitation/create", "params": {
            "mode": "url", "message": "Sign in", "elicitationId": "e-1",
            "url": "https://auth.example.com/start?x=1"}},
        "summary": {"method": "sampling/createMessage", "params": {
            "messages": [{"role": "user", "content": {"type": "text", "text": "hi"}}],
            "maxTokens": 100}},
        "roots": {"method": "roots/list", "params": {}}
    })
}

fn seal_with(questions: &str, single_use: bool) -> SealRequest {
    SealRequest {
        input_requests_json: questions.into(),
        ..seal_req(b"s", single_use)
    }
}

fn open_with(token: &str, answers: &str) -> OpenRequest {
    OpenRequest {
        input_responses_json: answers.into(),
        ..open_req(token)
    }
}

async fn sealed(s: &mut TestServer, q: &Value, single_use: bool) -> String {
    s.client
        .seal(seal_with(&q.to_string(), single_use))
        .await
        .unwrap()
        .into_inner()
        .request_state
}

/// Opens with `answers`; returns the kept answers and the drops (sorted).
async fn filter(s: &mut TestServer, token: &str, answers: Value) -> (Value, Vec<(String, String)>) {
    let o = s
        .client
        .open(open_with(token, &answers.to_string()))
        .await
        .unwrap()
        .into_inner();
    let mut dropped: Vec<_> = o.dropped.into_iter().map(|d| (d.key, d.reason)).collect();
    dropped.sort();
    (
        serde_json::from_str(&o.input_responses_json).unwrap(),
        dropped,
    )
}

fn drops(v: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut d: Vec<_> = v
        .iter()
        .map(|(k, r)| (k.to_string(), r.to_string()))
        .collect();
    d.sort();
    d
}

#[tokio::test]
async fn valid_answers_pass_unchanged() {
    let mut s = start().await;
    let t = sealed(&mut s, &questions(), false).await;
    let answers = json!({
        "confirm": {"action": "accept", "content": {"confirm": true}},
        "profile": {"action": "accept", "content": {
            "name": "Ann", "email": "ann@example.com", "born": "1990-02-28", "age": 36,
            "score": 1.25, "color": "red", "size": "l", "tags": ["a", "c"]}},
        "login": {"action": "accept"},
        "summary": {"role": "assistant", "content": {"type": "text", "text": "ok"}, "model": "m"},
        "roots": {"roots": [{"uri": "file:///srv"}]}
    });
    let (kept, dropped) = filter(&mut s, &t, answers.clone()).await;
    assert_eq!(kept, answers);
    assert!(dropped.is_empty(), "{dropped:?}");
}

#[tokio::test]
async fn unasked_keys_and_wrong_kinds_are_dropped() {
    let mut s = start().await;
    let t = sealed(&mut s, &questions(), false).await;
    let (kept, dropped) = filter(
        &mut s,
        &t,
        json!({
            "confirm": {"action": "accept", "content": {"confirm": true}},
            "admin_override": {"action": "accept", "content": {"admin": true}},
            // A sampling answer to an elicitation, an elicitation answer to
            // sampling, a bad action, roots without roots.
            "profile": {"role": "user", "content": {"type": "text", "text": "x"}},
            "summary": {"action": "accept"},
            "login": {"action": "approve"},
            "roots": {"action": "accept"}
        }),
    )
    .await;
    assert_eq!(
        kept,
        json!({"confirm": {"action": "accept", "content": {"confirm": true}}})
    );
    assert_eq!(
        dropped,
        drops(&[
            ("admin_override", "UNASKED"),
            ("profile", "KIND_MISMATCH"),
            ("summary", "KIND_MISMATCH"),
            ("login", "KIND_MISMATCH"),
            ("roots", "KIND_MISMATCH"),
        ])
    );
}

#[tokio::test]
async fn url_mode_accept_carries_no_content() {
    let mut s = start().await;
    let t = sealed(&mut s, &questions(), false).await;
    let (kept, dropped) = filter(
        &mut s,
        &t,
        json!({"login": {"action": "accept", "content": {"access_token": "xyz"}, "_meta": {"k": 1}}}),
    )
    .await;
    assert_eq!(
        kept,
        json!({"login": {"action": "accept", "_meta": {"k": 1}}})
    );
    assert_eq!(dropped, drops(&[("login", "URL_CONTENT")]));
    // decline / cancel never carry content either.
    let (kept, dropped) = filter(
        &mut s,
        &t,
        json!({"confirm": {"action": "decline", "content": {"confirm": true}}}),
    )
    .await;
    assert_eq!(kept, json!({"confirm": {"action": "decline"}}));
    assert_eq!(dropped, drops(&[("confirm", "UNEXPECTED_CONTENT")]));
}

#[tokio::test]
async fn form_content_is_checked_against_its_schema() {
    let mut s = start().await;
    let t = sealed(&mut s, &questions(), false).await;
    let ok = json!({"name": "Ann"});
    let cases = [
        // type
        json!({"confirm": "yes"}),
        json!({"name": 7}),
        json!({"name": "Ann", "age": 1.5}),
        json!({"name": "Ann", "age": "36"}),
        json!({"name": "Ann", "score": "1"}),
        // bounds
        json!({"name": ""}),
        json!({"name": "Annabelle-Marie"}),
        json!({"name": "Ann", "age": -1}),
        json!({"name": "Ann", "age": 151}),
        json!({"name": "Ann", "score": 1.6}),
        json!({"name": "Ann", "tags": ["a", "b", "c"]}),
        // enums
        json!({"name": "Ann", "color": "blue"}),
        json!({"name": "Ann", "size": "Small"}),
        json!({"name": "Ann", "tags": ["d"]}),
        json!({"name": "Ann", "tags": ["a", "a"]}),
        // formats
        json!({"name": "Ann", "email": "not-an-email"}),
        json!({"name": "Ann", "born": "1990-02-30"}),
        // required, unknown fields
        json!({"email": "ann@example.com"}),
        json!({"name": "Ann", "admin": true}),
    ];
    for (i, content) in cases.iter().enumerate() {
        let key = if i == 0 { "confirm" } else { "profile" };
        let (kept, dropped) = filter(
            &mut s,
            &t,
            json!({key: {"action": "accept", "content": content}}),
        )
        .await;
        assert_eq!(kept, json!({}), "case {i}: {content}");
        assert_eq!(dropped, drops(&[(key, "INVALID_CONTENT")]), "case {i}");
    }
    // accept without content: only when nothing is required.
    let (_, dropped) = filter(&mut s, &t, json!({"confirm": {"action": "accept"}})).await;
    assert_eq!(dropped, drops(&[("confirm", "INVALID_CONTENT")]));
    let (kept, dropped) = filter(
        &mut s,
        &t,
        json!({"profile": {"action": "accept", "content": ok}}),
    )
    .await;
    assert!(dropped.is_empty());
    assert_eq!(kept["profile"]["content"], ok);
}

#[tokio::test]
async fn answers_without_a_manifest_come_back_verbatim() {
    let mut s = start().await;
    let t = s
        .client
        .seal(seal_req(b"s", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    // Not re-serialized: the exact text (spacing, order, big numbers).
    let raw = r#"{ "b": {"action":"accept","content":{"n":18446744073709551617}}, "a": 1 }"#;
    let o = s
        .client
        .open(open_with(&t, raw))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(o.input_responses_json, raw);
    assert!(o.dropped.is_empty());
    // No answers asked about: none returned.
    let o = s.client.open(open_req(&t)).await.unwrap().into_inner();
    assert_eq!(o.input_responses_json, "");
}

/// Issue 58, finding 1: a round that answers `input_required` with only a
/// state ("still working, call again") is sealed with a manifest of no
/// questions, and a forged answer on its retry reaches no handler.
#[tokio::test]
async fn a_round_that_asked_nothing_lets_no_answer_through() {
    let mut s = start().await;
    for single_use in [false, true] {
        let t = sealed(&mut s, &json!({}), single_use).await;
        let forged = json!({"confirm": {"action": "accept", "content": {"ok": true}},
            "r": {"roots": []}});
        let (kept, dropped) = filter(&mut s, &t, forged).await;
        assert_eq!(kept, json!({}), "single_use {single_use}");
        assert_eq!(
            dropped,
            vec![
                ("confirm".to_owned(), "UNASKED".to_owned()),
                ("r".to_owned(), "UNASKED".to_owned())
            ],
            "single_use {single_use}"
        );
    }
    // Without answers it opens as any token does, its state intact.
    let t = sealed(&mut s, &json!({}), false).await;
    let o = s.client.open(open_req(&t)).await.unwrap().into_inner();
    assert_eq!(o.state, b"s");
    assert_eq!(o.input_responses_json, "");
}

#[tokio::test]
async fn kept_answers_keep_their_exact_numbers() {
    let mut s = start().await;
    let q = json!({"n": {"method": "elicitation/create", "params": {"message": "n?",
        "requestedSchema": {"type": "object", "properties": {"n": {"type": "integer"}}}}}});
    let t = sealed(&mut s, &q, false).await;
    let raw = r#"{"n":{"action":"accept","content":{"n":9007199254740993}}}"#;
    let o = s
        .client
        .open(open_with(&t, raw))
        .await
        .unwrap()
        .into_inner();
    assert!(o.dropped.is_empty());
    assert_eq!(o.input_responses_json, raw);
    // Beyond any double: well-formed JSON, so not MALFORMED, but no bound
    // can be judged on it, so the answer is dropped as INVALID_CONTENT (a
    // fuzz finding: it once reached code that assumed a double).
    let raw = r#"{"n":{"action":"accept","content":{"n":3e66765}}}"#;
    let o = s
        .client
        .open(open_with(&t, raw))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(o.input_responses_json, "{}");
    assert_eq!(o.dropped.len(), 1);
    assert_eq!(o.dropped[0].key, "n");
    assert_eq!(o.dropped[0].reason, "INVALID_CONTENT");
}

/// Bounds written with more digits than a double holds are kept as
/// written (found by review: they were read as their double).
#[tokio::test]
async fn number_bounds_are_kept_as_written() {
    let mut s = start().await;
    let q = r#"{
        "a": {"method": "elicitation/create", "params": {"message": "n?", "requestedSchema":
            {"type": "object", "properties": {"n": {"type": "number", "maximum": 9007199254740993.5}}}}},
        "b": {"method": "elicitation/create", "params": {"message": "n?", "requestedSchema":
            {"type": "object", "properties": {"n": {"type": "integer", "maximum": 18446744073709551616}}}}},
        "c": {"method": "elicitation/create", "params": {"message": "n?", "requestedSchema":
            {"type": "object", "properties": {"n": {"type": "number", "minimum": 100.0000000000000001}}}}}}"#;
    let t = s
        .client
        .seal(seal_with(q, false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let cases = [
        ("a", "9007199254740993.9", false),
        ("a", "9007199254740993.5", true),
        ("b", "18446744073709551617", false),
        ("b", "18446744073709551616", true),
        ("c", "100.00000000000000005", false),
        ("c", "100.0000000000000001", true),
    ];
    for (key, n, kept) in cases {
        let raw = format!(r#"{{"{key}":{{"action":"accept","content":{{"n":{n}}}}}}}"#);
        let o = s
            .client
            .open(open_with(&t, &raw))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(o.dropped.is_empty(), kept, "{key} {n}: {:?}", o.dropped);
    }
}

/// Bounds and integer-ness are judged on the exact decimal value written,
/// never on its double (where 9007199254740993 is 9007199254740992 and
/// 100.0000000000000001 is 100).
#[tokio::test]
async fn number_bounds_are_exact() {
    let mut s = start().await;
    let q = json!({
        "big": {"method": "elicitation/create", "params": {"message": "n?",
            "requestedSchema": {"type": "object", "properties": {
                "n": {"type": "number", "maximum": 9007199254740992u64}}}}},
        "int": {"method": "elicitation/create", "params": {"message": "n?",
            "requestedSchema": {"type": "object", "properties": {
                "n": {"type": "integer", "maximum": 100, "minimum": -5}}}}}});
    let t = sealed(&mut s, &q, false).await;
    let cases = [
        ("big", "9007199254740993", false),
        ("big", "9007199254740992", true),
        ("big", "9007199254740991.5", true),
        ("int", "100.0000000000000001", false),
        ("int", "100", true),
        ("int", "1e2", true),
        ("int", "100.0", true),
        ("int", "99.5", false),
        ("int", "-5", true),
        ("int", "-5.0000000000000001", false),
        ("int", "-6", false),
    ];
    for (key, n, kept) in cases {
        let raw = format!(r#"{{"{key}":{{"action":"accept","content":{{"n":{n}}}}}}}"#);
        let o = s
            .client
            .open(open_with(&t, &raw))
            .await
            .unwrap()
            .into_inner();
        if kept {
            assert!(o.dropped.is_empty(), "{key} {n}: {:?}", o.dropped);
            assert_eq!(o.input_responses_json, raw, "{key} {n}: kept byte for byte");
        } else {
            assert_eq!(
                o.dropped
                    .iter()
                    .map(|d| (d.key.as_str(), d.reason.as_str()))
                    .collect::<Vec<_>>(),
                vec![(key, "INVALID_CONTENT")],
                "{key} {n}"
            );
        }
    }
}

#[tokio::test]
async fn malformed_answers_are_refused_before_the_token_is_consumed() {
    let mut s = start().await;
    let t = sealed(&mut s, &questions(), true).await;
    for bad in [
        "[]",
        "{",
        r#"{"confirm":{"action":"accept"},"confirm":{"action":"decline"}}"#,
        r#"{"confirm":{"action":"accept","content":{"confirm":true,"confirm":false}}}"#,
    ] {
        let err = s.client.open(open_with(&t, bad)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{bad}");
        assert_eq!(reason(&err), "MALFORMED", "{bad}");
    }
    // The single-use token is still there for a well-formed retry.
    let o = s
        .client
        .open(open_with(
            &t,
            r#"{"confirm":{"action":"accept","content":{"confirm":true}}}"#,
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(o.consumed);
    assert!(o.dropped.is_empty());
}

#[tokio::test]
async fn bad_input_requests_are_refused() {
    let mut s = start().await;
    let form = |props: Value| {
        json!({"q": {"method": "elicitation/create", "params": {"message": "m",
            "requestedSchema": {"type": "object", "properties": props}}}})
        .to_string()
    };
    let cases: Vec<(&str, String)> = vec![
        ("not an object", "[]".into()),
        ("not JSON", "{".into()),
        ("duplicate keys", r#"{"a":{"method":"roots/list"},"a":{"method":"roots/list"}}"#.into()),
        ("empty key", r#"{"":{"method":"roots/list"}}"#.into()),
        ("unknown method", r#"{"a":{"method":"tools/call","params":{}}}"#.into()),
        ("no method", r#"{"a":{"params":{}}}"#.into()),
        ("elicitation without message", r#"{"a":{"method":"elicitation/create","params":{"requestedSchema":{"type":"object","properties":{}}}}}"#.into()),
        ("unknown mode", r#"{"a":{"method":"elicitation/create","params":{"mode":"voice","message":"m"}}}"#.into()),
        ("form without schema", r#"{"a":{"method":"elicitation/create","params":{"message":"m"}}}"#.into()),
        ("schema not an object type", r#"{"a":{"method":"elicitation/create","params":{"message":"m","requestedSchema":{"type":"array","properties":{}}}}}"#.into()),
        ("nested object", form(json!({"addr": {"type": "object", "properties": {}}}))),
        ("array of objects", form(json!({"xs": {"type": "array", "items": {"type": "object"}}}))),
        ("unknown type", form(json!({"x": {"type": "null"}}))),
        ("enum of numbers", form(json!({"x": {"type": "string", "enum": [1, 2]}}))),
        ("bad format", form(json!({"x": {"type": "string", "format": "ipv4"}}))),
        ("negative length", form(json!({"x": {"type": "string", "minLength": -1}}))),
        ("min above max", form(json!({"x": {"type": "number", "minimum": 2, "maximum": 1}}))),
        ("required not a property", json!({"q": {"method": "elicitation/create", "params": {"message": "m",
            "requestedSchema": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["b"]}}}}).to_string()),
        ("url mode with a non-string id", r#"{"a":{"method":"elicitation/create","params":{"mode":"url","message":"m","elicitationId":7,"url":"https://x.example"}}}"#.into()),
        ("url mode over http", r#"{"a":{"method":"elicitation/create","params":{"mode":"url","message":"m","elicitationId":"e","url":"http://x.example/"}}}"#.into()),
        ("url mode javascript", r#"{"a":{"method":"elicitation/create","params":{"mode":"url","message":"m","elicitationId":"e","url":"javascript:alert(1)"}}}"#.into()),
        // A WHATWG parser (a browser, Node) reads the host as evil.example.
        ("url mode backslash before @", r#"{"a":{"method":"elicitation/create","params":{"mode":"url","message":"m","elicitationId":"e","url":"http://evil.example\\@localhost/"}}}"#.into()),
        ("url mode backslash before @ v4", r#"{"a":{"method":"elicitation/create","params":{"mode":"url","message":"m","elicitationId":"e","url":"http://evil.example\\@127.0.0.1/"}}}"#.into()),
        ("sampling without maxTokens", r#"{"a":{"method":"sampling/createMessage","params":{"messages":[]}}}"#.into()),
        ("password field", form(json!({"password": {"type": "string"}}))),
        ("api key by title", form(json!({"k": {"type": "string", "title": "Your API key"}}))),
        ("card number", form(json!({"card_number": {"type": "string"}}))),
        ("access token", form(json!({"accessToken": {"type": "string"}}))),
    ];
    for (what, q) in cases {
        let err = s.client.seal(seal_with(&q, false)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{what}");
        assert_eq!(reason(&err), "BAD_INPUT_REQUESTS", "{what}");
    }
    // Loopback http is allowed for URL mode (local development), and the
    // 2026-07-28 URL mode carries no elicitationId.
    for ok in [
        r#"{"a":{"method":"elicitation/create","params":{"mode":"url","message":"m","elicitationId":"e","url":"http://127.0.0.1:8080/cb"}}}"#,
        r#"{"a":{"method":"elicitation/create","params":{"mode":"url","message":"m","url":"https://x.example/"}}}"#,
    ] {
        s.client.seal(seal_with(ok, false)).await.unwrap();
    }
}

#[tokio::test]
async fn credential_policy_warn_and_off_seal() {
    let q = json!({"q": {"method": "elicitation/create", "params": {"message": "m",
        "requestedSchema": {"type": "object", "properties": {"password": {"type": "string"}}}}}})
    .to_string();
    for policy in [CredentialPolicy::Warn, CredentialPolicy::Off] {
        let mut s = TestServer::builder()
            .limits(Limits {
                credential_policy: policy,
                ..Limits::default()
            })
            .start()
            .await;
        let t = s
            .client
            .seal(seal_with(&q, false))
            .await
            .unwrap()
            .into_inner()
            .request_state;
        let (kept, dropped) = filter(
            &mut s,
            &t,
            json!({"q": {"action": "accept", "content": {"password": "hunter2"}}}),
        )
        .await;
        assert!(dropped.is_empty(), "{policy:?}");
        assert_eq!(kept["q"]["content"]["password"], "hunter2");
    }
}

#[tokio::test]
async fn input_sizes_are_bounded() {
    let mut s = TestServer::builder()
        .limits(Limits {
            max_input_json: 1024,
            ..Limits::default()
        })
        .start()
        .await;
    let big = format!(
        r#"{{"a":{{"method":"roots/list","params":{{"pad":"{}"}}}}}}"#,
        "x".repeat(1100)
    );
    let err = s.client.seal(seal_with(&big, false)).await.unwrap_err();
    assert_eq!(reason(&err), "TOO_LARGE");
    let t = sealed(&mut s, &json!({"a": {"method": "roots/list"}}), false).await;
    let err = s.client.open(open_with(&t, &big)).await.unwrap_err();
    assert_eq!(reason(&err), "TOO_LARGE");
    // A manifest too large for a token (64 questions of 64 fields with long
    // enums) is refused, not truncated.
    let mut s = start().await;
    let mut props = serde_json::Map::new();
    for f in 0..64 {
        let choices: Vec<String> = (0..8)
            .map(|c| format!("choice-{c}-{}", "y".repeat(20)))
            .collect();
        props.insert(
            format!("field{f}"),
            json!({"type": "string", "enum": choices}),
        );
    }
    let mut q = serde_json::Map::new();
    for i in 0..4 {
        q.insert(
            format!("q{i}"),
            json!({"method": "elicitation/create", "params": {"message": "m",
                "requestedSchema": {"type": "object", "properties": props}}}),
        );
    }
    let err = s
        .client
        .seal(seal_with(&Value::Object(q).to_string(), false))
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "TOO_LARGE");
}

/// The size cost of a manifest: the MRTR example's one boolean question adds
/// 2 + 63 bytes to the token's binary form (87 base64 characters).
#[tokio::test]
async fn manifest_size_cost() {
    let mut s = start().await;
    let q = json!({"confirm": {"method": "elicitation/create", "params": {
        "mode": "form", "message": "Transfer 42?",
        "requestedSchema": {"type": "object", "properties": {"confirm": {"type": "boolean"}},
                            "required": ["confirm"]}}}});
    let with = sealed(&mut s, &q, true).await;
    let without = s
        .client
        .seal(seal_req(b"s", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let (m, _) =
        stateseal::internals::manifest::Manifest::build(&q.to_string(), CredentialPolicy::Deny)
            .unwrap();
    let encoded = m.encode().unwrap();
    assert_eq!(
        std::str::from_utf8(&encoded).unwrap(),
        r#"{"confirm":{"k":"f","p":{"confirm":{"t":"b"}},"r":["confirm"]}}"#
    );
    assert_eq!(
        with.len(),
        stateseal::internals::token::encoded_len(49 + 2 + encoded.len() + 1)
    );
    assert_eq!(
        without.len(),
        stateseal::internals::token::encoded_len(49 + 1)
    );
    assert_eq!(with.len() - without.len(), 87);
}

#[tokio::test]
async fn a_repeated_attempt_gets_the_same_filtered_answers() {
    let mut s = start().await;
    let t = sealed(&mut s, &questions(), true).await;
    let answers = json!({"confirm": {"action": "accept", "content": {"confirm": true}}, "x": {}});
    let mut seen = Vec::new();
    for _ in 0..2 {
        let o = s
            .client
            .open(OpenRequest {
                attempt_id: "attempt-1".into(),
                ..open_with(&t, &answers.to_string())
            })
            .await
            .unwrap()
            .into_inner();
        assert!(o.consumed);
        seen.push((o.input_responses_json, o.dropped));
    }
    assert_eq!(seen[0], seen[1]);
    assert_eq!(seen[0].1.len(), 1);
}
