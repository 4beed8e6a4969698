//! The bench's side of the calls: its connections to stateseal and the
//! baselines (written coalesced as stateseal's server writes, or vectored),
//! the bindings, and [`Ctx`], which makes each kind of call.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use stateseal::proto::request_state_client::RequestStateClient;
use stateseal::proto::{binding::Params, Binding, OpenRequest, SealRequest};
use tonic::transport::{Channel, Endpoint};

use super::baselines::{FloorFile, Handoff};

/// The binding of the `seal_json` scenario: the service canonicalizes the
/// params itself (RFC 8785) and digests them.
pub fn json_binding() -> Binding {
    let mut b = binding();
    b.params = Some(Params::ParamsJson(
        r#"{"name":"deploy","arguments":{"service":"api","replicas":3,"confirm":true}}"#.into(),
    ));
    b
}

pub fn binding() -> Binding {
    Binding {
        subject: "bench-user".into(),
        method: "tools/call".into(),
        params: Some(Params::ParamsDigest(vec![7; 32])),
        binding_version: 0,
    }
}

/// One HTTP/2 connection to `addr`, with TCP_NODELAY.
pub async fn connect(addr: &str, what: &str, client_io: ClientIo) -> Channel {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .expect("address")
        .tcp_nodelay(true);
    match client_io {
        ClientIo::Vectored => endpoint.connect().await,
        ClientIo::Coalesced => endpoint.connect_with_connector(Coalescing).await,
    }
    .unwrap_or_else(|e| panic!("connect to {what}: {e}"))
}

/// How the bench's own tonic client writes: as tonic does by default
/// (vectored: h2 writes every DATA payload of 256 B or more with a
/// `writev` of its own), or coalesced like stateseal's server connections
/// (`limits::Counted`: payloads under 1 KiB copied into h2's write buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ClientIo {
    Vectored,
    Coalesced,
}

/// A connector whose TCP connections are wrapped in stateseal's own
/// [`stateseal::internals::accept::Counted`], so the client writes exactly as the
/// server's connections do (they report that they do not write vectored).
#[derive(Clone, Copy)]
struct Coalescing;

impl tower_service::Service<http::Uri> for Coalescing {
    type Response =
        hyper_util::rt::TokioIo<stateseal::internals::accept::Counted<tokio::net::TcpStream>>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = std::io::Result<Self::Response>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        Box::pin(async move {
            // An IPv6 host comes bracketed in a URI (`[::1]`).
            let host = uri
                .host()
                .unwrap_or("127.0.0.1")
                .trim_start_matches('[')
                .trim_end_matches(']');
            let port = uri.port_u16().unwrap_or(80);
            let tcp = tokio::net::TcpStream::connect((host, port)).await?;
            tcp.set_nodelay(true)?;
            // `Counted` holds a connection permit; the client's connections
            // are not bounded, so each gets a permit of its own.
            let permit = Arc::new(tokio::sync::Semaphore::new(1))
                .try_acquire_owned()
                .map_err(std::io::Error::other)?;
            // Likewise a place of its own among connections, never closed
            // as idle.
            let own = stateseal::internals::conns::Conns::new(
                stateseal::internals::conns::ConnPolicy {
                    idle_timeout: std::time::Duration::from_secs(86_400),
                    per_ip: usize::MAX,
                    auth_deadline: None,
                    max_auth_failures: u32::MAX,
                    max_stream_age: std::time::Duration::from_secs(86_400),
                    callers_authenticate: false,
                },
                Arc::default(),
            );
            let conn = own
                .register(tcp.local_addr()?.ip())
                .ok_or_else(|| std::io::Error::other("connection registry"))?;
            Ok(hyper_util::rt::TokioIo::new(
                stateseal::internals::accept::Counted::new(tcp, permit, conn),
            ))
        })
    }
}

pub fn reason(s: &tonic::Status) -> String {
    stateseal::internals::status::reason_of(s).unwrap_or_else(|| format!("{:?}", s.code()))
}

/// Tokens for the scenarios that open pre-sealed tokens.
#[derive(Clone)]
pub enum Tokens {
    /// Reusable tokens, handed out round-robin.
    Reusable(Arc<Vec<String>>, Arc<AtomicU64>),
    /// Single-use tokens, each handed out once.
    SingleUse(Arc<std::sync::Mutex<Vec<String>>>),
}

pub struct Ctx {
    pub ttl: u32,
    pub channels: Vec<Channel>,
    pub echo: Vec<Channel>,
    pub redis: Vec<redis::aio::MultiplexedConnection>,
    pub state: Vec<u8>,
    /// What echo_fsync sends as its token: as long as a sealed one.
    pub echo_token: String,
    /// The fdatasync scenario's file.
    pub floor: Option<FloorFile>,
    /// The handoff scenario's thread.
    pub handoff: Option<Handoff>,
}

impl Ctx {
    fn client(&self, i: usize) -> RequestStateClient<Channel> {
        RequestStateClient::new(self.channels[i % self.channels.len()].clone())
    }

    /// The seal request, to the echo server.
    pub async fn echo(&self, i: usize) -> Result<(), tonic::Status> {
        RequestStateClient::new(self.echo[i % self.echo.len()].clone())
            .seal(SealRequest {
                binding: Some(binding()),
                state: self.state.clone(),
                ttl_seconds: 0,
                single_use: false,
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    /// consume's Open request (a token of a single-use token's length), to
    /// the echo server's journal.
    pub async fn echo_fsync(&self, i: usize) -> Result<(), tonic::Status> {
        RequestStateClient::new(self.echo[i % self.echo.len()].clone())
            .open(OpenRequest {
                request_state: self.echo_token.clone(),
                binding: Some(binding()),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    /// Durable SET NX EX on the private redis-server.
    pub async fn redis_set(&self, i: usize, n: u64) -> Result<(), tonic::Status> {
        let mut con = self.redis[i % self.redis.len()].clone();
        let key = format!("bench:{i}:{n}:{}", rand::random::<u64>());
        let r: redis::RedisResult<Option<String>> = redis::cmd("SET")
            .arg(key)
            .arg(1)
            .arg("NX")
            .arg("EX")
            .arg(600)
            .query_async(&mut con)
            .await;
        match r {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(tonic::Status::already_exists("key existed")),
            Err(e) => Err(tonic::Status::unavailable(format!("redis: {:?}", e.kind()))),
        }
    }

    pub async fn seal(&self, i: usize, single_use: bool) -> Result<String, tonic::Status> {
        self.seal_as(i, binding(), single_use).await
    }

    pub async fn seal_as(
        &self,
        i: usize,
        binding: Binding,
        single_use: bool,
    ) -> Result<String, tonic::Status> {
        self.client(i)
            .seal(SealRequest {
                binding: Some(binding),
                state: self.state.clone(),
                ttl_seconds: self.ttl,
                single_use,
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().request_state)
    }

    pub async fn open(&self, i: usize, token: String) -> Result<(), tonic::Status> {
        self.client(i)
            .open(OpenRequest {
                request_state: token,
                binding: Some(binding()),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    /// Open with OPEN_MODE_RESERVE, then Commit the reservation.
    pub async fn reserve_commit(&self, i: usize, token: String) -> Result<(), tonic::Status> {
        let reservation = self.reserve(i, token).await?;
        self.commit(i, reservation).await
    }

    /// Open RESERVE carrying `commit` (the caller's previous reservation,
    /// as the client packages send it): the new reservation, once the
    /// carried commit is confirmed.
    pub async fn reserve_carrying(
        &self,
        i: usize,
        token: String,
        commit: Option<String>,
    ) -> Result<String, tonic::Status> {
        let r = self
            .client(i)
            .open(OpenRequest {
                request_state: token,
                binding: Some(binding()),
                mode: stateseal::proto::OpenMode::Reserve as i32,
                commit: commit.unwrap_or_default(),
                ..Default::default()
            })
            .await?
            .into_inner();
        match r.commits.first() {
            Some(o) if !o.reason.is_empty() => Err(tonic::Status::new(
                tonic::Code::from_i32(o.code),
                format!("carried commit: {}", o.reason),
            )),
            _ => Ok(r.reservation),
        }
    }

    /// Open RESERVE: the reservation.
    pub async fn reserve(&self, i: usize, token: String) -> Result<String, tonic::Status> {
        Ok(self
            .client(i)
            .open(OpenRequest {
                request_state: token,
                binding: Some(binding()),
                mode: stateseal::proto::OpenMode::Reserve as i32,
                ..Default::default()
            })
            .await?
            .into_inner()
            .reservation)
    }

    pub async fn commit(&self, i: usize, reservation: String) -> Result<(), tonic::Status> {
        self.client(i)
            .commit(stateseal::proto::CommitRequest { reservation })
            .await
            .map(|_| ())
    }

    /// One 64-byte `pwrite` and one `fdatasync` of the fdatasync
    /// scenario's file, on this worker thread (at one caller, the thread
    /// would wait anyway).
    pub fn fdatasync(&self) -> Result<(), tonic::Status> {
        let floor = self.floor.as_ref().expect("the fdatasync scenario's file");
        tokio::task::block_in_place(|| floor.write())
            .map_err(|e| tonic::Status::unavailable(format!("fdatasync scenario: {e}")))
    }

    /// Reserves each of `tokens`, 64 at a time (not measured).
    pub async fn prereserve(self: &Arc<Self>, tokens: Vec<String>) -> Vec<String> {
        let queue = Arc::new(std::sync::Mutex::new(tokens));
        let tasks: Vec<_> = (0..64)
            .map(|w| {
                let (ctx, queue) = (self.clone(), queue.clone());
                tokio::spawn(async move {
                    let mut v = Vec::new();
                    loop {
                        let next = queue.lock().expect("queue").pop();
                        let Some(t) = next else { break v };
                        if let Ok(r) = ctx.reserve(w, t).await {
                            v.push(r);
                        }
                    }
                })
            })
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.expect("prereserve task"));
        }
        all
    }

    /// Seals `n` tokens with full concurrency (not measured).
    pub async fn preseal(self: &Arc<Self>, n: usize, single_use: bool, conc: usize) -> Vec<String> {
        let per = n.div_ceil(conc);
        let tasks: Vec<_> = (0..conc)
            .map(|w| {
                let ctx = self.clone();
                tokio::spawn(async move {
                    let mut v = Vec::with_capacity(per);
                    for _ in 0..per {
                        if let Ok(t) = ctx.seal(w, single_use).await {
                            v.push(t);
                        }
                    }
                    v
                })
            })
            .collect();
        let mut all = Vec::with_capacity(n);
        for t in tasks {
            all.extend(t.await.expect("preseal task"));
        }
        all
    }
}
