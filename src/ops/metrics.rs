//! Prometheus metrics: one registry per server, made at the composition root
//! and handed to the parts that record; served on their own port.
//!
//! The registry and the exposition are `prometheus-client`'s (OpenMetrics
//! 1.0 text when the scraper's `Accept` asks for it, the Prometheus text
//! format 0.0.4 otherwise); the endpoint is hyper's HTTP/1.1 server behind
//! the same connection bound as every auxiliary listener.
//!
//! Labels are fixed sets (RPC names, rejection reasons, backends): never a
//! tenant-supplied string, a key or a token. Histograms use fixed buckets.
//! The counters of the hot path are created once, every label combination up
//! front, so recording is an atomic add without a family lookup.

use std::borrow::Cow;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, ALLOW, CONTENT_TYPE};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    prometheus_text, text, DescriptorEncoder, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::domain::error::Reject;
use crate::domain::keyring::KeyringHandle;
use crate::ledger::FlushStats;
use crate::ops::reload::ReloadStats;

/// Upper bounds (seconds) of the latency buckets.
const BUCKETS: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0,
];

/// The `Content-Type` of OpenMetrics 1.0 text.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

fn latency_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The RPCs counted.
#[derive(Clone, Copy, Debug)]
pub enum Rpc {
    Seal = 0,
    Open = 1,
    Commit = 2,
    Release = 3,
    Renew = 4,
}

const RPCS: [&str; 5] = ["Seal", "Open", "Commit", "Release", "Renew"];
/// Outcomes: "ok" and each rejection reason.
const OUTCOMES: usize = 1 + Reject::ALL.len();

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    rpc: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabel {
    rpc: &'static str,
}

pub struct Metrics {
    requests: Family<RequestLabels, Counter>,
    latency: Family<RpcLabel, Histogram, fn() -> Histogram>,
    /// The family's counters, by RPC and outcome index (shared with it).
    request_counters: [[Counter; OUTCOMES]; RPCS.len()],
    latency_by_rpc: [Histogram; RPCS.len()],
    consumed: Counter,
    ledger_latency: Histogram,
    ledger_failures: Counter,
    auth_failures: Counter,
    leases_lost: Counter,
    records_collected: Counter,
    ready: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl crate::domain::sealer::LedgerFigures for Metrics {
    fn ledger_round(&self, took: Duration, answered: bool, consumed: bool) {
        self.ledger_consume(took, answered, consumed);
    }
    fn lease_lost(&self) {
        self.lease_lost();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The figures one server records; made once at the composition root
    /// and handed to the parts that record.
    pub fn new() -> Self {
        let requests = Family::<RequestLabels, Counter>::default();
        let request_counters = std::array::from_fn(|r| {
            std::array::from_fn(|i| {
                requests
                    .get_or_create(&RequestLabels {
                        rpc: RPCS[r],
                        outcome: Metrics::outcome_name(i),
                    })
                    .clone()
            })
        });
        let latency: Family<RpcLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        let latency_by_rpc =
            std::array::from_fn(|r| latency.get_or_create(&RpcLabel { rpc: RPCS[r] }).clone());
        Metrics {
            requests,
            latency,
            request_counters,
            latency_by_rpc,
            consumed: Counter::default(),
            ledger_latency: latency_histogram(),
            ledger_failures: Counter::default(),
            auth_failures: Counter::default(),
            leases_lost: Counter::default(),
            records_collected: Counter::default(),
            ready: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Readiness as last reported to health (for `stateseal_ready`).
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// Records a finished RPC: `None` = success.
    pub fn request(&self, rpc: Rpc, outcome: Option<Reject>, took: Duration) {
        let i = match outcome {
            None => 0,
            Some(r) => 1 + Reject::ALL.iter().position(|x| *x == r).unwrap_or(0),
        };
        self.request_counters[rpc as usize][i].inc();
        self.latency_by_rpc[rpc as usize].observe(took.as_secs_f64());
    }

    /// Records a request refused by authentication.
    pub fn auth_failure(&self) {
        self.auth_failures.inc();
    }

    /// Records a Commit or Renew of a reservation that no longer held its
    /// token (taken over after its lease ended, released or collected).
    pub fn lease_lost(&self) {
        self.leases_lost.inc();
    }

    /// Records what a round of garbage collection removed.
    pub fn records_collected(&self, n: u64) {
        self.records_collected.inc_by(n);
    }

    pub fn ledger_consume(&self, took: Duration, ok: bool, consumed: bool) {
        self.ledger_latency.observe(took.as_secs_f64());
        if !ok {
            self.ledger_failures.inc();
        }
        if consumed {
            self.consumed.inc();
        }
    }

    fn outcome_name(i: usize) -> &'static str {
        match i {
            0 => "ok",
            i => Reject::ALL[i - 1].reason(),
        }
    }
}

/// What the exposition reads besides the server's own metrics.
#[derive(Clone)]
pub struct Sources {
    pub keys: Arc<KeyringHandle>,
    pub reload: Arc<ReloadStats>,
    pub flush: Option<Arc<FlushStats>>,
    /// How the ledger's database replicates (PostgreSQL).
    pub replication: Option<Arc<crate::ledger::Replication>>,
    pub backend: &'static str,
    /// The gRPC and health listeners' connection counters.
    pub conns: Arc<crate::net::conns::ConnStats>,
    /// The clock guard: whether the wall clock agrees, and by how much.
    pub guard: Arc<crate::clock::guard::TimeGuard>,
    /// The server's own figures (also registered as metrics).
    pub metrics: Arc<Metrics>,
    /// Refusals of the request-byte budget and the canonicalization pool.
    pub limits: Arc<crate::net::limits::LimitStats>,
    /// The expiry dates of the TLS material in force, with TLS.
    pub tls: Option<Arc<crate::net::tls::TlsExpiry>>,
    /// The audit log's figures, with an audit log.
    pub audit: Option<Arc<crate::ops::audit::AuditStats>>,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources")
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

/// The registry one metrics endpoint serves: the server's metrics, and a
/// collector reading the values other parts own at each scrape.
pub fn registry(src: Sources) -> Registry {
    let m = src.metrics.clone();
    let mut r = Registry::default();
    r.register(
        "stateseal_requests",
        "RPCs handled, by RPC and outcome (ok or rejection reason)",
        m.requests.clone(),
    );
    // Units are in the names, without `# UNIT` lines: optional in
    // OpenMetrics, and not every parser takes them on histograms.
    r.register(
        "stateseal_request_duration_seconds",
        "Time to handle an RPC, after authentication",
        m.latency.clone(),
    );
    r.sub_registry_with_label((Cow::Borrowed("backend"), Cow::Borrowed(src.backend)))
        .register(
            "stateseal_ledger_consume_duration_seconds",
            "Time to record a single-use consumption durably",
            m.ledger_latency.clone(),
        );
    r.register(
        "stateseal_ledger_consumed",
        "Single-use tokens consumed",
        m.consumed.clone(),
    );
    r.register(
        "stateseal_ledger_failures",
        "Consumptions the ledger could not record (answered LEDGER_UNAVAILABLE)",
        m.ledger_failures.clone(),
    );
    r.register(
        "stateseal_auth_failures",
        "Requests refused by caller authentication (UNAUTHENTICATED or PERMISSION_DENIED)",
        m.auth_failures.clone(),
    );
    r.register(
        "stateseal_lease_lost",
        "Commits and renewals of a reservation that no longer held its token (another attempt took it over after the lease ended, or it was released or collected): that handler may have run twice",
        m.leases_lost.clone(),
    );
    r.register(
        "stateseal_ledger_records_collected",
        "Ledger records removed by garbage collection: tokens expired the clock skew ago, and ended leases nobody took over",
        m.records_collected.clone(),
    );
    r.register_collector(Box::new(Owned(src)));
    r
}

/// Values owned elsewhere (ledger, clock guard, limits, reloads, keyring,
/// readiness, TLS files), read at each scrape.
#[derive(Debug)]
struct Owned(Sources);

fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    ConstCounter::new(v).encode(enc.encode_descriptor(name, help, None, MetricType::Counter)?)
}

fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> std::fmt::Result {
    ConstGauge::new(v).encode(enc.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

impl Collector for Owned {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let src = &self.0;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        if let Some(r) = &src.replication {
            let now = r.mode();
            let mut family = enc.encode_descriptor(
                "stateseal_ledger_replication",
                "How the PostgreSQL primary replicates, at its last check: 1 for the mode it is in (asynchronous: a failover can lose acknowledged consumptions).",
                None,
                MetricType::Gauge,
            )?;
            for mode in crate::ledger::ReplicationMode::ALL {
                let labels = [("mode", mode.as_str())];
                ConstGauge::new(i64::from(mode == now)).encode(family.encode_family(&labels)?)?;
            }
            gauge(
                &mut enc,
                "stateseal_ledger_standbys",
                "Standbys streaming from the PostgreSQL primary at the last check.",
                i64::try_from(r.standbys.load(Ordering::Relaxed)).unwrap_or(i64::MAX),
            )?;
            gauge(
                &mut enc,
                "stateseal_ledger_synchronous_standbys",
                "Of those, the synchronous ones.",
                i64::try_from(r.synchronous.load(Ordering::Relaxed)).unwrap_or(i64::MAX),
            )?;
        }
        if let Some(f) = &src.flush {
            counter(
                &mut enc,
                "stateseal_ledger_flushes",
                "Group-commit rounds (one flush and fdatasync each).",
                load(&f.flushes),
            )?;
            counter(&mut enc, "stateseal_ledger_flushed_waiters", "Consumptions made durable by those rounds; divided by the rounds, the mean batch size.", load(&f.flushed_waiters))?;
            gauge(
                &mut enc,
                "stateseal_ledger_batch_size_max",
                "Largest group-commit round.",
                load(&f.max_batch) as i64,
            )?;
            gauge(
                &mut enc,
                "stateseal_ledger_records",
                "Records the ledger holds (live tokens consumed or reserved, and expired ones not yet collected).",
                i64::try_from(load(&f.records)).unwrap_or(i64::MAX),
            )?;
            gauge(
                &mut enc,
                "stateseal_ledger_records_max",
                "The bound on those records (--max-ledger-records); -1 when unbounded.",
                i64::try_from(load(&f.max_records)).unwrap_or(-1),
            )?;
            counter(&mut enc, "stateseal_ledger_full_refusals", "Consumptions and reservations refused OVERLOADED because the ledger held --max-ledger-records, or their tenant its share.", load(&f.refused_full))?;
            gauge(
                &mut enc,
                "stateseal_ledger_tenant_records_max",
                "The bound on one tenant's records (--max-ledger-records-per-tenant); -1 when unbounded.",
                i64::try_from(load(&f.max_tenant_records)).unwrap_or(-1),
            )?;
            gauge(
                &mut enc,
                "stateseal_ledger_tenant_records_top",
                "The most records any one tenant holds.",
                i64::try_from(load(&f.top_tenant_records)).unwrap_or(i64::MAX),
            )?;
            counter(&mut enc, "stateseal_ledger_tenant_full_refusals", "Consumptions and reservations refused OVERLOADED because their tenant held its share of the ledger.", load(&f.refused_tenant_full))?;
            counter(&mut enc, "stateseal_ledger_leases_collected", "Reservations whose lease ended, that nobody took over, removed by garbage collection (the clock skew after the lease's end).", load(&f.collected_leases))?;
        }
        gauge(
            &mut enc,
            "stateseal_clock_synced",
            "1 while the wall clock agrees with the reference clock within the skew.",
            i64::from(src.guard.synced()),
        )?;
        gauge(
            &mut enc,
            "stateseal_clock_offset_seconds",
            "Wall clock minus the reference clock, at the last check.",
            src.guard.offset(),
        )?;
        let l = &src.limits;
        counter(
            &mut enc,
            "stateseal_inflight_bytes_refused",
            "Requests refused because the request-byte budget was full (RESOURCE_EXHAUSTED).",
            load(&l.inflight_refused),
        )?;
        counter(
            &mut enc,
            "stateseal_canonicalizations_refused",
            "Requests refused because the canonicalization queue was full (OVERLOADED).",
            load(&l.canon_refused),
        )?;
        counter(&mut enc, "stateseal_handshake_failures", "Connections closed because their TLS handshake (or HTTP/2 preface) failed or timed out.", load(&src.conns.handshakes_failed))?;
        counter(
            &mut enc,
            "stateseal_handshakes_evicted",
            "Connections closed mid-handshake to make room for a newer one (handshake slots full).",
            load(&src.conns.handshakes_evicted),
        )?;
        let c = &src.conns;
        counter(
            &mut enc,
            "stateseal_connections_closed_idle",
            "Connections closed after --idle-timeout-ms without an open stream.",
            load(&c.closed_idle),
        )?;
        counter(
            &mut enc,
            "stateseal_connections_evicted",
            "Idle connections closed to make room for a new one (listener or address at its cap).",
            load(&c.evicted),
        )?;
        counter(
            &mut enc,
            "stateseal_connections_closed_stalled",
            "Connections closed with a stream open past the request timeout and its margin (a peer that does not take its answer).",
            load(&c.closed_stalled),
        )?;
        counter(&mut enc, "stateseal_connections_refused_per_ip", "Connections refused because their address held --max-connections-per-ip busy connections.", load(&c.refused_per_ip))?;
        counter(&mut enc, "stateseal_connections_closed_unauthenticated", "Connections closed without a request with a valid credential within --auth-deadline-ms (bearer), or after 16 failed ones since the last that passed (bearer, mTLS).", load(&c.closed_unauthenticated))?;
        {
            let mut family = enc.encode_descriptor(
                "stateseal_goaways_sent",
                "Graceful closes begun with an HTTP/2 GOAWAY (the peer resends what was not taken), by cause: idle, evicted, per_ip, auth_deadline, max_age, shutdown.",
                None,
                MetricType::Counter,
            )?;
            for cause in crate::net::conns::Cause::ALL {
                let labels = [("cause", cause.name())];
                ConstCounter::new(load(&c.goaways[cause as usize]))
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        counter(&mut enc, "stateseal_connections_cut_after_drain", "Connections cut because their peer did not finish a graceful close within its bound (1 s without a stream, or the request timeout and its margin).", load(&c.cut_after_drain))?;
        if let Some(a) = &src.audit {
            counter(
                &mut enc,
                "stateseal_audit_lines",
                "Audit lines made (numbered and chained).",
                load(&a.lines),
            )?;
            counter(&mut enc, "stateseal_audit_dropped", "Audit lines given up (queue full, or the sink failing too long; in closed mode a decision answered AUDIT_UNAVAILABLE whose line found the queue full); a `dropped` line counts them in the log.", load(&a.dropped))?;
            counter(&mut enc, "stateseal_audit_write_failures", "Audit log writes that failed (the lines are kept and written first once the sink writes again).", load(&a.write_failures))?;
        }
        counter(
            &mut enc,
            "stateseal_reloads",
            "Watched files (keyset, TLS, tenants) reloaded.",
            load(&src.reload.reloads),
        )?;
        counter(
            &mut enc,
            "stateseal_reload_failures",
            "New versions of watched files rejected.",
            load(&src.reload.failures),
        )?;
        let ring = src.keys.current();
        gauge(
            &mut enc,
            "stateseal_primary_key_id",
            "Id of the key that seals.",
            i64::from(ring.primary().id().0),
        )?;
        if let Some(t) = ring.primary_since() {
            gauge(
                &mut enc,
                "stateseal_primary_key_promoted_timestamp_seconds",
                "When the key that seals became primary (Unix seconds).",
                t as i64,
            )?;
        }
        gauge(
            &mut enc,
            "stateseal_ready",
            "1 while readiness reports SERVING.",
            i64::from(src.metrics.ready.load(Ordering::Relaxed)),
        )?;
        if let Some(tls) = &src.tls {
            for (name, help, v) in [
                (
                    "stateseal_tls_certificate_expiry_timestamp_seconds",
                    "notAfter of the server certificate in force (Unix seconds).",
                    &tls.cert_not_after,
                ),
                (
                    "stateseal_tls_client_ca_expiry_timestamp_seconds",
                    "Earliest notAfter of the client CA bundle in force (Unix seconds).",
                    &tls.client_ca_not_after,
                ),
            ] {
                let v = v.load(Ordering::Relaxed);
                if v > 0 {
                    gauge(&mut enc, name, help, v)?;
                }
            }
        }
        gauge(
            &mut enc,
            "stateseal_keys",
            "Keys in force (staged and primary).",
            ring.summary().len() as i64,
        )
    }
}

/// Whether an `Accept` header asks for OpenMetrics text (listed with a
/// non-zero quality). Prometheus lists it first when it can parse it.
fn wants_openmetrics(headers: &HeaderMap) -> bool {
    headers
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|range| {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("");
            let zero_q = parts.any(|p| {
                p.strip_prefix("q=")
                    .is_some_and(|q| q.parse::<f32>().is_ok_and(|q| q <= 0.0))
            });
            media.eq_ignore_ascii_case("application/openmetrics-text") && !zero_q
        })
}

fn plain(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// The answer to one request: `GET`/`HEAD /metrics` (the query string is
/// ignored), 405 for other methods there, 404 elsewhere.
pub fn respond<B>(registry: &Registry, req: &Request<B>) -> Response<Full<Bytes>> {
    if req.uri().path() != "/metrics" {
        return plain(StatusCode::NOT_FOUND, "not found\n");
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        r.headers_mut()
            .insert(ALLOW, http::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let mut body = String::with_capacity(16 * 1024);
    let (content_type, encoded) = if wants_openmetrics(req.headers()) {
        (OPENMETRICS, text::encode(&mut body, registry))
    } else {
        (
            prometheus_text::CONTENT_TYPE,
            prometheus_text::encode(&mut body, registry),
        )
    };
    if encoded.is_err() {
        return plain(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed\n");
    }
    if req.method() == Method::HEAD {
        body.clear();
    }
    let mut r = Response::new(Full::new(Bytes::from(body)));
    r.headers_mut()
        .insert(CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    r
}

/// Serves the metrics over HTTP/1.1 (hyper), at most `max_connections` at
/// once; one request per connection, headers within 5 s, the whole
/// exchange within 10 s.
pub async fn serve(listener: TcpListener, max_connections: usize, src: Sources) {
    let registry = Arc::new(registry(src));
    let permits = Arc::new(tokio::sync::Semaphore::new(max_connections.max(1)));
    // One request per connection, the whole exchange bounded in time: no
    // connection is idle for long, so none is evicted or closed as idle.
    let conns = crate::net::conns::Conns::new(
        crate::net::conns::ConnPolicy {
            idle_timeout: Duration::from_secs(3600),
            per_ip: usize::MAX,
            auth_deadline: None,
            max_auth_failures: u32::MAX,
            max_stream_age: Duration::from_secs(3600),
            callers_authenticate: false,
        },
        Arc::default(),
    );
    while let Some((sock, _, permit, conn)) =
        crate::net::accept::accept_limited(&listener, &permits, None, &conns).await
    {
        let registry = registry.clone();
        tokio::spawn(async move {
            let _permit = (permit, conn);
            let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                let answer = respond(&registry, &req);
                async move { Ok::<_, Infallible>(answer) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .keep_alive(false)
                .max_buf_size(16 * 1024)
                .serve_connection(TokioIo::new(sock), svc);
            let _ = tokio::time::timeout(Duration::from_secs(10), conn).await;
        });
    }
}
