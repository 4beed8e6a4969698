//! The sealer's own API, without the gRPC edge: every size bound holds at
//! exactly its value and refuses one more, a lease never outlives its token
//! by more than the clock skew, and `Debug` shows figures, never a token or
//! a state.

use std::sync::Arc;

use crate::common::{bind_json, T0};
use stateseal::internals::binding::Tenant;
use stateseal::internals::error::Reject;
use stateseal::internals::keyring::{Keyring, KeyringHandle, KeysetFile};
use stateseal::internals::ledger::sled::SledLedger;
use stateseal::internals::sealer::{Limits, OpenMode, Sealer, Trail, MAX_ATTEMPT_ID};

const MARK: &str = "SECRET-MARKER-7c0a";

fn sealer(dir: &std::path::Path, limits: Limits) -> Sealer {
    let keys = Arc::new(KeyringHandle::new(
        Keyring::from_file(&KeysetFile::generate(T0)).unwrap(),
    ));
    let ledger = Arc::new(SledLedger::open(&dir.join("ledger")).unwrap());
    Sealer::new(
        keys,
        ledger,
        Arc::new(stateseal::internals::clock::WallClock),
        limits,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bound_holds_at_its_value_and_refuses_one_more() {
    let dir = tempfile::tempdir().unwrap();
    let limits = Limits {
        max_state: 16,
        max_params_json: 64,
        max_subject: 8,
        max_ttl: 100,
        ..Limits::default()
    };
    let s = sealer(dir.path(), limits);
    let tenant = Tenant::new("t");

    assert!(s.check_binding(&"s".repeat(8), "tools/call").is_ok());
    assert_eq!(
        s.check_binding(&"s".repeat(9), "tools/call").unwrap_err(),
        Reject::TooLarge
    );
    assert_eq!(
        s.check_binding("", "tools/call").unwrap_err(),
        Reject::Malformed
    );
    // `{"name":"xx…"}` of exactly `len` bytes.
    let params = |len: usize| format!(r#"{{"name":"{}"}}"#, "x".repeat(len - 11));
    assert_eq!(params(64).len(), 64);
    assert!(s.check_params_json(&params(64)).is_ok());
    assert_eq!(
        s.check_params_json(&params(65)).unwrap_err(),
        Reject::TooLarge
    );

    let b = bind_json(&s, &tenant, "alice", "tools/call", &params(64)).unwrap();
    assert!(s.seal(&b, &[7; 16], 0, true, None).is_ok());
    assert_eq!(
        s.seal(&b, &[7; 17], 0, true, None).unwrap_err(),
        Reject::TooLarge
    );
    assert!(s.seal(&b, b"x", 100, true, None).is_ok());
    assert_eq!(
        s.seal(&b, b"x", 101, true, None).unwrap_err(),
        Reject::TooLarge
    );

    let t = s.seal(&b, b"x", 0, false, None).unwrap().token;
    let open = |attempt: String| {
        let s = &s;
        let b = &b;
        let t = t.clone();
        async move {
            s.open(
                b,
                s.precheck(&t).unwrap(),
                OpenMode::Consume,
                Some(&attempt),
                &mut Trail::default(),
            )
            .await
        }
    };
    assert!(open("a".repeat(MAX_ATTEMPT_ID)).await.is_ok());
    assert_eq!(
        open("a".repeat(MAX_ATTEMPT_ID + 1)).await.unwrap_err(),
        Reject::TooLarge
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_ends_at_the_latest_when_its_record_may_go() {
    let dir = tempfile::tempdir().unwrap();
    let limits = Limits {
        clock_skew: 10,
        max_lease: 300,
        ..Limits::default()
    };
    let s = sealer(dir.path(), limits);
    let tenant = Tenant::new("t");
    let b = bind_json(&s, &tenant, "alice", "tools/call", r#"{"name":"t"}"#).unwrap();
    // 60 s: far from expiring on a busy machine, and the cap (expiry + 10 s)
    // still far below the 300 s asked for.
    let sealed = s.seal(&b, b"x", 60, true, None).unwrap();
    let opened = s
        .open(
            &b,
            s.precheck(&sealed.token).unwrap(),
            OpenMode::Reserve { lease_seconds: 300 },
            None,
            &mut Trail::default(),
        )
        .await
        .unwrap();
    let (r, end) = opened.reservation.unwrap();
    assert_eq!(end.until, sealed.expires_at + 10, "token expiry plus skew");
    let renewed = s
        .renew(&tenant, &r, 300, &mut Trail::default())
        .await
        .unwrap();
    assert_eq!(renewed.until, sealed.expires_at + 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_shows_figures_never_tokens_or_state() {
    let dir = tempfile::tempdir().unwrap();
    let s = sealer(dir.path(), Limits::default());
    let tenant = Tenant::new("t");
    let b = bind_json(&s, &tenant, "alice", "tools/call", r#"{"name":"t"}"#).unwrap();
    let sealed = s.seal(&b, MARK.as_bytes(), 60, true, None).unwrap();
    let shown = format!("{sealed:?}");
    assert_eq!(
        shown,
        format!(
            "Sealed {{ token_len: {}, expires_at: {}, key_id: {:?} }}",
            sealed.token.len(),
            sealed.expires_at,
            sealed.key_id
        )
    );
    assert!(!shown.contains(&sealed.token[..16]));

    let mut trail = Trail::default();
    assert_eq!(
        format!("{trail:?}"),
        "Trail { key_id: None, ledger_id: false }"
    );
    let opened = s
        .open(
            &b,
            s.precheck(&sealed.token).unwrap(),
            OpenMode::Consume,
            None,
            &mut trail,
        )
        .await
        .unwrap();
    assert_eq!(
        format!("{opened:?}"),
        format!(
            "OpenedState {{ state_len: {}, expires_at: {}, key_id: {:?}, consumed: true, reserved: false }}",
            MARK.len(),
            sealed.expires_at,
            sealed.key_id
        )
    );
    assert_eq!(
        format!("{trail:?}"),
        format!(
            "Trail {{ key_id: Some({:?}), ledger_id: true }}",
            sealed.key_id
        )
    );
    let shown = format!("{s:?}");
    assert!(
        shown.starts_with(r#"Sealer { ledger: "sled", limits: Limits { max_state: 65536,"#)
            && shown.ends_with(".. }"),
        "{shown}"
    );
}
