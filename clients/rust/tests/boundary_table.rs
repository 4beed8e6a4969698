//! The boundary's answers to failed stateseal calls against the table all
//! three packages share, `clients/boundary.json`: every stateseal reason
//! (`proto/stateseal/v1/reasons.json`) and every gRPC status without one,
//! under every setting of `on_replay` and `reask`.
use serde_json::{json, Value};
use stateseal_rmcp::refusal::{
    call_refusal, open_refusal, renewal_lost, resend, retry_commit, Level, Refusal,
};
use stateseal_rmcp::{code_name, OnReplay, StatesealError};
use tonic::Code;

fn load(rel: &str) -> Value {
    let path = format!("{}/../../{rel}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(path).expect(rel)).expect("JSON")
}

const CODES: [Code; 16] = [
    Code::Cancelled,
    Code::Unknown,
    Code::InvalidArgument,
    Code::DeadlineExceeded,
    Code::NotFound,
    Code::AlreadyExists,
    Code::PermissionDenied,
    Code::ResourceExhausted,
    Code::FailedPrecondition,
    Code::Aborted,
    Code::OutOfRange,
    Code::Unimplemented,
    Code::Internal,
    Code::Unavailable,
    Code::DataLoss,
    Code::Unauthenticated,
];

fn code(name: &str) -> Code {
    *CODES
        .iter()
        .find(|c| code_name(**c) == name)
        .unwrap_or_else(|| panic!("no gRPC code {name}"))
}

fn row(r: &Refusal) -> Value {
    let log = match r.log {
        Level::Info => "info",
        Level::Warn => "warn",
        Level::Error => "error",
    };
    if r.kind.name() == "reask" {
        return json!({"kind": "reask", "log": log});
    }
    json!({
        "kind": r.kind.name(),
        "code": r.code,
        "message": r.message,
        "data": r.data_reason.map(|d| json!({"reason": d})),
        "log": log,
    })
}

#[test]
fn the_table_covers_every_reason_and_every_status() {
    let table = load("clients/boundary.json");
    let reasons = load("proto/stateseal/v1/reasons.json");
    let seen: Vec<(String, bool)> = table["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            (
                c["error"]["reason"].as_str().expect("reason").to_owned(),
                c["error"]["from_stateseal"] == true,
            )
        })
        .collect();
    for r in reasons["reasons"].as_array().expect("reasons") {
        let name = r["reason"].as_str().expect("reason").to_owned();
        assert!(seen.contains(&(name.clone(), true)), "{name}");
    }
    for c in CODES {
        assert!(
            seen.contains(&(code_name(c).to_owned(), false)),
            "{}",
            code_name(c)
        );
    }
}

#[test]
fn every_row_is_answered_as_the_table_says() {
    let table = load("clients/boundary.json");
    let cases = table["cases"].as_array().expect("cases");
    assert!(cases.len() >= 30);
    for c in cases {
        let e = &c["error"];
        let err = StatesealError {
            reason: e["reason"].as_str().expect("reason").to_owned(),
            code: code(e["code"].as_str().expect("code")),
            message: String::new(),
            from_stateseal: e["from_stateseal"] == true,
        };
        for o in c["open"].as_array().expect("open") {
            let on_replay = if o["config"]["on_replay"] == "reask" {
                OnReplay::Reask
            } else {
                OnReplay::Error
            };
            let reask = o["config"]["reask"] == true;
            assert_eq!(
                row(&open_refusal(&err, on_replay, reask)),
                o["then"],
                "{e} {}",
                o["config"]
            );
        }
        assert_eq!(row(&call_refusal(&err, true)), c["seal"], "{e} seal");
        assert_eq!(
            resend(&err),
            c["resend_open_or_release"] == true,
            "{e} resend"
        );
        assert_eq!(
            retry_commit(&err),
            c["retry_commit"] == true,
            "{e} retry_commit"
        );
        assert_eq!(
            renewal_lost(&err),
            c["renewal_lost"] == true,
            "{e} renewal_lost"
        );
    }
}
