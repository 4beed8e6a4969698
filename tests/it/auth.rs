//! Caller authentication and tenant isolation with real TLS handshakes:
//! a throwaway CA and certificates made with rcgen, the real binary, a real
//! tonic client.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::pki::Ca;
use crate::common::process::{spawn, ServerProcess};
use crate::common::*;
use rcgen::SanType;
use sha2::{Digest, Sha256};
use stateseal::proto::request_state_client::RequestStateClient;
use stateseal::proto::{CommitRequest, OpenMode, OpenRequest, ReleaseRequest, RenewRequest};
use tonic::transport::{Certificate as TlsCert, Channel, ClientTlsConfig, Identity};
use tonic::Code;

fn uri(u: &str) -> SanType {
    SanType::URI(u.try_into().unwrap())
}

fn server_sans() -> Vec<SanType> {
    vec![
        SanType::DnsName("localhost".try_into().unwrap()),
        SanType::IpAddress("127.0.0.1".parse().unwrap()),
    ]
}

fn write(dir: &Path, name: &str, content: &str) -> String {
    let p = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
    p.display().to_string()
}

struct Pki {
    dir: tempfile::TempDir,
    ca: Ca,
    cert: String,
    key: String,
    client_ca: String,
    tenants: String,
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("stateseal test CA");
    let (scert, skey) = ca.issue(server_sans());
    let cert = write(dir.path(), "server.pem", &scert);
    let key = write(dir.path(), "server.key", &skey);
    let client_ca = write(dir.path(), "client-ca.pem", &ca.pem());
    let tenants = write(
        dir.path(),
        "tenants.json",
        &format!(
            r#"{{"tenants":[
                {{"name":"tenant-a","uri":"spiffe://test/a","bearer_sha256":"{}"}},
                {{"name":"tenant-b","uri":"spiffe://test/b","bearer_sha256":"{}"}}]}}"#,
            hex(&Sha256::digest(b"secret-of-a")),
            hex(&Sha256::digest(b"secret-of-b"))
        ),
    );
    Pki {
        dir,
        ca,
        cert,
        key,
        client_ca,
        tenants,
    }
}

fn start_mtls(p: &Pki, extra: &[&str]) -> ServerProcess {
    let mut args = vec![
        "--auth",
        "mtls",
        "--tls-cert",
        &p.cert,
        "--tls-key",
        &p.key,
        "--tls-client-ca",
        &p.client_ca,
        "--tenants",
        &p.tenants,
        "--reload-interval-ms",
        "100",
    ];
    args.extend_from_slice(extra);
    spawn(&p.dir.path().join("data"), &args, &[])
}

async fn tls_client(
    addr: std::net::SocketAddr,
    server_ca: &str,
    identity: Option<&(String, String)>,
) -> Result<RequestStateClient<Channel>, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(TlsCert::from_pem(server_ca))
        .domain_name("localhost");
    if let Some((c, k)) = identity {
        tls = tls.identity(Identity::from_pem(c, k));
    }
    let ch = Channel::from_shared(format!("https://127.0.0.1:{}", addr.port()))
        .unwrap()
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?;
    Ok(RequestStateClient::new(ch))
}

/// Whether a seal succeeds over a fresh connection with this identity.
async fn can_seal(
    addr: std::net::SocketAddr,
    server_ca: &str,
    identity: Option<&(String, String)>,
) -> Result<(), String> {
    let mut c = tls_client(addr, server_ca, identity)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    c.seal(seal_req(b"x", false))
        .await
        .map(|_| ())
        .map_err(|e| format!("{:?}: {}", e.code(), e.message()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_isolates_tenants_and_refuses_strangers() {
    let p = pki();
    let s = start_mtls(&p, &[]);
    let a_id = p.ca.issue(vec![uri("spiffe://test/a")]);
    let b_id = p.ca.issue(vec![uri("spiffe://test/b")]);
    let mut a = tls_client(s.addr, &p.ca.pem(), Some(&a_id)).await.unwrap();
    let mut b = tls_client(s.addr, &p.ca.pem(), Some(&b_id)).await.unwrap();

    // A seals a single-use token; B can neither open nor burn it; A opens it.
    let t = a
        .seal(seal_req(b"for tenant a", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    for _ in 0..3 {
        let err = b.open(open_req(&t)).await.unwrap_err();
        assert_eq!(reason(&err), "REJECTED");
    }
    let opened = a.open(open_req(&t)).await.unwrap().into_inner();
    assert_eq!(opened.state, b"for tenant a");
    assert!(opened.consumed);
    assert_eq!(reason(&a.open(open_req(&t)).await.unwrap_err()), "REPLAYED");

    // The reserve path too: B can neither reserve A's token nor commit,
    // renew or release A's reservation; A's reservation still holds after
    // B's attempts and commits once.
    let reserve = |t: &str| OpenRequest {
        mode: OpenMode::Reserve as i32,
        ..open_req(t)
    };
    let t = a
        .seal(seal_req(b"reserved by a", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert_eq!(reason(&b.open(reserve(&t)).await.unwrap_err()), "REJECTED");
    let r = a.open(reserve(&t)).await.unwrap().into_inner().reservation;
    let refused = |e: tonic::Status| {
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert_eq!(reason(&e), "REJECTED", "{e:?}");
    };
    for _ in 0..2 {
        refused(
            b.commit(CommitRequest {
                reservation: r.clone(),
            })
            .await
            .unwrap_err(),
        );
        refused(
            b.renew(RenewRequest {
                reservation: r.clone(),
                lease_seconds: 0,
            })
            .await
            .unwrap_err(),
        );
        refused(
            b.release(ReleaseRequest {
                reservation: r.clone(),
            })
            .await
            .unwrap_err(),
        );
    }
    // Nor carry it on an Open of B's own: refused, as B's Commit is.
    let own = b
        .seal(seal_req(b"b's own", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let carried = b
        .open(OpenRequest {
            commit: r.clone(),
            ..open_req(&own)
        })
        .await
        .unwrap()
        .into_inner()
        .commits;
    assert_eq!(carried.len(), 1);
    assert_eq!(carried[0].reason, "REJECTED");
    assert_eq!(carried[0].code, Code::PermissionDenied as i32);
    assert_eq!(reason(&a.open(reserve(&t)).await.unwrap_err()), "IN_USE");
    a.renew(RenewRequest {
        reservation: r.clone(),
        lease_seconds: 0,
    })
    .await
    .unwrap();
    a.commit(CommitRequest { reservation: r }).await.unwrap();
    assert_eq!(reason(&a.open(reserve(&t)).await.unwrap_err()), "REPLAYED");

    // No client certificate: refused.
    assert!(can_seal(s.addr, &p.ca.pem(), None).await.is_err());
    // A certificate from another CA: refused.
    let other = Ca::new("another CA").issue(vec![uri("spiffe://test/a")]);
    assert!(can_seal(s.addr, &p.ca.pem(), Some(&other)).await.is_err());
    // A valid certificate that maps to no tenant: PERMISSION_DENIED.
    let stranger = p.ca.issue(vec![uri("spiffe://test/z")]);
    let mut c = tls_client(s.addr, &p.ca.pem(), Some(&stranger))
        .await
        .unwrap();
    let err = c.seal(seal_req(b"x", false)).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);
    assert_eq!(err.message(), "client certificate maps to no tenant");
    // A plaintext client gets nothing.
    let plain = tonic::transport::Channel::from_shared(format!("http://{}", s.addr))
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = plain {
        assert!(RequestStateClient::new(ch)
            .seal(seal_req(b"x", false))
            .await
            .is_err());
    }
    s.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_and_client_ca_rotate_without_restart() {
    let p = pki();
    let s = start_mtls(&p, &[]);
    let a_id = p.ca.issue(vec![uri("spiffe://test/a")]);
    can_seal(s.addr, &p.ca.pem(), Some(&a_id)).await.unwrap();

    // New CA for clients and for the server certificate.
    let ca2 = Ca::new("rotated CA");
    let a2_id = ca2.issue(vec![uri("spiffe://test/a")]);
    assert!(
        can_seal(s.addr, &p.ca.pem(), Some(&a2_id)).await.is_err(),
        "not yet trusted"
    );
    let (scert, skey) = ca2.issue(server_sans());
    write(p.dir.path(), "server.key", &skey);
    write(p.dir.path(), "server.pem", &scert);
    write(p.dir.path(), "client-ca.pem", &ca2.pem());

    let deadline = Instant::now() + Duration::from_secs(10);
    while can_seal(s.addr, &ca2.pem(), Some(&a2_id)).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "rotation not picked up: {:?}",
            s.log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The old client CA and the old server certificate are gone.
    assert!(can_seal(s.addr, &ca2.pem(), Some(&a_id)).await.is_err());
    assert!(can_seal(s.addr, &p.ca.pem(), Some(&a2_id)).await.is_err());
    s.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_secrets() {
    let p = pki();
    let s = spawn(
        &p.dir.path().join("data"),
        &["--auth", "bearer", "--tenants", &p.tenants],
        &[],
    );
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", s.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let with = |secret: Option<&'static str>| {
        let ch = ch.clone();
        RequestStateClient::with_interceptor(ch, move |mut req: tonic::Request<()>| {
            if let Some(sec) = secret {
                req.metadata_mut()
                    .insert("authorization", format!("Bearer {sec}").parse().unwrap());
            }
            Ok(req)
        })
    };
    let mut a = with(Some("secret-of-a"));
    let mut b = with(Some("secret-of-b"));
    let t = a
        .seal(seal_req(b"x", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert_eq!(reason(&b.open(open_req(&t)).await.unwrap_err()), "REJECTED");
    assert!(a.open(open_req(&t)).await.unwrap().into_inner().consumed);
    for secret in [Some("secret-of-c"), Some(""), None] {
        let err = with(secret).seal(seal_req(b"x", false)).await.unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{secret:?}");
    }
    let (_, log) = s.terminate();
    let log = log.join("\n");
    for secret in ["secret-of-a", "secret-of-b", "secret-of-c"] {
        assert!(!log.contains(secret), "a bearer secret was logged");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_port_answers_probes_without_credentials_and_nothing_else() {
    let p = pki();
    let s = start_mtls(&p, &["--health-listen", "127.0.0.1:0"]);
    let health_addr: std::net::SocketAddr = {
        let log = s.log.lock().unwrap();
        let line = log
            .iter()
            .find(|l| l.contains("health_addr="))
            .expect("health port logged")
            .clone();
        line.split_whitespace()
            .find_map(|w| w.strip_prefix("health_addr="))
            .unwrap()
            .parse()
            .unwrap()
    };
    let ch = tonic::transport::Channel::from_shared(format!("http://{health_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let status = tonic_health::pb::health_client::HealthClient::new(ch.clone())
        .check(tonic_health::pb::HealthCheckRequest {
            service: "stateseal.v1.RequestState".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let err = RequestStateClient::new(ch)
        .seal(seal_req(b"x", false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    s.terminate();
}

#[test]
fn insecure_configurations_refuse_to_start() {
    let p = pki();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--listen", "0.0.0.0:0"], "refusing to serve plaintext"),
        (
            vec![
                "--listen",
                "0.0.0.0:0",
                "--auth",
                "bearer",
                "--tenants",
                &p.tenants,
            ],
            "bearer secrets in plaintext",
        ),
        (
            vec!["--auth", "mtls", "--tenants", &p.tenants],
            "--auth mtls needs",
        ),
        (vec!["--auth", "bearer"], "--auth bearer needs --tenants"),
        (
            vec![
                "--tls-cert",
                &p.cert,
                "--tls-key",
                &p.key,
                "--tls-client-ca",
                &p.client_ca,
            ],
            "only used with --auth mtls",
        ),
    ];
    for (args, want) in cases {
        crate::common::process::assert_refuses(&args, &p.dir.path().join("d"), want);
    }
}

/// Authorization follows the tenants file and client CA in force, also on
/// connections that are already open: a removed tenant is refused on its
/// open channel at the next call; a replaced client CA closes old
/// connections within `--max-connection-age-s` (+ grace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_reaches_open_connections() {
    let p = pki();
    let s = start_mtls(
        &p,
        &[
            "--max-connection-age-s",
            "2",
            "--max-connection-age-grace-s",
            "1",
        ],
    );
    let a_id = p.ca.issue(vec![uri("spiffe://test/a")]);
    let b_id = p.ca.issue(vec![uri("spiffe://test/b")]);
    let mut a = tls_client(s.addr, &p.ca.pem(), Some(&a_id)).await.unwrap();
    let mut b = tls_client(s.addr, &p.ca.pem(), Some(&b_id)).await.unwrap();
    a.seal(seal_req(b"x", false)).await.unwrap();
    b.seal(seal_req(b"x", false)).await.unwrap();

    // Tenant a removed from the tenants file: a's open channel is refused.
    write(
        p.dir.path(),
        "tenants.json",
        r#"{"tenants":[{"name":"tenant-b","uri":"spiffe://test/b"}]}"#,
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match a.seal(seal_req(b"x", false)).await {
            Err(e) if e.code() == Code::PermissionDenied => break,
            _ => {
                assert!(Instant::now() < deadline, "removed tenant still served");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    // The same channel is refused on every later call; b is untouched.
    assert_eq!(
        a.seal(seal_req(b"x", false)).await.unwrap_err().code(),
        Code::PermissionDenied
    );
    b.seal(seal_req(b"x", false)).await.unwrap();

    // The client CA is replaced: b's certificate no longer chains to it.
    // Its open connection is closed at the maximum connection age, and the
    // reconnection's handshake fails.
    let ca2 = Ca::new("replacement CA");
    write(p.dir.path(), "client-ca.pem", &ca2.pem());
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        match b.seal(seal_req(b"x", false)).await {
            Err(_) => break,
            Ok(_) => {
                assert!(
                    Instant::now() < deadline,
                    "a connection under the replaced CA outlived the maximum connection age"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    s.terminate();
}
