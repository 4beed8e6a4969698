//! Test support: a real server on 127.0.0.1:0 with a real sled directory and
//! an injected clock, and a real gRPC client.
#![allow(dead_code)]

use std::sync::Arc;

use stateseal::internals::clock::ManualClock;
use stateseal::internals::keyring::{Keyring, KeyringHandle, KeysetFile};
use stateseal::internals::ledger::sled::SledLedger;
use stateseal::internals::ledger::Ledger;
use stateseal::internals::sealer::{Limits, Sealer};
use stateseal::internals::server::ServeOptions;
use stateseal::proto::request_state_client::RequestStateClient;
use stateseal::proto::{binding::Params, Binding, OpenRequest, SealRequest};
use tonic::transport::Channel;

pub mod pki;
pub mod private_pg;
pub mod process;
pub mod skew;
pub mod skip;

pub const T0: u64 = 1_900_000_000;

pub struct TestServer {
    pub addr: std::net::SocketAddr,
    pub clock: Arc<ManualClock>,
    pub keys: Arc<KeyringHandle>,
    pub ledger: Arc<SledLedger>,
    pub client: RequestStateClient<Channel>,
    pub dir: tempfile::TempDir,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<()>>,
}

pub async fn start() -> TestServer {
    start_with(Limits::default(), ServeOptions::default()).await
}

pub async fn start_with(limits: Limits, opts: ServeOptions) -> TestServer {
    let dir = tempfile::tempdir().expect("tempdir");
    let keyset = KeysetFile::generate(T0);
    start_in(dir, keyset, limits, opts).await
}

pub async fn start_in(
    dir: tempfile::TempDir,
    keyset: KeysetFile,
    limits: Limits,
    opts: ServeOptions,
) -> TestServer {
    let ledger = Arc::new(SledLedger::open(&dir.path().join("ledger")).expect("ledger"));
    start_on(dir, keyset, limits, opts, ledger).await
}

/// A server over the given sled ledger, with a manual clock at `T0`.
pub async fn start_on(
    dir: tempfile::TempDir,
    keyset: KeysetFile,
    limits: Limits,
    opts: ServeOptions,
    ledger: Arc<SledLedger>,
) -> TestServer {
    let clock = Arc::new(ManualClock::new(T0));
    start_custom(
        dir,
        keyset,
        limits,
        opts,
        ledger.clone(),
        ledger,
        clock.clone(),
        clock,
    )
    .await
}

/// A server over any ledger and clock: `ledger` and `clock` are what the
/// sealer uses; `sled` and `manual` are kept in the handle.
#[allow(clippy::too_many_arguments)]
pub async fn start_custom(
    dir: tempfile::TempDir,
    keyset: KeysetFile,
    limits: Limits,
    opts: ServeOptions,
    sled: Arc<SledLedger>,
    ledger: Arc<dyn Ledger>,
    manual: Arc<ManualClock>,
    clock: Arc<dyn stateseal::internals::clock::Clock>,
) -> TestServer {
    let keys = Arc::new(KeyringHandle::new(
        Keyring::from_file(&keyset).expect("keyring"),
    ));
    let sealer = Arc::new(Sealer::new(keys.clone(), ledger, clock, limits));
    let (clock, ledger) = (manual, sled);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(async move {
        stateseal::internals::server::run(listener, sealer, opts, async {
            let _ = rx.await;
        })
        .await
        .expect("server run");
    });
    let client = connect(addr).await;
    TestServer {
        addr,
        clock,
        keys,
        ledger,
        client,
        dir,
        shutdown: Some(tx),
        handle: Some(handle),
    }
}

pub async fn connect(addr: std::net::SocketAddr) -> RequestStateClient<Channel> {
    let url = format!("http://{addr}");
    for _ in 0..100 {
        if let Ok(c) = RequestStateClient::connect(url.clone()).await {
            return c
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20);
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("server at {addr} did not come up");
}

impl TestServer {
    pub async fn stop(mut self) -> tempfile::TempDir {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.handle.take() {
            h.await.expect("server task");
        }
        drop(self.client);
        drop(self.ledger);
        self.dir
    }
}

pub fn binding(subject: &str, method: &str, params_json: &str) -> Binding {
    Binding {
        subject: subject.into(),
        method: method.into(),
        params: Some(Params::ParamsJson(params_json.into())),
        binding_version: 0,
    }
}

pub fn call_binding() -> Binding {
    binding(
        "alice",
        "tools/call",
        r#"{"name":"transfer","arguments":{"amount":42}}"#,
    )
}

pub fn seal_req(state: &[u8], single_use: bool) -> SealRequest {
    SealRequest {
        binding: Some(call_binding()),
        state: state.to_vec(),
        ttl_seconds: 0,
        single_use,
        ..Default::default()
    }
}

pub fn open_req(token: &str) -> OpenRequest {
    OpenRequest {
        request_state: token.into(),
        binding: Some(call_binding()),
        ..Default::default()
    }
}

/// The stateseal reason of an error status.
pub fn reason(s: &tonic::Status) -> String {
    stateseal::internals::status::reason_of(s)
        .unwrap_or_else(|| format!("<no reason: {:?}>", s.code()))
}

/// Seals a single-use token of the standard binding and consumes it;
/// returns the token.
pub async fn consume_one(c: &mut RequestStateClient<Channel>) -> String {
    let t = c
        .seal(seal_req(b"x", true))
        .await
        .expect("seal")
        .into_inner()
        .request_state;
    let opened = c.open(open_req(&t)).await.expect("open").into_inner();
    assert!(opened.consumed);
    t
}

/// Seals `n` tokens of the standard binding, one after another.
pub async fn seal_tokens(
    c: &mut RequestStateClient<Channel>,
    n: usize,
    single_use: bool,
) -> Vec<String> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(
            c.seal(seal_req(b"x", single_use))
                .await
                .expect("seal")
                .into_inner()
                .request_state,
        );
    }
    v
}

/// The `grpc.health.v1` status of `service` at `addr` (panics if the check fails).
pub async fn health_status(addr: std::net::SocketAddr, service: &str) -> i32 {
    let ch = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("url")
        .connect()
        .await
        .expect("connect");
    match tonic_health::pb::health_client::HealthClient::new(ch)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await
    {
        Ok(r) => r.into_inner().status,
        Err(e) => panic!("health check failed: {e:?}"),
    }
}

/// A binding made the way the gRPC service makes one from `params_json`
/// (the cheap checks, the digest under the current binding version, then
/// `bind`), for tests that drive the sealer directly.
pub fn bind_json(
    sealer: &Sealer,
    tenant: &stateseal::internals::binding::Tenant,
    subject: &str,
    method: &str,
    params_json: &str,
) -> Result<stateseal::internals::binding::Binding, stateseal::internals::error::Reject> {
    use stateseal::internals::binding::{params_digest_for, BindingVersion};
    let method = sealer.check_binding(subject, method)?;
    sealer.check_params_json(params_json)?;
    let digest = params_digest_for(BindingVersion::CURRENT, method, params_json)?;
    Ok(sealer.bind(
        tenant,
        subject.to_owned(),
        method,
        digest,
        BindingVersion::CURRENT,
    ))
}
