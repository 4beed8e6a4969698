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

pub mod hooked;
pub mod logs;
pub mod patroni;
pub mod pg;
pub mod pki;
pub mod private_pg;
pub mod process;
pub mod skew;
pub mod skip;

pub const T0: u64 = 1_900_000_000;

/// Lowercase hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

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

/// A server with every default (see [`Builder`]).
pub async fn start() -> TestServer {
    TestServer::builder().start().await
}

/// What a [`TestServer`] starts with. Every part has a default: a fresh
/// temporary directory holding a sled ledger, a fresh keyset, the default
/// limits and options, and a manual clock at [`T0`].
#[derive(Default)]
pub struct Builder {
    dir: Option<tempfile::TempDir>,
    keyset: Option<KeysetFile>,
    limits: Limits,
    opts: ServeOptions,
    sled: Option<Arc<SledLedger>>,
    ledger: Option<Arc<dyn Ledger>>,
    clock: Option<Arc<ManualClock>>,
    sealer_clock: Option<Arc<dyn stateseal::internals::clock::Clock>>,
}

impl Builder {
    /// The directory (a restart passes the one [`TestServer::stop`] gave back).
    pub fn dir(mut self, dir: tempfile::TempDir) -> Self {
        self.dir = Some(dir);
        self
    }
    pub fn keyset(mut self, keyset: KeysetFile) -> Self {
        self.keyset = Some(keyset);
        self
    }
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }
    pub fn options(mut self, opts: ServeOptions) -> Self {
        self.opts = opts;
        self
    }
    /// The sled ledger (kept in the handle); by default one in the directory.
    pub fn sled(mut self, sled: Arc<SledLedger>) -> Self {
        self.sled = Some(sled);
        self
    }
    /// What the sealer uses instead of the sled ledger (a wrapper that
    /// injects faults, say); the handle still keeps the sled one.
    pub fn ledger(mut self, ledger: Arc<dyn Ledger>) -> Self {
        self.ledger = Some(ledger);
        self
    }
    /// The manual clock (kept in the handle).
    pub fn clock(mut self, clock: Arc<ManualClock>) -> Self {
        self.clock = Some(clock);
        self
    }
    /// What the sealer reads instead of the manual clock.
    pub fn sealer_clock(mut self, clock: Arc<dyn stateseal::internals::clock::Clock>) -> Self {
        self.sealer_clock = Some(clock);
        self
    }

    /// Starts the server on 127.0.0.1:0 and connects a client to it.
    pub async fn start(self) -> TestServer {
        let dir = match self.dir {
            Some(d) => d,
            None => tempfile::tempdir().expect("tempdir"),
        };
        let clock = self.clock.unwrap_or_else(|| Arc::new(ManualClock::new(T0)));
        // The ledger's leases follow the test's clock too.
        let sled = match self.sled {
            Some(l) => l,
            // A test may start again on the directory it just stopped.
            None => Arc::new(open_sled_again(&dir.path().join("ledger")).with_clock(clock.clone())),
        };
        let ledger: Arc<dyn Ledger> = self.ledger.unwrap_or_else(|| sled.clone());
        let sealer_clock: Arc<dyn stateseal::internals::clock::Clock> =
            self.sealer_clock.unwrap_or_else(|| clock.clone());
        let keyset = self.keyset.unwrap_or_else(|| KeysetFile::generate(T0));
        let keys = Arc::new(KeyringHandle::new(
            Keyring::from_file(&keyset).expect("keyring"),
        ));
        let sealer = Arc::new(Sealer::new(keys.clone(), ledger, sealer_clock, self.limits));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let opts = self.opts;
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
            ledger: sled,
            client,
            dir,
            shutdown: Some(tx),
            handle: Some(handle),
        }
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
    pub fn builder() -> Builder {
        Builder::default()
    }

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

/// Opens the sled ledger at `dir`, which this process may have had open a
/// moment ago: sled's background threads can hold the directory's lock for a
/// while after the last handle drops (seen on a busy machine: "could not
/// acquire lock"), so a busy lock is waited for. A liveness bound, not a
/// speed; any other error fails at once.
pub fn open_sled_again(dir: &std::path::Path) -> SledLedger {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match SledLedger::open(dir) {
            Ok(l) => return l,
            Err(e)
                if e.to_string().contains("could not acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(50))
            }
            Err(e) => panic!("the sled ledger does not open again: {e}"),
        }
    }
}
