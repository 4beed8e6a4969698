//! Secret hygiene: `Debug` of every type that holds state, a token, a key
//! or a secret; logs at `trace` for every crate on the PostgreSQL ledger;
//! core dumps off in the running binary; no reload watcher can die.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use crate::common::process::spawn;
use crate::common::*;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use stateseal::internals::binding::{params_digest, Binding, Method, Tenant};
use stateseal::internals::keyring::{Keyring, KeysetFile};
use stateseal::internals::token::UntrustedToken;
use stateseal::proto;

const MARK: &str = "SECRET-MARKER-5d1e";

fn assert_hidden(what: &str, debug: String) {
    assert!(
        !debug.contains(MARK),
        "{what} Debug shows secret bytes: {debug}"
    );
    let hex: String = MARK.bytes().map(|b| format!("{b:02x}")).collect();
    assert!(!debug.contains(&hex), "{what} Debug shows hex: {debug}");
    let bytes = format!("{:?}", &MARK.as_bytes()[..6]);
    let bytes = bytes.trim_matches(|c| c == '[' || c == ']');
    assert!(!debug.contains(bytes), "{what} Debug shows bytes: {debug}");
}

#[test]
fn debug_never_shows_state_tokens_subjects_or_params() {
    let b = proto::Binding {
        subject: MARK.into(),
        method: "tools/call".into(),
        params: Some(proto::binding::Params::ParamsJson(format!(
            r#"{{"m":"{MARK}"}}"#
        ))),
        binding_version: 0,
    };
    assert_hidden("Binding", format!("{b:?}"));
    let seal = proto::SealRequest {
        binding: Some(b.clone()),
        state: MARK.as_bytes().to_vec(),
        ttl_seconds: 1,
        single_use: true,
        ..Default::default()
    };
    assert_hidden("SealRequest", format!("{seal:?}"));
    assert_hidden(
        "SealResponse",
        format!(
            "{:?}",
            proto::SealResponse {
                request_state: MARK.into(),
                expires_at_unix: 1,
                key_id: "1".into()
            }
        ),
    );
    assert_hidden(
        "OpenRequest",
        format!(
            "{:?}",
            proto::OpenRequest {
                request_state: MARK.into(),
                binding: Some(b),
                commit: MARK.into(),
                ..Default::default()
            }
        ),
    );
    assert_hidden(
        "OpenResponse",
        format!(
            "{:?}",
            proto::OpenResponse {
                state: MARK.as_bytes().to_vec(),
                expires_at_unix: 1,
                key_id: "1".into(),
                consumed: true,
                reservation: MARK.into(),
                lease_expires_at_unix: 1,
                ..Default::default()
            }
        ),
    );
    assert_hidden(
        "RenewRequest",
        format!(
            "{:?}",
            proto::RenewRequest {
                reservation: MARK.into(),
                lease_seconds: 1,
            }
        ),
    );
    assert_hidden(
        "CommitRequest",
        format!(
            "{:?}",
            proto::CommitRequest {
                reservation: MARK.into()
            }
        ),
    );
    assert_hidden(
        "ReleaseRequest",
        format!(
            "{:?}",
            proto::ReleaseRequest {
                reservation: MARK.into()
            }
        ),
    );

    // Domain types.
    let ks = KeysetFile::generate(T0);
    let ring = Keyring::from_file(&ks).unwrap();
    let keys = ring.primary().tenant_keys(&Tenant::new("t"));
    let binding = Binding {
        tenant: Tenant::new("t"),
        subject: "s".into(),
        method: Method::ToolsCall,
        params: params_digest("{}").unwrap(),
        version: stateseal::internals::binding::BindingVersion::V1,
    };
    let header = stateseal::internals::token::Header {
        key_id: ring.primary().id(),
        expires_at: u32::MAX,
        single_use: true,
        binding: stateseal::internals::binding::BindingVersion::V1,
        manifest: false,
    };
    let t = stateseal::internals::token::seal(
        &keys,
        header,
        &binding,
        None,
        MARK.as_bytes(),
        stateseal::internals::token::Nonce::Fresh,
    )
    .unwrap();
    let untrusted = UntrustedToken::parse(&t, 1 << 16).unwrap();
    assert_hidden("UntrustedToken", format!("{untrusted:?}"));
    let opened = untrusted.open(&keys, &binding).unwrap();
    assert_eq!(&opened.state[..], MARK.as_bytes());
    let debug = format!("{opened:?}");
    assert_hidden("Opened", debug.clone());
    let id_hex: String = opened
        .ledger_id(&keys)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert!(!debug.contains(&id_hex), "Opened Debug shows the ledger id");
    assert!(!format!("{keys:?}").contains("ledger"), "{keys:?}");
    let material = serde_json::to_value(&ks).unwrap()["keys"][0]["material"]
        .as_str()
        .unwrap()
        .to_owned();
    for (what, d) in [
        ("KeysetFile", format!("{ks:?}")),
        ("Keyring", format!("{ring:?}")),
        ("TenantKeys", format!("{keys:?}")),
    ] {
        assert!(!d.contains(&material), "{what} Debug shows key material");
    }
}

/// A Seal/Open round trip through the real binary with `STATESEAL_LOG=trace`
/// on the PostgreSQL ledger: no crate's log holds the token's ledger id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_trace_logs_hold_no_ledger_ids() {
    let Some(pg) = crate::common::pg::shared("postgresql-log-hygiene").await else {
        return;
    };
    let url = pg.url.clone();
    let dir = tempfile::tempdir().unwrap();
    let p = spawn(
        dir.path(),
        &["--ledger", "postgres"],
        &[("STATESEAL_LOG", "trace"), ("STATESEAL_DATABASE_URL", &url)],
    );
    let mut c = connect(p.addr).await;
    let t = consume_one(&mut c).await;
    let (status, log) = p.terminate();
    assert!(status.success());
    let log = log.join("\n");

    // The ledger id this token was recorded under.
    let ks = KeysetFile::read(&dir.path().join("keyset.json")).unwrap();
    let ring = Keyring::from_file(&ks).unwrap();
    let keys = ring.primary().tenant_keys(&Tenant::new(Tenant::DEFAULT));
    let Some(proto::binding::Params::ParamsJson(params)) = call_binding().params else {
        unreachable!()
    };
    let binding = Binding {
        tenant: Tenant::new(Tenant::DEFAULT),
        subject: call_binding().subject,
        method: Method::ToolsCall,
        params: stateseal::internals::binding::params_digest_v2(Method::ToolsCall, &params)
            .unwrap(),
        version: stateseal::internals::binding::BindingVersion::V2,
    };
    let id = UntrustedToken::parse(&t, 1 << 16)
        .unwrap()
        .open(&keys, &binding)
        .unwrap()
        .ledger_id(&keys);
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let dec = format!("{:?}", &id[..8]);
    let dec = dec.trim_matches(|c| c == '[' || c == ']');
    assert!(log.contains("ledger ready"), "logs were captured");
    assert!(!log.contains(&hex[..16]), "ledger id (hex) in the log");
    assert!(!log.contains(dec), "ledger id (bytes) in the log");
    assert!(
        !log.contains(&URL_SAFE_NO_PAD.encode(id)),
        "ledger id (b64)"
    );
    assert!(!log.contains(&t), "token in the log");
}

/// The running server cannot dump core (RLIMIT_CORE 0; PR_SET_DUMPABLE 0)
/// unless --allow-core-dumps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_dumps_are_off_unless_asked_for() {
    let core_limit = |pid: u32| -> String {
        std::fs::read_to_string(format!("/proc/{pid}/limits"))
            .unwrap()
            .lines()
            .find(|l| l.starts_with("Max core file size"))
            .unwrap()
            .split_whitespace()
            .skip(4)
            .take(2)
            .collect::<Vec<_>>()
            .join(" ")
    };
    let dir = tempfile::tempdir().unwrap();
    let p = spawn(&dir.path().join("a"), &[], &[]);
    assert_eq!(core_limit(p.child.id()), "0 0");
    p.terminate();
    let p = spawn(&dir.path().join("b"), &["--allow-core-dumps"], &[]);
    assert_ne!(core_limit(p.child.id()), "0 0");
    p.terminate();
}

/// A watched file that fails to load — here a tenants file that used to
/// panic the parser — is refused, counted and logged at error; the watcher
/// keeps watching, and a later good version (revoking a secret) applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_reload_watcher_can_die() {
    use sha2::Digest;
    let hex = |s: &[u8]| -> String {
        sha2::Sha256::digest(s)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.json");
    let write = |content: &str| {
        let tmp = dir.path().join(".tenants.tmp");
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, &tenants).unwrap();
    };
    write(&format!(
        r#"{{"tenants":[{{"name":"a","bearer_sha256":"{}"}},{{"name":"b","bearer_sha256":"{}"}}]}}"#,
        hex(b"secret-a"),
        hex(b"secret-b")
    ));
    let p = spawn(
        &dir.path().join("data"),
        &[
            "--auth",
            "bearer",
            "--tenants",
            tenants.to_str().unwrap(),
            "--reload-interval-ms",
            "100",
        ],
        &[],
    );
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", p.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = |secret: &'static str| {
        stateseal::proto::request_state_client::RequestStateClient::with_interceptor(
            ch.clone(),
            move |mut r: tonic::Request<()>| {
                r.metadata_mut()
                    .insert("authorization", format!("Bearer {secret}").parse().unwrap());
                Ok(r)
            },
        )
    };
    client("secret-b")
        .seal(seal_req(b"x", false))
        .await
        .unwrap();
    // A multibyte character inside the 64 bytes of a digest.
    let bad = format!("a{}é{}", "0".repeat(30), "0".repeat(31));
    write(&format!(
        r#"{{"tenants":[{{"name":"a","bearer_sha256":"{bad}"}}]}}"#
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !p
        .log
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.contains("ERROR") && l.contains("rejected a new version"))
    {
        assert!(Instant::now() < deadline, "bad version not reported");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // b still works (the version in force stays) …
    client("secret-b")
        .seal(seal_req(b"x", false))
        .await
        .unwrap();
    // … and a later good version revoking b applies.
    write(&format!(
        r#"{{"tenants":[{{"name":"a","bearer_sha256":"{}"}}]}}"#,
        hex(b"secret-a")
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match client("secret-b").seal(seal_req(b"x", false)).await {
            Err(e) if e.code() == tonic::Code::Unauthenticated => break,
            _ => {
                assert!(Instant::now() < deadline, "revocation never applied");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    client("secret-a")
        .seal(seal_req(b"x", false))
        .await
        .unwrap();
    let (status, log) = p.terminate();
    assert!(status.success());
    let log = log.join("\n");
    assert!(!log.contains("panicked"), "{log}");
    assert!(!log.contains(&bad), "the rejected value was logged");
}

/// Bad files at start: a clean non-zero exit with a fixed message — never a
/// panic, never the file's content.
#[test]
fn bad_files_at_start_exit_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let bad = format!("a{}é{}", "0".repeat(30), "0".repeat(31));
    let tenants = dir.path().join("tenants.json");
    std::fs::write(
        &tenants,
        format!(r#"{{"tenants":[{{"name":"a","bearer_sha256":"{bad}"}}]}}"#),
    )
    .unwrap();
    let keyset = dir.path().join("keyset.json");
    std::fs::write(&keyset, format!(r#"{{"format":"{MARK}","keys":[]}}"#)).unwrap();
    for args in [
        vec!["--auth", "bearer", "--tenants", tenants.to_str().unwrap()],
        vec!["--keyset", keyset.to_str().unwrap()],
    ] {
        let out = crate::common::process::command()
            .arg("serve")
            .args(&args)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .env_remove("STATESEAL_DATABASE_URL")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panic"), "{err}");
        assert!(!err.contains(&bad) && !err.contains(MARK), "{err}");
        assert!(err.contains("Error:"), "{err}");
    }
}
