//! Runs the gRPC server: the RequestState service behind authentication,
//! `grpc.health.v1` (SERVING only while the ledger is ready) and server
//! reflection. Shuts down gracefully: in-flight requests finish, then the
//! ledger is flushed.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tower_layer::Layer;

use crate::domain::sealer::Sealer;
use crate::grpc::auth::Authenticator;
use crate::grpc::auth::Tenants;
use crate::grpc::canon_pool::CanonPool;
use crate::grpc::service::RequestStateService;
use crate::ledger::run_gc;
use crate::net::accept::limited_incoming;
use crate::net::budget::InflightBytesLayer;
use crate::net::conns::{ConnActivityLayer, Conns};
use crate::net::limits::{CallerAuth, TransportLimits};
use crate::net::tls::{self, TlsInForce};
use crate::ops::reload::{keyset_applier, watch_file, ReloadStats};
use crate::proto::request_state_server::RequestStateServer;
use arc_swap::ArcSwap;

/// The fully-qualified service name, as health checks name it. Its status
/// (and that of "") is SERVING only while the ledger can take consumptions:
/// use it for readiness.
pub const SERVICE_NAME: &str = "stateseal.v1.RequestState";
/// A health service name that is SERVING as long as the process serves at
/// all: use it for liveness (a database outage must not restart pods).
pub const LIVENESS_NAME: &str = "stateseal.liveness";

/// The tenants file (watched), the tenants in force, and the digest of the
/// version they were parsed from.
pub type TenantsInForce = (PathBuf, Arc<ArcSwap<Tenants>>, [u8; 32]);

/// Server settings that are not limits of the domain.
pub struct ServeOptions {
    pub auth: Authenticator,
    /// How often readiness re-checks the ledger.
    pub health_every: Duration,
    /// How often expired ledger records are collected.
    pub gc_every: Duration,
    /// The keyset file to watch, and the digest of the version in force.
    pub keyset: Option<(PathBuf, [u8; 32])>,
    /// TLS on the gRPC port.
    pub tls: Option<TlsInForce>,
    /// The tenants file.
    pub tenants: Option<TenantsInForce>,
    /// A separate plaintext listener serving only `grpc.health.v1`, for
    /// probes that cannot present client credentials.
    pub health_listener: Option<TcpListener>,
    /// Where to serve Prometheus metrics (`GET /metrics`).
    pub metrics_listener: Option<TcpListener>,
    /// How often watched files are re-read.
    pub reload_every: Duration,
    pub reload_stats: Arc<ReloadStats>,
    /// Transport and work limits on every listener.
    pub limits: TransportLimits,
    /// The server's figures, served on the metrics port (the sealer is
    /// given the same, as its [`crate::domain::sealer::LedgerFigures`]).
    pub metrics: Arc<crate::ops::metrics::Metrics>,
    /// The audit log, started; closed (its `stop` line written) when the
    /// server stops.
    pub audit: Option<Arc<crate::ops::audit::Audit>>,
    /// The key-encryption key of a wrapped keyset, for its reloads.
    pub keyset_kek: Option<Arc<dyn crate::domain::keyring::Kek>>,
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("auth", &self.auth)
            .field("tls", &self.tls.as_ref().map(|t| &t.files))
            .field("health_listener", &self.health_listener)
            .field("metrics_listener", &self.metrics_listener)
            .finish_non_exhaustive()
    }
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            auth: Authenticator::Implicit(crate::domain::binding::Tenant::new(
                crate::domain::binding::Tenant::DEFAULT,
            )),
            health_every: Duration::from_secs(1),
            gc_every: Duration::from_secs(30),
            keyset: None,
            tls: None,
            tenants: None,
            health_listener: None,
            metrics_listener: None,
            reload_every: Duration::from_secs(2),
            reload_stats: Arc::default(),
            limits: TransportLimits::default(),
            metrics: Arc::default(),
            audit: None,
            keyset_kek: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("ledger: {0}")]
    Ledger(#[from] crate::ledger::LedgerError),
}

/// The multi-threaded runtime the server runs on.
///
/// Without tokio's LIFO slot: with it, a stream task that finishes a response
/// wakes its connection's task into the slot, which runs next and writes that
/// one response, so every answer costs a `sendto` of its own (0.67 per call
/// under h2load at 128 in flight); queued behind the other ready streams
/// instead, the connection task writes many answers at once (0.05 per call)
/// and a call costs 10-35% less server CPU (docs/performance.md, "One write
/// for many answers"). The switch is one of tokio's unstable APIs, so it
/// needs `--cfg tokio_unstable` (`.cargo/config.toml`); a build without it
/// keeps the slot (`build.rs` warns).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    runtime_builder().build()
}

fn runtime_builder() -> tokio::runtime::Builder {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    // At least two workers, one CPU or more (unless TOKIO_WORKER_THREADS
    // says otherwise): a task held in a system call (an audit line written
    // to a file system that hangs) leaves another to answer health checks
    // and refusals.
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        builder.worker_threads(cpus.max(2));
    }
    #[cfg(tokio_unstable)]
    builder.disable_lifo_slot();
    builder
}

/// The largest gRPC message accepted: room for the largest params JSON, a
/// token carrying the largest state and manifest, and the largest input
/// requests or responses. Bigger messages are refused by the transport
/// (tonic answers OUT_OF_RANGE) before any of our checks.
pub fn max_message_size(sealer: &Sealer) -> usize {
    use crate::domain::token::{encoded_len, MANIFEST_ROOM, OVERHEAD};
    let l = sealer.limits();
    l.max_params_json
        + encoded_len(OVERHEAD + MANIFEST_ROOM + l.max_state)
        + l.max_input_json
        + 64 * 1024
}

/// The largest message health and reflection accept: a service name or a
/// symbol, with room to spare.
pub const AUX_MAX_MESSAGE: usize = 4 * 1024;
/// Streams per connection on the health port (probes need one or two).
const AUX_MAX_STREAMS: u32 = 16;

/// Serves on `listener` until `shutdown` completes; then lets in-flight
/// requests finish for at most `limits.shutdown_grace`, cuts the rest, and
/// flushes the ledger.
pub async fn run(
    listener: TcpListener,
    sealer: Arc<Sealer>,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let lim = opts.limits.clone();
    let audit = opts.audit.clone();
    let (health, health_service) = tonic_health::server::health_reporter();
    let health_service = health_service
        .max_decoding_message_size(AUX_MAX_MESSAGE)
        .max_encoding_message_size(AUX_MAX_MESSAGE);
    let auth = opts.auth.clone();
    // Reflection describes the API: behind caller authentication.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
    };
    let metrics = opts.metrics.clone();
    let reflection_v1 = behind_auth(
        reflection()
            .build_v1()?
            .max_decoding_message_size(AUX_MAX_MESSAGE),
        &auth,
        &metrics,
    );
    let reflection_v1alpha = behind_auth(
        reflection()
            .build_v1alpha()?
            .max_decoding_message_size(AUX_MAX_MESSAGE),
        &auth,
        &metrics,
    );

    let limit = max_message_size(&sealer);
    let limit_stats = Arc::new(crate::net::limits::LimitStats::default());
    let canon = Arc::new(CanonPool::new(
        lim.max_canonicalizations,
        lim.max_canon_queue,
        limit_stats.clone(),
    ));
    let service = behind_auth(
        RequestStateServer::new(
            RequestStateService::new(sealer.clone(), canon, metrics.clone())
                .with_audit(opts.audit.clone()),
        )
        .max_decoding_message_size(limit)
        .max_encoding_message_size(limit),
        &auth,
        &metrics,
    );
    // One budget of request bytes in flight for every listener.
    let inflight = InflightBytesLayer::new(lim.max_inflight_bytes, limit_stats.clone());

    let ledger = sealer.ledger().clone();
    // Registered before the first request can arrive: a probe never sees
    // "service not registered".
    let guard = sealer.guard().clone();
    let ready = ledger.ready().await && guard.synced();
    health
        .set_service_status(LIVENESS_NAME, tonic_health::ServingStatus::Serving)
        .await;
    set_health(&health, &metrics, ready).await;
    if ready {
        tracing::info!(backend = ledger.backend(), "ledger ready: SERVING");
    } else {
        tracing::warn!(backend = ledger.backend(), "ledger not ready: NOT_SERVING");
    }
    let mut background = spawn_background(&sealer, &opts, health, ready);
    // Connection counters of the gRPC and health listeners, for the metrics.
    let conn_stats = Arc::new(crate::net::conns::ConnStats::default());
    if let Some(l) = opts.metrics_listener {
        if let Ok(addr) = l.local_addr() {
            tracing::info!(metrics_addr = %addr, "metrics at /metrics");
        }
        background.push(tokio::spawn(crate::ops::metrics::serve(
            l,
            lim.max_aux_connections,
            crate::ops::metrics::Sources {
                keys: sealer.keys().clone(),
                reload: opts.reload_stats.clone(),
                flush: ledger.flush_stats(),
                replication: ledger.replication(),
                backend: ledger.backend(),
                conns: conn_stats.clone(),
                guard: sealer.guard().clone(),
                metrics: metrics.clone(),
                limits: limit_stats.clone(),
                tls: opts.tls.as_ref().map(|t| t.expiry.clone()),
                audit: opts.audit.as_ref().map(|a| a.stats().clone()),
            },
        )));
    }

    // One shutdown signal for the gRPC port and the health port.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let health_server = opts.health_listener.map(|l| {
        let stop = stopped(stop_rx.clone());
        spawn_health_port(
            l,
            &lim,
            health_service.clone(),
            inflight.clone(),
            &conn_stats,
            stop,
        )
    });

    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, backend = ledger.backend(), tls = opts.tls.is_some(), auth = ?opts.auth, "listening");
    }
    let routes = tonic::service::Routes::new(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service)
        .prepare();
    let svc = ConnActivityLayer.layer(inflight.layer(routes));
    let stop = stopped(stop_rx);
    let conns = Conns::new(
        lim.conn_policy(
            lim.max_connections,
            match opts.auth {
                Authenticator::Implicit(_) => CallerAuth::None,
                Authenticator::Bearer(_) => CallerAuth::Bearer,
                Authenticator::MutualTls(_) => CallerAuth::Certificate,
            },
        ),
        conn_stats.clone(),
    );
    let streams = lim.max_concurrent_streams;
    let serve = async {
        match &opts.tls {
            Some(t) => {
                let incoming = tls::incoming(listener, t.config.clone(), &lim, conns);
                crate::net::serve::serve(incoming, svc, &lim, streams, stop).await;
            }
            None => {
                let incoming = limited_incoming(
                    listener,
                    lim.max_connections,
                    lim.max_tls_handshakes,
                    lim.tls_handshake_timeout,
                    conns,
                );
                crate::net::serve::serve(incoming, svc, &lim, streams, stop).await;
            }
        }
    };
    // On the signal: stop accepting and let in-flight requests finish, for
    // at most the grace period; then cut what remains.
    let deadline = async {
        shutdown.await;
        let _ = stop_tx.send(true);
        tokio::time::sleep(lim.shutdown_grace).await;
    };
    // A ledger that failed for good (sled after a failed fsync) ends the
    // process with an error, for the orchestrator to restart it.
    let fatal = {
        let ledger = ledger.clone();
        let every = opts.health_every;
        async move {
            while !ledger.failed_for_good() {
                tokio::time::sleep(every.min(Duration::from_millis(200))).await;
            }
        }
    };
    let mut failed = false;
    tokio::select! {
        () = serve => {}
        () = deadline => {
            tracing::warn!(grace = ?lim.shutdown_grace, "shutdown grace period over; cutting the remaining streams");
        }
        () = fatal => {
            tracing::error!("the ledger failed and cannot recover in this process; exiting for a restart");
            failed = true;
        }
    };
    wind_down(health_server, background, ledger, failed, audit).await?;
    Ok(())
}

/// The tasks that run beside the listeners: readiness, garbage collection,
/// the clock guard, and a watcher per mounted file. Aborted at shutdown.
fn spawn_background(
    sealer: &Arc<Sealer>,
    opts: &ServeOptions,
    health: tonic_health::server::HealthReporter,
    ready: bool,
) -> Vec<tokio::task::JoinHandle<()>> {
    let ledger = sealer.ledger();
    let mut background = vec![
        tokio::spawn(report_readiness(
            ledger.clone(),
            sealer.guard().clone(),
            opts.audit.clone(),
            health,
            opts.metrics.clone(),
            opts.health_every,
            Some(ready),
        )),
        tokio::spawn(run_gc(
            ledger.clone(),
            sealer.clock().clone(),
            sealer.guard().clone(),
            sealer.limits().clock_skew,
            opts.gc_every,
            1000,
            {
                let metrics = opts.metrics.clone();
                move |n| metrics.records_collected(n)
            },
        )),
        tokio::spawn(crate::clock::guard::run(
            sealer.guard().clone(),
            ledger.clone(),
            opts.health_every,
            Duration::from_secs(10).min(opts.gc_every),
        )),
    ];
    if let Some((path, digest)) = opts.keyset.clone() {
        let apply = keyset_applier(
            sealer.keys().clone(),
            opts.keyset_kek.clone(),
            opts.audit.clone(),
        );
        background.push(spawn_watch("keyset", vec![path], digest, opts, apply));
    }
    if let Some(t) = opts.tls.clone() {
        let (paths, digest) = (t.files.paths(), t.digest);
        let apply = move |_: &[u8]| t.reload().map_err(crate::ops::reload::ApplyError::from);
        background.push(spawn_watch("tls", paths, digest, opts, apply));
    }
    if let Some((path, tenants, digest)) = opts.tenants.clone() {
        let ledger = ledger.clone();
        let apply = move |bytes: &[u8]| {
            Tenants::parse(bytes)
                .map(|t| {
                    // The default per-tenant share follows the tenants.
                    ledger.share_among(t.tenants.len() as u64);
                    tenants.store(Arc::new(t));
                })
                .map_err(crate::ops::reload::ApplyError::from)
        };
        background.push(spawn_watch("tenants", vec![path], digest, opts, apply));
    }
    background
}

/// After the listeners stopped: gives the health port a second, stops the
/// background tasks (so that they no longer hold the ledger), then flushes
/// and closes the ledger — unless it failed for good.
async fn wind_down(
    health_server: Option<tokio::task::JoinHandle<()>>,
    background: Vec<tokio::task::JoinHandle<()>>,
    ledger: Arc<dyn crate::ledger::Ledger>,
    failed: bool,
    audit: Option<Arc<crate::ops::audit::Audit>>,
) -> Result<(), ServeError> {
    if let Some(h) = health_server {
        if tokio::time::timeout(Duration::from_secs(1), h)
            .await
            .is_err()
        {
            tracing::debug!("health port cut at shutdown");
        }
    }
    // Stop the background tasks and wait until they are gone, so that they no
    // longer hold the ledger.
    for task in &background {
        task.abort();
    }
    for task in background {
        let _ = task.await;
    }
    if let Some(a) = audit {
        // Its writer thread writes the `stop` line and syncs the file.
        let _ = tokio::task::spawn_blocking(move || a.close()).await;
    }
    if failed {
        return Err(ServeError::Ledger(
            crate::ledger::LedgerError::FailedForGood,
        ));
    }
    tracing::info!("server stopped; flushing ledger");
    ledger.close().await?;
    Ok(())
}

/// The health port: `grpc.health.v1` only, plaintext, its own connection
/// and stream bounds, sharing the request-byte budget.
fn spawn_health_port<H>(
    l: TcpListener,
    lim: &TransportLimits,
    reporter_service: H,
    inflight: InflightBytesLayer,
    conn_stats: &Arc<crate::net::conns::ConnStats>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> tokio::task::JoinHandle<()>
where
    H: tower_service::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    H::Future: Send + 'static,
{
    if let Ok(addr) = l.local_addr() {
        tracing::info!(health_addr = %addr, "health port up (grpc.health.v1 only)");
    }
    let incoming = limited_incoming(
        l,
        lim.max_aux_connections,
        lim.max_tls_handshakes,
        lim.tls_handshake_timeout,
        Conns::new(
            lim.conn_policy(lim.max_aux_connections, CallerAuth::None),
            conn_stats.clone(),
        ),
    );
    let svc = ConnActivityLayer
        .layer(inflight.layer(tonic::service::Routes::new(reporter_service).prepare()));
    let lim = lim.clone();
    tokio::spawn(async move {
        crate::net::serve::serve(incoming, svc, &lim, AUX_MAX_STREAMS, stop).await;
    })
}

/// `svc` with caller authentication in front: every request gets its tenant
/// or is refused before the service reads its body.
fn behind_auth<S>(
    svc: S,
    auth: &Authenticator,
    metrics: &Arc<crate::ops::metrics::Metrics>,
) -> InterceptedService<S, impl tonic::service::Interceptor + Clone> {
    let (auth, metrics) = (auth.clone(), metrics.clone());
    InterceptedService::new(svc, move |req| {
        auth.authenticate(req)
            .inspect_err(|_| metrics.auth_failure())
    })
}

async fn set_health(
    health: &tonic_health::server::HealthReporter,
    metrics: &crate::ops::metrics::Metrics,
    ready: bool,
) {
    metrics.set_ready(ready);
    let status = if ready {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    for name in ["", SERVICE_NAME] {
        health.set_service_status(name, status).await;
    }
}

/// Watches `paths` (see [`watch_file`]); `initial` is the digest of the
/// version in force.
fn spawn_watch<F>(
    what: &'static str,
    paths: Vec<PathBuf>,
    initial: [u8; 32],
    opts: &ServeOptions,
    apply: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(&[u8]) -> Result<(), crate::ops::reload::ApplyError> + Send + Sync + 'static,
{
    tokio::spawn(watch_file(
        what,
        paths,
        initial,
        opts.reload_every,
        opts.reload_stats.clone(),
        apply,
    ))
}

/// Keeps `grpc.health.v1` in step with the ledger: SERVING only while it can
/// take consumptions.
async fn report_readiness(
    ledger: Arc<dyn crate::ledger::Ledger>,
    guard: Arc<crate::clock::guard::TimeGuard>,
    audit: Option<Arc<crate::ops::audit::Audit>>,
    health: tonic_health::server::HealthReporter,
    metrics: Arc<crate::ops::metrics::Metrics>,
    every: Duration,
    mut last: Option<bool>,
) {
    loop {
        // A fail-closed audit log that cannot write refuses every request:
        // not ready, so that traffic goes to replicas whose disk has room;
        // nor is a replica whose audit writer has ended (either mode).
        let audit_ok = audit.as_ref().is_none_or(|a| a.ready());
        let ready = ledger.ready().await && guard.synced() && audit_ok;
        if last != Some(ready) {
            set_health(&health, &metrics, ready).await;
            if ready {
                tracing::info!(backend = ledger.backend(), "ledger ready: SERVING");
            } else {
                tracing::warn!(
                    backend = ledger.backend(),
                    audit_ok,
                    "not ready: NOT_SERVING"
                );
            }
            last = Some(ready);
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod runtime_tests {
    use std::sync::{Arc, Mutex};

    /// The server's runtime runs woken and spawned tasks in the order they
    /// became ready: a task that spawns `b` and then `c` sees `b` run
    /// first. With tokio's LIFO slot (a build without `--cfg
    /// tokio_unstable`: `.cargo/config.toml`'s rustflags replaced) `c`
    /// would jump the queue, as a connection's task does when a response
    /// wakes it.
    #[test]
    fn the_runtime_runs_ready_tasks_in_order_without_the_lifo_slot() {
        let rt = super::runtime_builder()
            .worker_threads(1)
            .build()
            .expect("runtime");
        let order = Arc::new(Mutex::new(Vec::new()));
        let o = order.clone();
        rt.block_on(async move {
            let (b, c) = tokio::spawn(async move {
                let (ob, oc) = (o.clone(), o);
                let b = tokio::spawn(async move { ob.lock().expect("lock").push("b") });
                let c = tokio::spawn(async move { oc.lock().expect("lock").push("c") });
                (b, c)
            })
            .await
            .expect("join");
            b.await.expect("join b");
            c.await.expect("join c");
        });
        assert_eq!(*order.lock().expect("lock"), ["b", "c"]);
    }
}
