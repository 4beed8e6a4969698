//! The binary as a user runs it: restart after kill -9, graceful shutdown,
//! first-start keyset, transport policy, and no secrets in logs.
#![allow(clippy::unwrap_used)]

use crate::common::process::{command, http_get, http_request, metrics_addr, spawn};
use crate::common::*;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use stateseal::internals::keyring::KeysetFile;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumed_tokens_stay_consumed_across_kill_9_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let p = spawn(dir.path(), &[], &[]);
    let mut c = connect(p.addr).await;
    let reusable = c
        .seal(seal_req(b"r", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let mut consumed = Vec::new();
    for _ in 0..20 {
        let t = c
            .seal(seal_req(b"s", true))
            .await
            .unwrap()
            .into_inner()
            .request_state;
        assert!(c.open(open_req(&t)).await.unwrap().into_inner().consumed);
        consumed.push(t);
    }
    let unconsumed = c
        .seal(seal_req(b"u", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    p.kill9();

    let p = spawn(dir.path(), &[], &[]);
    let mut c = connect(p.addr).await;
    for t in &consumed {
        assert_eq!(reason(&c.open(open_req(t)).await.unwrap_err()), "REPLAYED");
    }
    // The keyset created on first start was reused: old tokens still open.
    c.open(open_req(&reusable)).await.unwrap();
    assert!(
        c.open(open_req(&unconsumed))
            .await
            .unwrap()
            .into_inner()
            .consumed
    );
    let (status, _) = p.terminate();
    assert!(status.success(), "SIGTERM exit: {status}");
}

#[test]
fn first_start_creates_a_private_keyset_in_the_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let p = spawn(&data, &[], &[]);
    let (status, log) = p.terminate();
    assert!(status.success(), "{log:?}");
    let ks = data.join("keyset.json");
    let file = KeysetFile::read(&ks).unwrap();
    assert_eq!(file.keys.len(), 1);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&ks).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(&data).unwrap().permissions().mode() & 0o777,
            0o700
        );
    }
    // A second start reuses it.
    let p = spawn(&data, &[], &[]);
    p.terminate();
    let again = KeysetFile::read(&ks).unwrap();
    assert_eq!(again.to_json().unwrap(), file.to_json().unwrap());
}

#[test]
fn non_loopback_plaintext_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    crate::common::process::assert_refuses(
        &["--listen", "0.0.0.0:0"],
        dir.path(),
        "refusing to serve plaintext",
    );
    // The message names every flag a working start needs (the container
    // image's default command ends here).
    crate::common::process::assert_refuses(
        &["--listen", "0.0.0.0:0"],
        dir.path(),
        "add `--auth bearer --tenants FILE --tls-cert FILE --tls-key FILE` or \
         `--auth mtls --tenants FILE --tls-cert FILE --tls-key FILE --tls-client-ca FILE`",
    );
}

#[test]
fn keys_init_refuses_to_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("k.json");
    assert!(command()
        .args(["keys", "init"])
        .arg(&f)
        .status()
        .unwrap()
        .success());
    let before = std::fs::read(&f).unwrap();
    let out = command().args(["keys", "init"]).arg(&f).output().unwrap();
    assert!(!out.status.success());
    assert_eq!(std::fs::read(&f).unwrap(), before);
}

#[test]
fn settings_come_from_the_environment_too() {
    let dir = tempfile::tempdir().unwrap();
    let out = command()
        .args(["serve", "--data-dir"])
        .arg(dir.path())
        .env("STATESEAL_DEFAULT_TTL", "7200")
        .env("STATESEAL_MAX_TTL", "3600")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("default <= max"));
}

/// Every substring of `secret` this long is searched for.
const WINDOW: usize = 12;

fn assert_absent(haystack: &str, what: &str, secret: &str) {
    let chars: Vec<char> = secret.chars().collect();
    if chars.len() <= WINDOW {
        assert!(!haystack.contains(secret), "{what} found in logs");
        return;
    }
    for w in chars.windows(WINDOW) {
        let s: String = w.iter().collect();
        assert!(!haystack.contains(&s), "part of {what} found in logs: {s}");
    }
}

fn split_response(resp: &str) -> (&str, &str) {
    resp.split_once("\r\n\r\n").expect("a head and a body")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_openmetrics_or_prometheus_text_as_negotiated() {
    use openmetrics_parser::{MetricNumber, OpenMetricsValue, PrometheusValue};
    let dir = tempfile::tempdir().unwrap();
    let p = spawn(dir.path(), &["--metrics-listen", "127.0.0.1:0"], &[]);
    let mut c = connect(p.addr).await;
    let t = c
        .seal(seal_req(b"s", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    c.open(open_req(&t)).await.unwrap();
    assert!(c.open(open_req(&t)).await.is_err());
    let addr = metrics_addr(&p);
    let seal_ok = |labels: openmetrics_parser::LabelSet| {
        let l: std::collections::HashMap<_, _> = labels.iter().collect();
        l.get(&"rpc".to_string()).map(|v| v.as_str()) == Some("Seal")
            && l.get(&"outcome".to_string()).map(|v| v.as_str()) == Some("ok")
    };
    let count = |n: &MetricNumber| match n {
        MetricNumber::Int(i) => *i as f64,
        MetricNumber::Float(f) => *f,
    };

    // What Prometheus sends: OpenMetrics first.
    let resp = http_request(
        addr,
        "GET",
        "/metrics",
        "Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n",
    );
    let (head, body) = split_response(&resp);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    assert!(body.ends_with("# EOF\n"));
    let om = openmetrics_parser::openmetrics::parse_openmetrics(body)
        .unwrap_or_else(|e| panic!("not OpenMetrics: {e:?}\n{body}"));
    let requests = &om.families["stateseal_requests"];
    let seal = requests
        .iter_samples()
        .find(|s| seal_ok(s.get_labelset().unwrap()))
        .expect("Seal ok sample");
    assert!(matches!(&seal.value, OpenMetricsValue::Counter(c) if count(&c.value) == 1.0));
    let replayed = requests
        .iter_samples()
        .filter(|s| matches!(&s.value, OpenMetricsValue::Counter(c) if count(&c.value) == 1.0))
        .count();
    assert_eq!(replayed, 3, "Seal ok, Open ok, Open REPLAYED");
    let latency = &om.families["stateseal_request_duration_seconds"];
    assert!(latency.iter_samples().any(|s| matches!(&s.value,
        OpenMetricsValue::Histogram(h) if h.count == Some(2) && h.buckets.len() == 15)));
    for gauge in [
        "stateseal_ready",
        "stateseal_primary_key_id",
        "stateseal_keys",
    ] {
        let f = &om.families[gauge];
        assert!(matches!(
            &f.iter_samples().next().unwrap().value,
            OpenMetricsValue::Gauge(_)
        ));
    }
    let ledger = &om.families["stateseal_ledger_consume_duration_seconds"];
    assert_eq!(ledger.get_label_names(), ["backend"]);

    // A plain scrape (curl, older scrapers): the Prometheus text format.
    let resp = http_get(addr, "/metrics");
    let (head, body) = split_response(&resp);
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    let prom = openmetrics_parser::prometheus::parse_prometheus(body)
        .unwrap_or_else(|e| panic!("not Prometheus text: {e:?}\n{body}"));
    let seal = prom.families["stateseal_requests_total"]
        .iter_samples()
        .find(|s| seal_ok(s.get_labelset().unwrap()))
        .expect("Seal ok sample");
    assert!(matches!(&seal.value, PrometheusValue::Counter(c) if count(&c.value) == 1.0));
    // Accepting OpenMetrics with q=0 is declining it.
    let resp = http_request(
        addr,
        "GET",
        "/metrics",
        "Accept: application/openmetrics-text;q=0, text/plain\r\n",
    );
    assert!(resp
        .to_ascii_lowercase()
        .contains("content-type: text/plain; version=0.0.4"));

    // Other methods and paths.
    let resp = http_request(addr, "POST", "/metrics", "Content-Length: 0\r\n");
    assert!(resp.starts_with("HTTP/1.1 405"), "{resp}");
    assert!(
        resp.to_ascii_lowercase().contains("allow: get, head"),
        "{resp}"
    );
    let resp = http_request(addr, "HEAD", "/metrics", "");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(http_get(addr, "/metricsx").starts_with("HTTP/1.1 404"));
    // Not HTTP at all: refused (400 or a closed connection), never served.
    let garbage = http_request(addr, "\x01\x02", "\x03", "");
    assert!(!garbage.contains("200 OK"), "{garbage}");
    let (status, _) = p.terminate();
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_of_a_full_run_hold_no_key_state_or_token_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let p = spawn(
        dir.path(),
        &["--metrics-listen", "127.0.0.1:0"],
        &[("STATESEAL_LOG", "trace")],
    );
    let mut c = connect(p.addr).await;
    let state = b"STATE-MARKER-7f3a9c-STATE-MARKER-7f3a9c";
    let mut tokens = Vec::new();
    // Every refusal as the client sees it (code, message, details and
    // metadata): searched for secrets with the logs.
    let mut replies = Vec::new();
    let mut refused =
        |r: Result<tonic::Response<stateseal::proto::OpenResponse>, tonic::Status>| {
            if let Err(e) = r {
                replies.push(format!("{e:?}"));
            }
        };
    for single_use in [false, true] {
        let t = c
            .seal(seal_req(state, single_use))
            .await
            .unwrap()
            .into_inner()
            .request_state;
        c.open(open_req(&t)).await.unwrap();
        refused(c.open(open_req(&t)).await);
        // A tampered token, a wrong binding, garbage.
        let mut raw = URL_SAFE_NO_PAD.decode(&t).unwrap();
        raw[20] ^= 1;
        refused(c.open(open_req(&URL_SAFE_NO_PAD.encode(&raw))).await);
        let mut wrong = open_req(&t);
        wrong.binding = Some(binding("eve", "tools/call", r#"{"name":"transfer"}"#));
        refused(c.open(wrong).await);
        tokens.push(t);
    }
    refused(c.open(open_req("garbage-token-garbage-token")).await);
    let metrics_addr = metrics_addr(&p);
    let metrics = http_get(metrics_addr, "/metrics");
    assert!(metrics.starts_with("HTTP/1.1 200 OK"), "{metrics}");
    for want in [
        "stateseal_requests_total{rpc=\"Seal\",outcome=\"ok\"} 2",
        "stateseal_requests_total{rpc=\"Open\",outcome=\"REPLAYED\"} 1",
        "stateseal_requests_total{rpc=\"Open\",outcome=\"REJECTED\"} 4",
        "stateseal_requests_total{rpc=\"Open\",outcome=\"MALFORMED\"} 1",
        "stateseal_ledger_consumed_total 1",
        "stateseal_primary_key_id 1",
        "stateseal_request_duration_seconds_bucket{rpc=\"Open\",le=\"+Inf\"} 9",
        "stateseal_ledger_flushes_total ",
        "stateseal_ledger_records 1",
        "stateseal_ledger_records_max 250000",
        "stateseal_ledger_full_refusals_total 0",
        "stateseal_ledger_records_collected_total 0",
        "stateseal_ready 1",
        "stateseal_clock_synced 1",
        "stateseal_primary_key_promoted_timestamp_seconds ",
    ] {
        assert!(metrics.contains(want), "missing {want:?} in\n{metrics}");
    }
    assert!(http_get(metrics_addr, "/other").starts_with("HTTP/1.1 404"));
    let (status, log) = p.terminate();
    assert!(status.success());
    assert_eq!(replies.len(), 6);
    let log = format!("{}\n{metrics}\n{}", log.join("\n"), replies.join("\n"));
    assert!(
        log.contains("sealed") && log.contains("open refused"),
        "trace logs were captured"
    );

    let ks = KeysetFile::read(&dir.path().join("keyset.json")).unwrap();
    let json = String::from_utf8(ks.to_json().unwrap().to_vec()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let key_b64 = v["keys"][0]["material"].as_str().unwrap().to_owned();
    let key = URL_SAFE_NO_PAD.decode(&key_b64).unwrap();
    assert_absent(&log, "key (base64url)", &key_b64);
    assert_absent(&log, "key (base64)", &STANDARD.encode(&key));
    assert_absent(&log, "key (hex)", &hex(&key));
    assert_absent(&log, "key (debug bytes)", &format!("{:?}", &key[..6]));
    assert_absent(&log, "state", std::str::from_utf8(state).unwrap());
    assert_absent(&log, "state (hex)", &hex(state));
    assert_absent(&log, "state (base64)", &STANDARD.encode(state));
    assert_absent(&log, "state (debug bytes)", &format!("{:?}", &state[..6]));
    for t in &tokens {
        assert_absent(&log, "token", t);
    }
}

/// Not a check of its own: the child process of
/// `panic_output_withholds_the_message` (it does nothing unless that test
/// runs it). Installs the server's panic hook and panics with a secret.
#[test]
fn panicking_child_for_the_panic_hook_test() {
    if std::env::var_os("STATESEAL_PANIC_CHILD").is_none() {
        return;
    }
    stateseal::internals::hardening::withhold_panic_details();
    let key = "PANIC-SECRET-5e1d0c";
    panic!("tripped on key material {key}");
}

/// The hook the server installs at start reports a panic's location and
/// withholds its message (which may quote a secret).
#[test]
fn panic_output_withholds_the_message() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "process::panicking_child_for_the_panic_hook_test",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("STATESEAL_PANIC_CHILD", "1")
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "the child did not panic: {all}");
    assert!(
        all.contains("internal error (panic) at tests/it/process.rs:")
            && all.contains("details withheld"),
        "{all}"
    );
    assert_absent(&all, "the panic's message", "PANIC-SECRET-5e1d0c");
}
