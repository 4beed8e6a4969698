//! Hostile load against the real binary on 127.0.0.1: stream floods on the
//! health port and on reflection, params amplification, a connection flood
//! and a slow-loris. Each is bounded in count and time, and asserts that the
//! server's RSS stays under the memory limit `deploy/` gives the pod, that
//! health answers during the attack, and that legitimate Seal/Open calls
//! keep succeeding. Peak RSS and health latency are printed for the
//! closing notes (`cargo test --release --test it hostile:: -- --nocapture`).
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::process::{deploy_memory_limit, health_addr, rss_bytes, spawn};
use crate::common::{binding, consume_one, open_req, reason, seal_req};
use bytes::Bytes;
use stateseal::proto::request_state_client::RequestStateClient;
use stateseal::proto::{OpenRequest, SealRequest};

/// Samples the RSS of `pid` every 20 ms until dropped; keeps the peak.
struct RssSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    fn start(pid: u32) -> Self {
        let peak = Arc::new(AtomicU64::new(rss_bytes(pid)));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (peak, stop) = (peak.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(rss_bytes(pid), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        RssSampler {
            peak,
            stop,
            thread: Some(thread),
        }
    }
    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

/// Health checks on `addr` every 100 ms during the attack: every probe must
/// answer, with at most one immediate retry on a fresh connection (as a
/// kubelet probe does with its failure threshold: a connection of the
/// prober's that is still mid-handshake can be evicted by a burst of newer
/// handshakes — the evict-oldest policy — and a single retry then gets
/// through). Returns the slowest probe.
async fn probe_health(addr: SocketAddr, until: Arc<AtomicBool>) -> Duration {
    let mut worst = Duration::ZERO;
    let mut retried = 0u32;
    while !until.load(Ordering::Relaxed) {
        let started = Instant::now();
        let check = || async {
            let ch = tonic::transport::Channel::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await?;
            tonic_health::pb::health_client::HealthClient::new(ch)
                .check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .map_err(|e| -> Box<dyn std::error::Error + Send + Sync> { Box::new(e) })?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        };
        let first = tokio::time::timeout(Duration::from_secs(10), check())
            .await
            .expect("health did not answer within 10 s during the attack");
        if let Err(e) = first {
            retried += 1;
            eprintln!("health probe failed once ({e}); retrying");
            tokio::time::timeout(Duration::from_secs(10), check())
                .await
                .expect("health did not answer within 10 s during the attack")
                .expect("health check failed twice in a row during the attack");
        }
        worst = worst.max(started.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if retried > 0 {
        eprintln!("health probes retried once: {retried}");
    }
    worst
}

/// A legitimate seal then open of a single-use token, with a fresh client
/// (a generous liveness bound: this is no timing assertion).
async fn legit_round_trip(addr: SocketAddr, bearer: Option<&str>) {
    let rt = async {
        let ch = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .expect("connect");
        let token = bearer.map(|b| format!("Bearer {b}"));
        let mut c = RequestStateClient::with_interceptor(ch, move |mut r: tonic::Request<()>| {
            if let Some(t) = &token {
                r.metadata_mut().insert("authorization", t.parse().unwrap());
            }
            Ok(r)
        });
        let t = c
            .seal(seal_req(b"legit", true))
            .await
            .expect("legitimate seal during the attack")
            .into_inner()
            .request_state;
        let o = c
            .open(open_req(&t))
            .await
            .expect("legitimate open during the attack")
            .into_inner();
        assert!(o.consumed);
    };
    tokio::time::timeout(Duration::from_secs(30), rt)
        .await
        .expect("a legitimate round trip did not finish within 30 s during the attack");
}

/// What a flood achieved and what the server answered, stream by stream.
/// Nothing is skipped silently: a connection or stream that could not be
/// made is counted, so a test can check that its attack landed.
#[derive(Default)]
struct Tally {
    connected: AtomicU64,
    handshaken: AtomicU64,
    /// Streams whose request headers (and first data) went out.
    sent: AtomicU64,
    outcomes: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

impl Tally {
    fn record(&self, outcome: String) {
        *self.outcomes.lock().unwrap().entry(outcome).or_default() += 1;
    }
    fn get(&self, outcome: &str) -> u64 {
        self.outcomes
            .lock()
            .unwrap()
            .get(outcome)
            .copied()
            .unwrap_or(0)
    }
    fn answered(&self) -> u64 {
        self.outcomes.lock().unwrap().values().sum()
    }
    fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
    fn show(&self, what: &str) -> String {
        format!(
            "{what}: {} connections ({} HTTP/2), {} streams sent, outcomes {:?}",
            self.connected.load(Ordering::Relaxed),
            self.handshaken.load(Ordering::Relaxed),
            self.sent(),
            self.outcomes.lock().unwrap()
        )
    }
    /// Asserts that the attack landed (at least `min_sent` streams went out)
    /// and that every stream sent got one of the `refusals`.
    fn assert_refused(&self, what: &str, min_sent: u64, refusals: &[&str]) {
        let shown = self.show(what);
        assert!(self.sent() >= min_sent, "the attack did not land: {shown}");
        let refused: u64 = refusals.iter().map(|r| self.get(r)).sum();
        assert_eq!(
            refused,
            self.sent(),
            "streams not refused with one of {refusals:?}: {shown}"
        );
    }
    /// Waits until every sent stream has an outcome, or `bound` passes.
    async fn settle(&self, bound: Duration) {
        let deadline = Instant::now() + bound;
        while self.answered() < self.sent() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The gRPC code of a response: from its headers (a trailers-only answer)
/// or its trailers; or how the stream ended without one.
async fn stream_outcome(resp: h2::client::ResponseFuture) -> String {
    fn h2_end(e: &h2::Error) -> String {
        if let Some(r) = e.reason() {
            if e.is_go_away() {
                return format!("goaway:{r:?}");
            }
            return format!("reset:{r:?}");
        }
        "closed".into()
    }
    fn code(h: &http::HeaderMap) -> Option<String> {
        let c = h.get("grpc-status")?.to_str().ok()?.parse::<i32>().ok()?;
        Some(format!("{:?}", tonic::Code::from_i32(c)))
    }
    let resp = match resp.await {
        Ok(r) => r,
        Err(e) => return h2_end(&e),
    };
    if let Some(c) = code(resp.headers()) {
        return c;
    }
    let mut body = resp.into_body();
    while let Some(chunk) = body.data().await {
        if let Err(e) = chunk {
            return h2_end(&e);
        }
    }
    match body.trailers().await {
        Ok(Some(t)) => code(&t).unwrap_or_else(|| "no grpc-status".into()),
        Ok(None) => "no trailers".into(),
        Err(e) => h2_end(&e),
    }
}

/// Opens `conns` HTTP/2 connections to `addr`, and on each up to `streams`
/// streams to `path`, each sending a gRPC message header that declares
/// `declared` bytes followed by `send` bytes, then holding the stream open.
/// Every stream's outcome goes to `tally`. Returns once every stream has
/// been attempted; the connections stay open until the returned handles
/// are dropped.
const HEALTH_CHECK: &str = "/grpc.health.v1.Health/Check";

/// The headers of a gRPC call of `path` on `addr`, for a raw h2 client.
fn grpc_post(addr: SocketAddr, path: &str) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

async fn stream_flood(
    addr: SocketAddr,
    path: &str,
    conns: usize,
    streams: usize,
    declared: u32,
    send: usize,
    tally: Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut held = Vec::new();
    for _ in 0..conns {
        let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
            continue;
        };
        tally.connected.fetch_add(1, Ordering::Relaxed);
        let Ok((client, conn)) = h2::client::handshake(tcp).await else {
            continue;
        };
        tally.handshaken.fetch_add(1, Ordering::Relaxed);
        held.push(tokio::spawn(async move {
            let _ = conn.await;
        }));
        for _ in 0..streams {
            let client = client.clone();
            let path = path.to_owned();
            let tally = tally.clone();
            held.push(tokio::spawn(async move {
                // Beyond the server's stream limit this waits for a slot:
                // such a stream was never sent, and is not counted as sent.
                let Ok(mut c) = client.ready().await else {
                    return;
                };
                let Ok((resp, mut body)) = c.send_request(grpc_post(addr, &path), false) else {
                    return;
                };
                tally.sent.fetch_add(1, Ordering::Relaxed);
                let mut frame = vec![0u8];
                frame.extend_from_slice(&declared.to_be_bytes());
                frame.resize(5 + send, b'a');
                let _ = body.send_data(Bytes::from(frame), false);
                // Hold the stream (and its answer, if any) open.
                let outcome = stream_outcome(resp).await;
                tally.record(outcome);
                tokio::time::sleep(Duration::from_secs(60)).await;
                drop(body);
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    held
}

fn report(what: &str, base: u64, peak: u64, worst_health: Duration, limit: u64) {
    println!(
        "{what}: RSS {:.1} MiB before, peak {:.1} MiB (limit {} MiB); slowest health check {:?}",
        base as f64 / 1048576.0,
        peak as f64 / 1048576.0,
        limit / 1048576,
        worst_health
    );
    assert!(
        peak < limit,
        "{what}: peak RSS {peak} B is over the deployment's memory limit {limit} B"
    );
}

/// Runs `attack` against a server started with `args`, probing health and
/// legitimate calls meanwhile, and checks the memory bound. With `settle`,
/// the attack is held (probes running) until every stream it sent has an
/// outcome or the bound passes.
async fn under_attack<F, Fut>(
    what: &str,
    args: &[&str],
    bearer: Option<&str>,
    settle: Option<(&Tally, Duration)>,
    attack: F,
) where
    F: FnOnce(SocketAddr, SocketAddr) -> Fut,
    Fut: std::future::Future<Output = Vec<tokio::task::JoinHandle<()>>>,
{
    let dir = tempfile::tempdir().unwrap();
    let mut all = vec!["--health-listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let s = spawn(&dir.path().join("data"), &all, &[]);
    let (addr, haddr) = (s.addr, health_addr(&s));
    let pid = s.child.id();
    legit_round_trip(addr, bearer).await;
    let base = rss_bytes(pid);
    let sampler = RssSampler::start(pid);
    let done = Arc::new(AtomicBool::new(false));
    let prober = tokio::spawn(probe_health(haddr, done.clone()));
    let held = attack(addr, haddr).await;
    for _ in 0..3 {
        legit_round_trip(addr, bearer).await;
    }
    if let Some((tally, bound)) = settle {
        tally.settle(bound).await;
        println!("{}", tally.show(what));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    done.store(true, Ordering::Relaxed);
    let worst = prober.await.expect("prober");
    let peak = sampler.finish();
    for h in held {
        h.abort();
    }
    report(what, base, peak, worst, deploy_memory_limit());
    let (status, _) = s.terminate();
    assert!(status.success(), "{what}: exit {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_flood_on_the_health_port() {
    let tally = Arc::new(Tally::default());
    let t = tally.clone();
    let settle = Some((&*tally, Duration::from_secs(30)));
    under_attack(
        "health stream flood",
        &[],
        None,
        settle,
        |_, haddr| async move {
            // 8 connections × 100 streams, each declaring a 4 MiB Health/Check.
            stream_flood(
                haddr,
                "/grpc.health.v1.Health/Check",
                8,
                100,
                4 << 20,
                64 * 1024,
                t,
            )
            .await
        },
    )
    .await;
    // Each declared 4 MiB against the health port's 4 KiB message limit:
    // refused at its header (OUT_OF_RANGE), or refused outright beyond the
    // port's 16 streams per connection.
    // (A client that opens streams before the server's SETTINGS arrive can
    // draw more refusals than h2 tolerates from a peer: the server then ends
    // the connection with GOAWAY ENHANCE_YOUR_CALM, a refusal too, and the
    // streams still on it end with the connection.)
    tally.assert_refused(
        "health stream flood",
        800,
        &[
            "OutOfRange",
            "reset:REFUSED_STREAM",
            "goaway:ENHANCE_YOUR_CALM",
            "closed",
        ],
    );
}

fn bearer_args(dir: &std::path::Path) -> Vec<String> {
    let tenants = crate::common::process::bearer_tenants(dir, "the-secret");
    vec![
        "--auth".into(),
        "bearer".into(),
        "--tenants".into(),
        tenants.display().to_string(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_flood_on_reflection_without_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let args = bearer_args(dir.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let tally = Arc::new(Tally::default());
    let (t, one) = (tally.clone(), Arc::new(Tally::default()));
    let o = one.clone();
    const REFLECTION: &str = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";
    under_attack(
        "reflection stream flood (no credentials)",
        &args,
        Some("the-secret"),
        Some((&*tally, Duration::from_secs(30))),
        |addr, _| async move {
            // One stream alone on its connection first: far from the 16
            // failures that close a connection, so its answer is read.
            let mut held =
                stream_flood(addr, REFLECTION, 1, 1, 4 << 20, 64 * 1024, o.clone()).await;
            o.settle(Duration::from_secs(30)).await;
            held.extend(stream_flood(addr, REFLECTION, 8, 100, 4 << 20, 64 * 1024, t).await);
            held
        },
    )
    .await;
    assert_eq!(
        one.get("Unauthenticated"),
        1,
        "{}",
        one.show("reflection, one stream")
    );
    // No credential: UNAUTHENTICATED, and after 16 failures the connection
    // is closed (its remaining streams end with it). None reached
    // reflection.
    tally.assert_refused(
        "reflection stream flood",
        8,
        &["Unauthenticated", "closed", "reset:REFUSED_STREAM"],
    );
}

/// `{"a":[{"":0},{"":0},…]}` of about `bytes` bytes: the shape that costs a
/// `serde_json::Value` tree ~100× its size.
fn pathological_params(bytes: usize) -> String {
    let unit = r#"{"":0},"#;
    let mut s = String::with_capacity(bytes + 16);
    s.push_str(r#"{"name":"t","arguments":{"a":["#);
    while s.len() + unit.len() + 4 < bytes {
        s.push_str(unit);
    }
    s.push_str(r#"{"":0}]}}"#);
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn params_amplification() {
    under_attack(
        "params amplification",
        &[],
        None,
        None,
        |addr, _| async move {
            let params = Arc::new(pathological_params(1000 * 1024));
            let mut tasks = Vec::new();
            for i in 0..32 {
                let params = params.clone();
                tasks.push(tokio::spawn(async move {
                    let mut c = crate::common::connect(addr).await;
                    let b = binding("mallory", "tools/call", &params);
                    if i % 2 == 0 {
                        // A garbage token: refused before the params are read
                        // (or, when the request-byte budget is full, at once).
                        let err = c
                            .open(OpenRequest {
                                request_state: "garbage".into(),
                                binding: Some(b),
                                ..Default::default()
                            })
                            .await
                            .unwrap_err();
                        let r = reason(&err);
                        assert!(r == "MALFORMED" || r == "OVERLOADED", "{err:?}");
                    } else {
                        // A seal must canonicalize: bounded, or refused at once.
                        match c
                            .seal(SealRequest {
                                binding: Some(b),
                                state: b"x".to_vec(),
                                ttl_seconds: 0,
                                single_use: true,
                                ..Default::default()
                            })
                            .await
                        {
                            Ok(_) => {}
                            Err(e) => {
                                assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
                                assert_eq!(reason(&e), "OVERLOADED");
                            }
                        }
                    }
                }));
            }
            for t in tasks {
                t.await.expect("attack task");
            }
            Vec::new()
        },
    )
    .await;
}

/// Sockets of `socks` the server has closed (EOF or reset), read without
/// blocking.
fn closed_by_server(socks: &[std::net::TcpStream]) -> usize {
    use std::io::Read;
    socks
        .iter()
        .filter(|s| {
            let mut b = [0u8; 1];
            match (&**s).read(&mut b) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            }
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_flood() {
    // At most 64 connections per listener wait in their handshake (here: for
    // the HTTP/2 preface); a newer one evicts the oldest. The handshake
    // timeout is long, so that only eviction can close the flood early.
    const HANDSHAKE_SLOTS: usize = 64;
    let open_after_flood = Arc::new(std::sync::Mutex::new((0usize, usize::MAX)));
    let seen = open_after_flood.clone();
    under_attack(
        "connection flood",
        &[
            "--max-connections",
            "256",
            "--handshake-timeout-ms",
            "20000",
        ],
        None,
        None,
        |addr, haddr| async move {
            // 2,000 connections that never send the HTTP/2 preface, half of
            // them on the health port.
            let mut socks = Vec::new();
            for i in 0..2000 {
                let target = if i % 2 == 0 { addr } else { haddr };
                if let Ok(Ok(s)) = tokio::time::timeout(
                    Duration::from_millis(200),
                    tokio::net::TcpStream::connect(target),
                )
                .await
                {
                    socks.push(s.into_std().unwrap());
                }
            }
            // Beyond the handshake slots, the oldest were evicted: soon at
            // most the slots of both listeners (and a probe or two of the
            // test's) stay open, long before the handshake timeout.
            let bound = 2 * HANDSHAKE_SLOTS + 8;
            let deadline = Instant::now() + Duration::from_secs(15);
            let mut open = socks.len() - closed_by_server(&socks);
            while open > bound && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                open = socks.len() - closed_by_server(&socks);
            }
            *seen.lock().unwrap() = (socks.len(), open);
            // Then every one is closed by the handshake timeout.
            let deadline = Instant::now() + Duration::from_secs(60);
            while closed_by_server(&socks) < socks.len() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let closed = closed_by_server(&socks);
            assert_eq!(
                closed,
                socks.len(),
                "connections that never sent a preface were left open past the handshake timeout"
            );
            Vec::new()
        },
    )
    .await;
    let (connected, open) = *open_after_flood.lock().unwrap();
    println!("connection flood: {connected} connected, {open} open once the flood was in");
    assert!(
        connected >= 1000,
        "the flood did not land: {connected} connections"
    );
    assert!(
        open <= 2 * HANDSHAKE_SLOTS + 8,
        "{open} flood connections stayed open in their handshake, over the {HANDSHAKE_SLOTS} slots per listener"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_loris() {
    let tally = Arc::new(Tally::default());
    let t = tally.clone();
    under_attack(
        "slow-loris",
        &["--request-timeout-ms", "3000"],
        None,
        Some((&*tally, Duration::from_secs(60))),
        |addr, _| async move {
            // 16 connections × 100 streams of Seal, each declaring 900 KiB
            // and sending 16 KiB, then stalling.
            stream_flood(
                addr,
                "/stateseal.v1.RequestState/Seal",
                16,
                100,
                900 * 1024,
                16 * 1024,
                t,
            )
            .await
        },
    )
    .await;
    // Every stalled stream is cut: by the 3 s request timeout (CANCELLED),
    // or refused at once because the request-byte budget was full.
    tally.assert_refused("slow-loris", 1600, &["Cancelled", "ResourceExhausted"]);
    assert!(
        tally.get("Cancelled") >= 1 && tally.get("ResourceExhausted") >= 1,
        "{}",
        tally.show("slow-loris")
    );
}

/// SIGTERM with a stream that never finishes: the process cuts it after
/// `--shutdown-grace-ms`, exits 0, and the ledger was flushed (a token
/// consumed before the signal is still consumed after a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_has_a_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = [
        "--shutdown-grace-ms",
        "1000",
        "--request-timeout-ms",
        "600000",
    ];
    let s = spawn(&data, &args, &[]);
    let mut c = crate::common::connect(s.addr).await;
    let t = consume_one(&mut c).await;
    // A Seal whose message never completes.
    let held = stream_flood(
        s.addr,
        "/stateseal.v1.RequestState/Seal",
        1,
        1,
        1000,
        10,
        Arc::new(Tally::default()),
    )
    .await;
    let started = Instant::now();
    let (status, log) = s.terminate();
    assert!(status.success(), "exit {status}");
    assert!(
        log.iter().any(|l| l.contains("grace period over")),
        "the stalled stream was not cut: {log:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "shutdown took {:?}",
        started.elapsed()
    );
    for h in held {
        h.abort();
    }
    let s = spawn(&data, &[], &[]);
    let mut c = crate::common::connect(s.addr).await;
    assert_eq!(reason(&c.open(open_req(&t)).await.unwrap_err()), "REPLAYED");
    s.terminate();
}

/// Sends `n` Health/Check calls on `client` while the server is stopped,
/// each reset (CANCEL) once `after` has passed, as a gRPC client cancels a
/// call whose deadline expired; the streams beyond the server's limit wait
/// for a slot that a reset frees, as a client library's calls do.
async fn expiring_calls(
    client: &h2::client::SendRequest<Bytes>,
    addr: SocketAddr,
    n: usize,
    after: Duration,
) {
    let mut resets = Vec::new();
    for _ in 0..n {
        let mut c = client.clone().ready().await.expect("a slot");
        let (resp, mut body) = c
            .send_request(grpc_post(addr, HEALTH_CHECK), false)
            .expect("send");
        body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true)
            .expect("body");
        resets.push(tokio::spawn(async move {
            tokio::time::sleep(after).await;
            body.send_reset(h2::Reason::CANCEL);
            drop(resp);
        }));
    }
    for r in resets {
        r.await.unwrap();
    }
}

/// One Health/Check on `client`; its outcome (`Ok` when answered).
async fn health_on(client: &h2::client::SendRequest<Bytes>, addr: SocketAddr) -> String {
    let Ok(mut c) = client.clone().ready().await else {
        return "closed".into();
    };
    let Ok((resp, mut body)) = c.send_request(grpc_post(addr, HEALTH_CHECK), false) else {
        return "closed".into();
    };
    let _ = body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true);
    tokio::time::timeout(Duration::from_secs(10), stream_outcome(resp))
        .await
        .unwrap_or_else(|_| "timeout".into())
}

/// Issue 59: a client whose calls expire while the server is stalled
/// (SIGSTOP 2 s) resets each of them; after the stall the server reads all
/// those resets at once. Within four times the stream limit (Go's http2
/// server's rule) that is a cancelling client: no GOAWAY, and its next
/// call on the same connection is answered. Far past it (the rapid-reset
/// pattern: streams opened and reset faster than the server takes them)
/// the connection is still cut with GOAWAY ENHANCE_YOUR_CALM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_of_calls_that_expired_in_a_stall_are_not_a_reset_flood() {
    let dir = tempfile::tempdir().unwrap();
    let s = spawn(dir.path(), &[], &[]);
    let (addr, pid) = (s.addr, s.child.id().to_string());
    let signal = |sig: &str| {
        assert!(std::process::Command::new("kill")
            .args([sig, pid.as_str()])
            .status()
            .unwrap()
            .success());
    };
    for (n, cut) in [(300usize, false), (2000, true)] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (client, conn) = h2::client::handshake(tcp).await.unwrap();
        let conn = tokio::spawn(conn);
        assert_eq!(health_on(&client, addr).await, "Ok", "before the stall");
        signal("-STOP");
        let stalled = Instant::now();
        let sent = tokio::time::timeout(
            Duration::from_secs(30),
            expiring_calls(&client, addr, n, Duration::from_millis(100)),
        )
        .await;
        tokio::time::sleep(Duration::from_secs(2).saturating_sub(stalled.elapsed())).await;
        signal("-CONT");
        assert!(sent.is_ok(), "{n} calls could not be sent during the stall");
        let next = health_on(&client, addr).await;
        if cut {
            assert_eq!(next, "goaway:ENHANCE_YOUR_CALM", "{n} resets at once");
        } else {
            assert_eq!(next, "Ok", "the call after {n} expired ones");
            assert!(!conn.is_finished(), "the connection ended after {n} resets");
        }
        conn.abort();
    }
    let (status, _) = s.terminate();
    assert!(status.success());
}
