//! Prometheus metrics, process-wide, served as text on their own port.
//!
//! Labels are fixed sets (RPC names, rejection reasons, backends): never a
//! tenant-supplied string, a key or a token. Histograms use fixed buckets.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::error::Reject;
use crate::keyring::KeyringHandle;
use crate::ledger::sled::FlushStats;
use crate::reload::ReloadStats;

/// Upper bounds (seconds) of the latency buckets.
const BUCKETS: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0,
];

/// A latency histogram with fixed buckets.
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

impl Histogram {
    const fn new() -> Self {
        Histogram {
            counts: [const { AtomicU64::new(0) }; BUCKETS.len() + 1],
            sum_nanos: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(
            d.as_nanos().min(u128::from(u64::MAX)) as u64,
            Ordering::Relaxed,
        );
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        let sep = if labels.is_empty() { "" } else { "," };
        for (i, b) in BUCKETS.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cumulative}");
        }
        cumulative += self.counts[BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cumulative}"
        );
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(out, "{name}_count{braces} {cumulative}");
    }
}

/// The RPCs counted.
#[derive(Clone, Copy, Debug)]
pub enum Rpc {
    Seal = 0,
    Open = 1,
    Commit = 2,
    Release = 3,
}

const RPCS: [&str; 4] = ["Seal", "Open", "Commit", "Release"];
/// Outcomes: "ok" and each rejection reason.
const OUTCOMES: usize = 1 + Reject::ALL.len();

pub struct Metrics {
    requests: [[AtomicU64; OUTCOMES]; RPCS.len()],
    latency: [Histogram; RPCS.len()],
    consumed: AtomicU64,
    ledger_latency: Histogram,
    ledger_failures: AtomicU64,
    auth_failures: AtomicU64,
}

/// Readiness as last reported (for `stateseal_ready`).
pub static READY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The process-wide metrics.
pub static METRICS: Metrics = Metrics::new();

impl Metrics {
    const fn new() -> Self {
        Metrics {
            requests: [const { [const { AtomicU64::new(0) }; OUTCOMES] }; RPCS.len()],
            latency: [const { Histogram::new() }; RPCS.len()],
            consumed: AtomicU64::new(0),
            ledger_latency: Histogram::new(),
            ledger_failures: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
        }
    }

    /// Records a finished RPC: `None` = success.
    pub fn request(&self, rpc: Rpc, outcome: Option<Reject>, took: Duration) {
        let i = match outcome {
            None => 0,
            Some(r) => 1 + Reject::ALL.iter().position(|x| *x == r).unwrap_or(0),
        };
        self.requests[rpc as usize][i].fetch_add(1, Ordering::Relaxed);
        self.latency[rpc as usize].observe(took);
    }

    /// Records a request refused by authentication.
    pub fn auth_failure(&self) {
        self.auth_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub fn ledger_consume(&self, took: Duration, ok: bool, consumed: bool) {
        self.ledger_latency.observe(took);
        if !ok {
            self.ledger_failures.fetch_add(1, Ordering::Relaxed);
        }
        if consumed {
            self.consumed.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn outcome_name(i: usize) -> &'static str {
        match i {
            0 => "ok",
            i => Reject::ALL[i - 1].reason(),
        }
    }
}

/// What the exposition reads besides the static metrics.
#[derive(Clone)]
pub struct Sources {
    pub keys: Arc<KeyringHandle>,
    pub reload: Arc<ReloadStats>,
    pub flush: Option<Arc<FlushStats>>,
    pub backend: &'static str,
}

/// The Prometheus text exposition.
pub fn render(src: &Sources) -> String {
    let m = &METRICS;
    let mut out = String::with_capacity(8192);
    out.push_str("# HELP stateseal_requests_total RPCs handled, by RPC and outcome (ok or rejection reason).\n");
    out.push_str("# TYPE stateseal_requests_total counter\n");
    for (r, name) in RPCS.iter().enumerate() {
        for i in 0..OUTCOMES {
            let v = m.requests[r][i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "stateseal_requests_total{{rpc=\"{name}\",outcome=\"{}\"}} {v}",
                Metrics::outcome_name(i)
            );
        }
    }
    out.push_str(
        "# HELP stateseal_request_duration_seconds Time to handle an RPC, after authentication.\n",
    );
    out.push_str("# TYPE stateseal_request_duration_seconds histogram\n");
    for (r, name) in RPCS.iter().enumerate() {
        m.latency[r].render(
            &mut out,
            "stateseal_request_duration_seconds",
            &format!("rpc=\"{name}\""),
        );
    }
    out.push_str("# HELP stateseal_ledger_consume_duration_seconds Time to record a single-use consumption durably.\n");
    out.push_str("# TYPE stateseal_ledger_consume_duration_seconds histogram\n");
    m.ledger_latency.render(
        &mut out,
        "stateseal_ledger_consume_duration_seconds",
        &format!("backend=\"{}\"", src.backend),
    );
    let _ = writeln!(out, "# HELP stateseal_ledger_consumed_total Single-use tokens consumed.\n# TYPE stateseal_ledger_consumed_total counter\nstateseal_ledger_consumed_total {}", m.consumed.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP stateseal_ledger_failures_total Consumptions the ledger could not record (answered LEDGER_UNAVAILABLE).\n# TYPE stateseal_ledger_failures_total counter\nstateseal_ledger_failures_total {}", m.ledger_failures.load(Ordering::Relaxed));
    if let Some(f) = &src.flush {
        let _ = writeln!(out, "# HELP stateseal_ledger_flushes_total Group-commit rounds (one flush and fdatasync each).\n# TYPE stateseal_ledger_flushes_total counter\nstateseal_ledger_flushes_total {}", f.flushes.load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP stateseal_ledger_flushed_waiters_total Consumptions made durable by those rounds; divided by the rounds, the mean batch size.\n# TYPE stateseal_ledger_flushed_waiters_total counter\nstateseal_ledger_flushed_waiters_total {}", f.flushed_waiters.load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP stateseal_ledger_batch_size_max Largest group-commit round.\n# TYPE stateseal_ledger_batch_size_max gauge\nstateseal_ledger_batch_size_max {}", f.max_batch.load(Ordering::Relaxed));
    }
    let _ = writeln!(out, "# HELP stateseal_auth_failures_total Requests refused by caller authentication (UNAUTHENTICATED or PERMISSION_DENIED).\n# TYPE stateseal_auth_failures_total counter\nstateseal_auth_failures_total {}", m.auth_failures.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP stateseal_clock_synced 1 while the wall clock agrees with the reference clock within the skew.\n# TYPE stateseal_clock_synced gauge\nstateseal_clock_synced {}", u8::from(crate::timeguard::GUARD_SYNCED.load(Ordering::Relaxed)));
    let _ = writeln!(out, "# HELP stateseal_clock_offset_seconds Wall clock minus the reference clock, at the last check.\n# TYPE stateseal_clock_offset_seconds gauge\nstateseal_clock_offset_seconds {}", crate::timeguard::GUARD_OFFSET.load(Ordering::Relaxed));
    let l = &crate::limits::LIMIT_STATS;
    let _ = writeln!(out, "# HELP stateseal_inflight_bytes_refused_total Requests refused because the request-byte budget was full (RESOURCE_EXHAUSTED).\n# TYPE stateseal_inflight_bytes_refused_total counter\nstateseal_inflight_bytes_refused_total {}", l.inflight_refused.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP stateseal_canonicalizations_refused_total Requests refused because the canonicalization queue was full (OVERLOADED).\n# TYPE stateseal_canonicalizations_refused_total counter\nstateseal_canonicalizations_refused_total {}", l.canon_refused.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP stateseal_handshake_failures_total Connections closed because their TLS handshake (or HTTP/2 preface) failed or timed out.\n# TYPE stateseal_handshake_failures_total counter\nstateseal_handshake_failures_total {}", l.handshakes_failed.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP stateseal_handshakes_evicted_total Connections closed mid-handshake to make room for a newer one (handshake slots full).\n# TYPE stateseal_handshakes_evicted_total counter\nstateseal_handshakes_evicted_total {}", l.handshakes_evicted.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP stateseal_reloads_total Watched files (keyset, TLS, tenants) reloaded.\n# TYPE stateseal_reloads_total counter\nstateseal_reloads_total {}", src.reload.reloads.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP stateseal_reload_failures_total New versions of watched files rejected.\n# TYPE stateseal_reload_failures_total counter\nstateseal_reload_failures_total {}", src.reload.failures.load(Ordering::Relaxed));
    let ring = src.keys.current();
    let _ = writeln!(out, "# HELP stateseal_primary_key_id Id of the key that seals.\n# TYPE stateseal_primary_key_id gauge\nstateseal_primary_key_id {}", ring.primary().id().0);
    if let Some(t) = ring.primary_since() {
        let _ = writeln!(out, "# HELP stateseal_primary_key_promoted_timestamp_seconds When the key that seals became primary (Unix seconds).\n# TYPE stateseal_primary_key_promoted_timestamp_seconds gauge\nstateseal_primary_key_promoted_timestamp_seconds {t}");
    }
    let _ = writeln!(out, "# HELP stateseal_ready 1 while readiness reports SERVING.\n# TYPE stateseal_ready gauge\nstateseal_ready {}", u8::from(READY.load(Ordering::Relaxed)));
    for (name, help, v) in [
        (
            "stateseal_tls_certificate_expiry_timestamp_seconds",
            "notAfter of the server certificate in force (Unix seconds).",
            &crate::tls::CERT_NOT_AFTER,
        ),
        (
            "stateseal_tls_client_ca_expiry_timestamp_seconds",
            "Earliest notAfter of the client CA bundle in force (Unix seconds).",
            &crate::tls::CLIENT_CA_NOT_AFTER,
        ),
    ] {
        let v = v.load(Ordering::Relaxed);
        if v > 0 {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
    }
    let _ = writeln!(out, "# HELP stateseal_keys Keys in force (staged and primary).\n# TYPE stateseal_keys gauge\nstateseal_keys {}", ring.summary().len());
    out
}

/// Serves `GET /metrics` (HTTP/1.1, one request per connection), at most
/// `max_connections` at once.
pub async fn serve(listener: TcpListener, max_connections: usize, src: Sources) {
    let permits = Arc::new(tokio::sync::Semaphore::new(max_connections.max(1)));
    while let Some((mut sock, _, permit)) =
        crate::limits::accept_limited(&listener, &permits, None).await
    {
        let src = src.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while n < buf.len() {
                    let k = sock.read(&mut buf[n..]).await?;
                    if k == 0 {
                        break;
                    }
                    n += k;
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                Ok::<_, std::io::Error>(())
            })
            .await;
            if !matches!(read, Ok(Ok(()))) {
                return;
            }
            let head = &buf[..n];
            let (status, body) =
                if head.starts_with(b"GET /metrics ") || head.starts_with(b"GET /metrics?") {
                    ("200 OK", render(&src))
                } else {
                    ("404 Not Found", "not found\n".to_string())
                };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
