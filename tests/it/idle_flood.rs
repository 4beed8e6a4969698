//! Idle HTTP/2 connections cannot be hoarded (issue #36): a peer that opens
//! connections, sends the HTTP/2 preface and SETTINGS, answers PINGs and
//! sends nothing else, on the health port and on the gRPC port (plaintext,
//! and with `--auth bearer` without any credential), must not lock out
//! fresh-connection probes or legitimate callers. Each flood opens more
//! connections than the listener's cap, checks that they were all
//! established (the attack landed) and that the server closed some of them
//! (evicted or timed out), while probes and Seal/Open calls on fresh
//! connections keep succeeding (at least 99%; in practice every one).
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::process::{deploy_memory_limit, health_addr, rss_bytes, spawn, ServerProcess};
use crate::common::{open_req, seal_req};
use stateseal::proto::request_state_client::RequestStateClient;

/// What a flood did: connections whose HTTP/2 handshake completed, and how
/// many of those the server has closed since.
struct Flood {
    established: usize,
    closed: Arc<AtomicUsize>,
    held: Vec<tokio::task::JoinHandle<()>>,
}

/// How to reach the gRPC port: plaintext, or TLS trusting `ca_pem`.
#[derive(Clone)]
enum Port {
    Plain,
    Tls { ca_pem: String },
}

impl Port {
    fn rustls(&self) -> Option<Arc<rustls::ClientConfig>> {
        let Port::Tls { ca_pem } = self else {
            return None;
        };
        use rustls_pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Some(Arc::new(cfg))
    }

    /// A connected channel to `addr` (fresh connection).
    async fn channel(
        &self,
        addr: SocketAddr,
    ) -> Result<tonic::transport::Channel, tonic::transport::Error> {
        match self {
            Port::Plain => {
                tonic::transport::Channel::from_shared(format!("http://{addr}"))
                    .unwrap()
                    .connect()
                    .await
            }
            Port::Tls { ca_pem } => {
                let tls = tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(ca_pem))
                    .domain_name("localhost");
                tonic::transport::Channel::from_shared(format!("https://127.0.0.1:{}", addr.port()))
                    .unwrap()
                    .tls_config(tls)?
                    .connect()
                    .await
            }
        }
    }
}

/// `n` connections to `addr` that complete the HTTP/2 handshake (h2 answers
/// the server's PINGs and SETTINGS for them) and never send a request.
async fn idle_flood(addr: SocketAddr, n: usize) -> Flood {
    idle_flood_on(addr, n, &Port::Plain).await
}

async fn idle_flood_on(addr: SocketAddr, n: usize, port: &Port) -> Flood {
    let tls = port.rustls();
    let closed = Arc::new(AtomicUsize::new(0));
    let mut held = Vec::new();
    let mut established = 0;
    for _ in 0..n {
        let Ok(Ok(tcp)) =
            tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
                .await
        else {
            continue;
        };
        let closed = closed.clone();
        match &tls {
            None => {
                let Ok(Ok((client, conn))) =
                    tokio::time::timeout(Duration::from_secs(2), h2::client::handshake(tcp)).await
                else {
                    continue;
                };
                held.push(tokio::spawn(async move {
                    let _keep = client; // never used: no stream is ever opened
                    let _ = conn.await;
                    closed.fetch_add(1, Ordering::Relaxed);
                }));
            }
            Some(cfg) => {
                let connector = tokio_rustls::TlsConnector::from(cfg.clone());
                let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
                let handshake = async {
                    let s = connector.connect(name, tcp).await.ok()?;
                    h2::client::handshake(s).await.ok()
                };
                let Ok(Some((client, conn))) =
                    tokio::time::timeout(Duration::from_secs(2), handshake).await
                else {
                    continue;
                };
                held.push(tokio::spawn(async move {
                    let _keep = client;
                    let _ = conn.await;
                    closed.fetch_add(1, Ordering::Relaxed);
                }));
            }
        }
        established += 1;
    }
    Flood {
        established,
        closed,
        held,
    }
}

/// A health check on a fresh connection.
async fn probe(addr: SocketAddr) -> bool {
    probe_on(addr, &Port::Plain).await
}

async fn probe_on(addr: SocketAddr, port: &Port) -> bool {
    let check = async {
        let ch = port.channel(addr).await?;
        tonic_health::pb::health_client::HealthClient::new(ch)
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map_err(|e| -> Box<dyn std::error::Error + Send + Sync> { Box::new(e) })?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    };
    // The kubelet's default probe timeout is 1 s; this bound is generous
    // for a busy 2-core machine. A failure says why, for the record.
    match tokio::time::timeout(Duration::from_secs(5), check).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            eprintln!("probe of {addr} failed: {e:?}");
            false
        }
        Err(_) => {
            eprintln!("probe of {addr} timed out after 5 s");
            false
        }
    }
}

/// A Seal then Open on a fresh connection.
async fn legit(addr: SocketAddr, bearer: Option<&'static str>, port: &Port) -> bool {
    let rt = async {
        let ch = port.channel(addr).await.ok()?;
        let mut c = RequestStateClient::with_interceptor(ch, move |mut r: tonic::Request<()>| {
            if let Some(b) = bearer {
                r.metadata_mut()
                    .insert("authorization", format!("Bearer {b}").parse().unwrap());
            }
            Ok(r)
        });
        let t = c.seal(seal_req(b"legit", true)).await.ok()?.into_inner();
        let o = c.open(open_req(&t.request_state)).await.ok()?.into_inner();
        Some(o.consumed)
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(10), rt).await,
        Ok(Some(true))
    )
}

/// Floods `target` with `n` idle connections, then runs `rounds` probes
/// and legitimate calls on fresh connections while the flood holds.
async fn flooded(
    s: &ServerProcess,
    target: SocketAddr,
    (n, cap): (usize, usize),
    rounds: usize,
    bearer: Option<&'static str>,
    port: &Port,
) {
    let (addr, haddr) = (s.addr, health_addr(s));
    let on = |t: SocketAddr| if t == addr { port.clone() } else { Port::Plain };
    let flood = idle_flood_on(target, n, &on(target)).await;
    assert!(
        flood.established >= cap,
        "the attack did not land: {} of {n} connections established (cap {cap})",
        flood.established
    );
    let (mut probes_ok, mut calls_ok) = (0, 0);
    for _ in 0..rounds {
        probes_ok += usize::from(probe(haddr).await);
        probes_ok += usize::from(probe_on(addr, port).await);
        calls_ok += usize::from(legit(addr, bearer, port).await);
        // More idle connections keep arriving during the probes.
        let more = idle_flood_on(target, 4, &on(target)).await;
        drop(more.held); // detached: they stay open until the server closes them
    }
    let closed = flood.closed.load(Ordering::Relaxed);
    let (rss, limit) = (rss_bytes(s.child.id()), deploy_memory_limit());
    assert!(
        rss > 0 && rss < limit,
        "RSS {rss} during the flood; the pod limit is {limit}"
    );
    eprintln!(
        "idle flood on {target}: {} established, {closed} closed by the server; probes {probes_ok}/{}, Seal+Open {calls_ok}/{rounds}; RSS {} MiB",
        flood.established,
        2 * rounds,
        rss >> 20
    );
    assert!(
        probes_ok * 100 >= 99 * 2 * rounds,
        "probes failed during the flood: {probes_ok}/{}",
        2 * rounds
    );
    assert!(
        calls_ok * 100 >= 99 * rounds,
        "legitimate calls failed during the flood: {calls_ok}/{rounds}"
    );
    assert!(closed > 0, "the server closed none of the idle connections");
    for h in flood.held {
        h.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_connections_cannot_lock_out_the_health_port() {
    let dir = tempfile::tempdir().unwrap();
    let s = spawn(
        &dir.path().join("data"),
        &["--health-listen", "127.0.0.1:0"],
        &[],
    );
    let haddr = health_addr(&s);
    // The health port's cap is 64 (--max-aux-connections).
    flooded(&s, haddr, (100, 64), 30, None, &Port::Plain).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_connections_cannot_lock_out_the_grpc_port() {
    let dir = tempfile::tempdir().unwrap();
    let s = spawn(
        &dir.path().join("data"),
        &["--health-listen", "127.0.0.1:0", "--max-connections", "128"],
        &[],
    );
    flooded(&s, s.addr, (200, 128), 30, None, &Port::Plain).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_connections_without_credentials_are_closed_in_bearer_mode() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = crate::common::process::bearer_tenants(dir.path(), "the-secret");
    let s = spawn(
        &dir.path().join("data"),
        &[
            "--health-listen",
            "127.0.0.1:0",
            "--auth",
            "bearer",
            "--tenants",
            tenants.to_str().unwrap(),
            "--max-connections",
            "128",
            "--auth-deadline-ms",
            "1000",
        ],
        &[],
    );
    flooded(&s, s.addr, (200, 128), 20, Some("the-secret"), &Port::Plain).await;
    // Connections that never authenticate are closed after the deadline,
    // whether or not the listener is full.
    let few = idle_flood(s.addr, 10).await;
    assert_eq!(few.established, 10);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while few.closed.load(Ordering::Relaxed) < 10 {
        assert!(
            std::time::Instant::now() < deadline,
            "unauthenticated idle connections still open: {} of 10 closed",
            few.closed.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An idle connection is closed after --idle-timeout-ms, and a connection
/// with a stream open is not (a long call is never cut as idle).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_connections_time_out() {
    let dir = tempfile::tempdir().unwrap();
    let s = spawn(&dir.path().join("data"), &["--idle-timeout-ms", "500"], &[]);
    let flood = idle_flood(s.addr, 5).await;
    assert_eq!(flood.established, 5);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while flood.closed.load(Ordering::Relaxed) < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "idle connections not closed: {} of 5",
            flood.closed.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A client that keeps using its connection keeps it.
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", s.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = RequestStateClient::new(ch);
    for _ in 0..10 {
        c.seal(seal_req(b"x", false)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `grpc.health.v1.Health/Watch` is refused on the health port and on the
/// gRPC port: a stream that never ends would keep a connection busy, never
/// idle, never evicted (found by review: 64 held Watches locked out every
/// fresh probe). Check answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_watch_is_not_served() {
    let dir = tempfile::tempdir().unwrap();
    let s = spawn(
        &dir.path().join("data"),
        &["--health-listen", "127.0.0.1:0"],
        &[],
    );
    for addr in [s.addr, health_addr(&s)] {
        let ch = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
        let err = h
            .watch(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unimplemented, "{addr}");
        assert!(probe(addr).await, "{addr}: Check answers");
    }
}

/// The same flood on a TLS port with `--auth bearer`: 200 idle connections
/// that complete TLS and the HTTP/2 handshake and never send a credential.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_tls_connections_without_credentials_cannot_lock_out_the_bearer_port() {
    let dir = tempfile::tempdir().unwrap();
    let ca = crate::common::pki::Ca::new("flood-ca");
    let (cert, key) = ca.issue(vec![
        rcgen::SanType::DnsName("localhost".try_into().unwrap()),
        rcgen::SanType::IpAddress(std::net::IpAddr::from([127, 0, 0, 1])),
    ]);
    let write = |name: &str, body: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, body).unwrap();
        p.to_str().unwrap().to_owned()
    };
    let (cert, key) = (write("tls.crt", &cert), write("tls.key", &key));
    let tenants = crate::common::process::bearer_tenants(dir.path(), "the-secret")
        .display()
        .to_string();
    let s = spawn(
        &dir.path().join("data"),
        &[
            "--health-listen",
            "127.0.0.1:0",
            "--auth",
            "bearer",
            "--tenants",
            &tenants,
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--max-connections",
            "128",
            "--auth-deadline-ms",
            "1000",
        ],
        &[],
    );
    let port = Port::Tls { ca_pem: ca.pem() };
    flooded(&s, s.addr, (200, 128), 20, Some("the-secret"), &port).await;
}

/// Streams a peer never lets finish: four addresses (127.0.0.2–5, on
/// loopback) × 16 connections take every one of the health port's 64
/// permits, each with a `Health/Check` whose answer its zero flow-control
/// window never takes, so every connection is busy, never idle, never
/// evicted (found by review: probes were locked out until the connections'
/// maximum age, 630 s). A stream open past the request timeout and its
/// margin (here 3 + 5 s) closes its connection: probes answer again
/// within two such periods.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_held_open_by_a_zero_window_cannot_lock_out_probes() {
    let dir = tempfile::tempdir().unwrap();
    let s = spawn(
        &dir.path().join("data"),
        &[
            "--health-listen",
            "127.0.0.1:0",
            "--request-timeout-ms",
            "3000",
        ],
        &[],
    );
    let haddr = health_addr(&s);
    let mut held = Vec::new();
    for host in 2..=5u8 {
        for _ in 0..16 {
            let sock = tokio::net::TcpSocket::new_v4().unwrap();
            sock.bind(SocketAddr::from(([127, 0, 0, host], 0))).unwrap();
            let tcp = sock.connect(haddr).await.unwrap();
            let (mut client, conn) = h2::client::Builder::new()
                .initial_window_size(0)
                .handshake::<_, bytes::Bytes>(tcp)
                .await
                .unwrap();
            let closed = tokio::spawn(async move {
                let _ = conn.await;
            });
            let req = http::Request::post(format!("http://{haddr}/grpc.health.v1.Health/Check"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .unwrap();
            let (resp, mut body) = client.send_request(req, false).unwrap();
            // An empty HealthCheckRequest: flag 0, length 0.
            body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
                .unwrap();
            held.push((client, Some(resp), body, closed));
        }
    }
    // Every stream is counted before the probe: its answer's headers came
    // (only its DATA waits for a window that never opens).
    for h in &mut held {
        let resp = h.1.take().unwrap();
        let headers = tokio::time::timeout(Duration::from_secs(20), resp).await;
        assert!(
            matches!(headers, Ok(Ok(_))),
            "no answer headers: {headers:?}"
        );
    }
    // The attack landed: every permit is busy, a fresh probe gets nothing.
    let locked = tokio::time::timeout(Duration::from_millis(1500), probe(haddr)).await;
    assert!(
        !matches!(locked, Ok(true)),
        "a probe answered while 64 streams held every permit: the attack did not land"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if probe(haddr).await {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "probes still locked out after 60 s"
        );
    }
    let closed = held.iter().filter(|h| h.3.is_finished()).count();
    eprintln!("zero-window streams: {closed} of 64 connections closed by the server");
    assert!(closed > 0);
}

/// One unary gRPC call over a raw HTTP/2 connection; its `grpc-status`.
async fn h2_unary(
    client: &mut h2::client::SendRequest<bytes::Bytes>,
    addr: SocketAddr,
    path: &str,
    bearer: Option<&str>,
    message: &impl prost::Message,
) -> Option<String> {
    let mut framed = vec![0u8];
    let body = message.encode_to_vec();
    framed.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&body);
    let mut req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(b) = bearer {
        req = req.header("authorization", format!("Bearer {b}"));
    }
    let ready = client.clone().ready().await.ok()?;
    *client = ready;
    let (resp, mut send) = client.send_request(req.body(()).unwrap(), false).ok()?;
    send.send_data(framed.into(), true).ok()?;
    let resp = resp.await.ok()?;
    if let Some(s) = resp.headers().get("grpc-status") {
        return Some(s.to_str().ok()?.to_owned()); // trailers-only
    }
    let mut body = resp.into_body();
    while let Some(chunk) = body.data().await {
        let n = chunk.ok()?.len();
        let _ = body.flow_control().release_capacity(n);
    }
    let trailers = body.trailers().await.ok()??;
    Some(trailers.get("grpc-status")?.to_str().ok()?.to_owned())
}

/// Bearer mode, the listener at its cap with one idle connection that
/// carried an authenticated call and seven from a peer without credentials,
/// each holding a `Health/Check` whose answer its zero window never takes:
/// an arrival evicts one of the unauthenticated connections, not the
/// authenticated one (issue 58, finding 5: it evicted the idle
/// authenticated connection, and stalled checks kept the others busy).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_arrival_evicts_an_unauthenticated_busy_connection_before_an_authenticated_idle_one() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = crate::common::process::bearer_tenants(dir.path(), "the-secret");
    // Neither the authentication deadline nor the stream age closes the
    // stalled connections during the test: only eviction does.
    let s = spawn(
        &dir.path().join("data"),
        &[
            "--auth",
            "bearer",
            "--tenants",
            tenants.to_str().unwrap(),
            "--max-connections",
            "8",
            "--max-connections-per-ip",
            "64",
            "--auth-deadline-ms",
            "300000",
            "--request-timeout-ms",
            "300000",
        ],
        &[],
    );
    let addr = s.addr;
    // The authenticated connection: one Seal with the credential, then idle.
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut authed, conn) = h2::client::handshake(tcp).await.unwrap();
    let authed_task = tokio::spawn(async move {
        let _ = conn.await;
    });
    let status = h2_unary(
        &mut authed,
        addr,
        "/stateseal.v1.RequestState/Seal",
        Some("the-secret"),
        &crate::common::seal_req(b"x", false),
    )
    .await;
    assert_eq!(status.as_deref(), Some("0"), "the authenticated Seal");
    // Seven connections without credentials, each holding a stalled check.
    let mut stalled = Vec::new();
    for _ in 0..7 {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut client, conn) = h2::client::Builder::new()
            .initial_window_size(0)
            .handshake::<_, bytes::Bytes>(tcp)
            .await
            .unwrap();
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = http::Request::post(format!("http://{addr}/grpc.health.v1.Health/Check"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let (resp, mut body) = client.send_request(req, false).unwrap();
        body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
            .unwrap();
        // The answer's headers came: the stream is open and counted.
        let headers = tokio::time::timeout(Duration::from_secs(20), resp).await;
        assert!(
            matches!(headers, Ok(Ok(_))),
            "no answer headers: {headers:?}"
        );
        stalled.push((client, body, task));
    }
    // The listener is full (8): a caller arriving with its credential makes
    // room by evicting one connection.
    assert!(
        legit(addr, Some("the-secret"), &Port::Plain).await,
        "the arriving caller was not served"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let closed_stalled = loop {
        let n = stalled.iter().filter(|h| h.2.is_finished()).count();
        if n > 0 || authed_task.is_finished() {
            break n;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the arrival evicted no connection in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        !authed_task.is_finished(),
        "the idle authenticated connection was evicted while {} unauthenticated connections \
         holding stalled checks survived",
        7 - closed_stalled
    );
    assert_eq!(closed_stalled, 1, "one eviction for one arrival");
    // The authenticated connection still serves.
    let status = h2_unary(
        &mut authed,
        addr,
        "/stateseal.v1.RequestState/Seal",
        Some("the-secret"),
        &crate::common::seal_req(b"y", false),
    )
    .await;
    assert_eq!(status.as_deref(), Some("0"), "the authenticated connection");
}

/// The value of the sample `name` (with its labels) in a metrics page.
fn sample(page: &str, name: &str) -> u64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in the metrics"))
}

/// Whether `e` says its call never reached the server's handler: the
/// transport reports it not sent (hyper: canceled, its connection gone
/// before the request left) or refused by a GOAWAY (HTTP/2 §6.8: streams
/// above the GOAWAY's last stream id were not processed). gRPC's
/// transparent retry resends exactly these (grpcio, Go and Java do; tonic
/// leaves it to its caller).
fn not_processed(e: &tonic::Status) -> bool {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(x) = src {
        if x.downcast_ref::<hyper::Error>()
            .is_some_and(|h| h.is_canceled())
        {
            return true;
        }
        if let Some(h) = x.downcast_ref::<h2::Error>() {
            return h.is_go_away() && h.is_remote() && h.reason() == Some(h2::Reason::NO_ERROR);
        }
        src = x.source();
    }
    false
}

/// Issue 59: an idle close is a graceful HTTP/2 close (GOAWAY): a call
/// that crosses it is either taken by the server, or refused unprocessed
/// so that the client can resend it, never lost. Ten tonic channels (ten
/// connections) each make 100 Seals, each 80–120 ms after the last,
/// against a 100 ms idle timeout: about half of them race a close. With
/// gRPC's transparent-retry rule (resend what was not processed, at most
/// twice), not one fails; the closes were GOAWAYs, counted by cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_that_cross_an_idle_close_are_never_lost() {
    use rand::Rng;
    let dir = tempfile::tempdir().unwrap();
    let s = spawn(
        &dir.path().join("data"),
        &[
            "--idle-timeout-ms",
            "100",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let ch = tonic::transport::Channel::from_shared(format!("http://{}", s.addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        tasks.push(tokio::spawn(async move {
            let mut c = RequestStateClient::new(ch);
            let (mut failed, mut resent) = (Vec::new(), 0);
            for _ in 0..100 {
                let gap = rand::thread_rng().gen_range(80..=120);
                tokio::time::sleep(Duration::from_millis(gap)).await;
                let mut tries = 0;
                loop {
                    match c.seal(seal_req(b"x", false)).await {
                        Ok(_) => break,
                        Err(e) if tries < 2 && not_processed(&e) => {
                            tries += 1;
                            resent += 1;
                        }
                        Err(e) => {
                            failed.push(format!("{:?}: {} ({e:?})", e.code(), e.message()));
                            break;
                        }
                    }
                }
            }
            (failed, resent)
        }));
    }
    let (mut failed, mut resent) = (Vec::new(), 0);
    for t in tasks {
        let (f, r) = t.await.unwrap();
        failed.extend(f);
        resent += r;
    }
    assert!(
        failed.is_empty(),
        "{} of 1000 calls failed ({resent} resent): {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    let page =
        crate::common::process::http_get(crate::common::process::metrics_addr(&s), "/metrics");
    let goaways = sample(&page, "stateseal_goaways_sent_total{cause=\"idle\"}");
    eprintln!("1000 calls: {resent} resent as not processed, {goaways} idle GOAWAYs");
    assert!(
        goaways >= 50,
        "only {goaways} idle closes: the calls did not race them"
    );
}
