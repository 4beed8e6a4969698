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
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

use crate::auth::Authenticator;
use crate::ledger::run_gc;
use crate::proto::request_state_server::RequestStateServer;
use crate::reload::{keyset_applier, watch_file, ReloadStats};
use crate::sealer::Sealer;
use crate::service::RequestStateService;

/// The fully-qualified service name, as health checks name it.
pub const SERVICE_NAME: &str = "stateseal.v1.RequestState";

/// Server settings that are not limits of the domain.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub auth: Authenticator,
    /// How often readiness re-checks the ledger.
    pub health_every: Duration,
    /// How often expired ledger records are collected.
    pub gc_every: Duration,
    /// The keyset file to watch, and the digest of the version in force.
    pub keyset: Option<(PathBuf, [u8; 32])>,
    /// How often watched files are re-read.
    pub reload_every: Duration,
    pub reload_stats: Arc<ReloadStats>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            auth: Authenticator::Implicit(crate::binding::Tenant::new(
                crate::binding::Tenant::DEFAULT,
            )),
            health_every: Duration::from_secs(1),
            gc_every: Duration::from_secs(30),
            keyset: None,
            reload_every: Duration::from_secs(2),
            reload_stats: Arc::default(),
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

/// The largest gRPC message accepted: room for the largest params JSON plus a
/// token carrying the largest state. Bigger messages are refused by the
/// transport (RESOURCE_EXHAUSTED) before any of our checks.
pub fn max_message_size(sealer: &Sealer) -> usize {
    let l = sealer.limits();
    l.max_params_json + crate::token::encoded_len(crate::token::OVERHEAD + l.max_state) + 64 * 1024
}

/// Serves on `listener` until `shutdown` completes.
pub async fn run(
    listener: TcpListener,
    sealer: Arc<Sealer>,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let limit = max_message_size(&sealer);
    let auth = opts.auth.clone();
    let service = InterceptedService::new(
        RequestStateServer::new(RequestStateService::new(sealer.clone()))
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit),
        move |req| auth.authenticate(req),
    );

    let ledger = sealer.ledger().clone();
    let health_task = tokio::spawn({
        let ledger = ledger.clone();
        let every = opts.health_every;
        async move {
            let mut last = None;
            loop {
                let ready = ledger.ready().await;
                if last != Some(ready) {
                    for name in ["", SERVICE_NAME] {
                        let status = if ready {
                            tonic_health::ServingStatus::Serving
                        } else {
                            tonic_health::ServingStatus::NotServing
                        };
                        health.set_service_status(name, status).await;
                    }
                    if ready {
                        tracing::info!(backend = ledger.backend(), "ledger ready: SERVING");
                    } else {
                        tracing::warn!(backend = ledger.backend(), "ledger not ready: NOT_SERVING");
                    }
                    last = Some(ready);
                }
                tokio::time::sleep(every).await;
            }
        }
    });
    let gc_task = tokio::spawn(run_gc(
        ledger.clone(),
        sealer.clock().clone(),
        sealer.limits().clock_skew,
        opts.gc_every,
        1000,
    ));

    let mut background = vec![health_task, gc_task];
    if let Some((path, digest)) = opts.keyset.clone() {
        background.push(tokio::spawn(watch_file(
            "keyset",
            path,
            digest,
            opts.reload_every,
            opts.reload_stats.clone(),
            keyset_applier(sealer.keys().clone()),
        )));
    }

    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, backend = ledger.backend(), "listening");
    }
    let result = Server::builder()
        .tcp_nodelay(true)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service)
        .serve_with_incoming_shutdown(
            // Without TCP_NODELAY on accepted sockets, a response written in
            // more than one segment waits for the client's delayed ACK (~40 ms).
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown,
        )
        .await;
    // Stop the background tasks and wait until they are gone, so that they no
    // longer hold the ledger.
    for task in &background {
        task.abort();
    }
    for task in background {
        let _ = task.await;
    }
    tracing::info!("server stopped; flushing ledger");
    ledger.close().await?;
    result?;
    Ok(())
}
