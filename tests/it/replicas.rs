//! Several replicas on one PostgreSQL ledger, as processes on 127.0.0.1:
//! a cross-process race, fail-closed while the database is unreachable, and
//! the sled replica-count guard.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use crate::common::process::{command, spawn};
use crate::common::*;
use tokio::net::{TcpListener, TcpStream};
use tonic_health::pb::health_check_response::ServingStatus;

/// The shared database (held until the test ends), or a loud skip.
macro_rules! require_postgres {
    () => {
        match crate::common::pg::shared("postgresql-replica-tests").await {
            Some(pg) => pg,
            None => return,
        }
    };
}

/// Three stateseal processes on one database sharing a keyset made with
/// `keys init` in `dir`, and a client of each.
async fn three_replicas(
    url: &str,
    dir: &std::path::Path,
) -> (
    Vec<crate::common::process::ServerProcess>,
    Vec<stateseal::proto::request_state_client::RequestStateClient<tonic::transport::Channel>>,
) {
    let ks = dir.join("keyset.json");
    assert!(command()
        .args(["keys", "init"])
        .arg(&ks)
        .output()
        .unwrap()
        .status
        .success());
    let args = [
        "--ledger",
        "postgres",
        "--database-url",
        url,
        "--keyset",
        ks.to_str().unwrap(),
        "--expected-replicas",
        "3",
    ];
    let procs: Vec<_> = (0..3)
        .map(|i| spawn(&dir.join(format!("d{i}")), &args, &[]))
        .collect();
    let mut clients = Vec::new();
    for p in &procs {
        clients.push(connect(p.addr).await);
    }
    (procs, clients)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_one_database_each_token_accepted_exactly_once() {
    let pg = require_postgres!();
    let url = pg.url.clone();
    let tmp = tempfile::tempdir().unwrap();
    let (procs, mut clients) = three_replicas(&url, tmp.path()).await;
    const TOKENS: usize = 1000;
    const CALLERS: usize = 8;
    let mut tokens = Vec::with_capacity(TOKENS);
    for i in 0..TOKENS {
        let c = &mut clients[i % 3];
        tokens.push(
            c.seal(seal_req(b"race", true))
                .await
                .unwrap()
                .into_inner()
                .request_state,
        );
    }
    let started = Instant::now();
    let (mut ok, mut replayed, mut other) = (0usize, 0usize, Vec::new());
    for chunk in tokens.chunks(50) {
        let mut tasks = Vec::new();
        for t in chunk {
            for caller in 0..CALLERS {
                let mut c = clients[caller % 3].clone();
                let t = t.clone();
                tasks.push(tokio::spawn(async move { c.open(open_req(&t)).await }));
            }
        }
        let mut per_token_ok = vec![0; chunk.len()];
        for (i, task) in tasks.into_iter().enumerate() {
            match task.await.unwrap() {
                Ok(r) => {
                    assert!(r.into_inner().consumed);
                    ok += 1;
                    per_token_ok[i / CALLERS] += 1;
                }
                Err(e) if reason(&e) == "REPLAYED" => replayed += 1,
                Err(e) => other.push(reason(&e)),
            }
        }
        assert!(
            per_token_ok.iter().all(|&n| n == 1),
            "a token accepted {per_token_ok:?} times"
        );
    }
    let elapsed = started.elapsed();
    if !other.is_empty() {
        for p in &procs {
            let log = p.log.lock().unwrap();
            eprintln!(
                "--- server log ---\n{}",
                log.iter()
                    .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                    .take(5)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
        panic!(
            "{} unexpected: {:?}",
            other.len(),
            &other[..other.len().min(3)]
        );
    }
    assert_eq!(ok, TOKENS);
    assert_eq!(replayed, TOKENS * (CALLERS - 1));
    eprintln!(
        "race: {} opens over 3 processes in {:.2?}: {ok} accepted, {replayed} REPLAYED",
        TOKENS * CALLERS,
        elapsed
    );
    for p in procs {
        let (status, _) = p.terminate();
        assert!(status.success());
    }
}

/// A TCP relay to PostgreSQL that the test can cut and restore.
struct Relay {
    port: u16,
    up: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// A relay to 127.0.0.1:5432 on a port of its own, kept for its whole
    /// life (other tests bind ports at the same time: a port given back
    /// could be taken before the database comes back up).
    async fn start() -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (up, up_rx) = tokio::sync::watch::channel(true);
        let task = tokio::spawn(async move {
            // Dropping the set (when this task is aborted) aborts every relay.
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if !*up_rx.borrow() {
                    // The database is down: the connection closes at once.
                    continue;
                }
                let mut down = up_rx.clone();
                conns.spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect("127.0.0.1:5432").await {
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = down.wait_for(|up| !*up) => {}
                        }
                    }
                });
            }
        });
        Relay { port, up, task }
    }

    /// The database goes down: every relayed connection is cut, and new
    /// ones are closed as soon as they are accepted.
    fn cut(&self) {
        self.up.send_replace(false);
    }

    /// The database is back, on the same port.
    fn restore(&self) {
        self.up.send_replace(true);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn health(addr: std::net::SocketAddr) -> i32 {
    health_status(addr, "stateseal.v1.RequestState").await
}

async fn wait_health(addr: std::net::SocketAddr, want: ServingStatus) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while health(addr).await != want as i32 {
        assert!(Instant::now() < deadline, "health never became {want:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_down_fails_closed_and_recovers() {
    let pg = require_postgres!();
    let url = pg.url.clone();
    assert!(
        url.contains("127.0.0.1:5432"),
        "this test relays to 127.0.0.1:5432"
    );
    let relay = Relay::start().await;
    let relayed = url.replace("127.0.0.1:5432", &format!("127.0.0.1:{}", relay.port));
    let tmp = tempfile::tempdir().unwrap();
    let p = spawn(
        tmp.path(),
        &[
            "--ledger",
            "postgres",
            "--database-url",
            &relayed,
            "--db-timeout-ms",
            "500",
            "--db-pool-size",
            "2",
        ],
        &[],
    );
    let mut c = connect(p.addr).await;
    wait_health(p.addr, ServingStatus::Serving).await;

    let mut acknowledged = Vec::new();
    for _ in 0..20 {
        let t = consume_one(&mut c).await;
        acknowledged.push(t);
    }
    let pending: Vec<String> = {
        let mut v = Vec::new();
        for _ in 0..10 {
            v.push(
                c.seal(seal_req(b"y", true))
                    .await
                    .unwrap()
                    .into_inner()
                    .request_state,
            );
        }
        v
    };

    relay.cut();
    // While down: single-use opens fail closed, readiness drops, reusable
    // tokens (no ledger involved) still open, nothing is accepted twice.
    for t in pending.iter().chain(&acknowledged) {
        let err = c.open(open_req(t)).await.unwrap_err();
        assert_eq!(reason(&err), "LEDGER_UNAVAILABLE");
        assert_eq!(err.code(), tonic::Code::Unavailable);
    }
    wait_health(p.addr, ServingStatus::NotServing).await;
    let reusable = c
        .seal(seal_req(b"z", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    c.open(open_req(&reusable)).await.unwrap();

    // Back up on the same port: recovery without a restart.
    relay.restore();
    wait_health(p.addr, ServingStatus::Serving).await;
    for t in &acknowledged {
        assert_eq!(reason(&c.open(open_req(t)).await.unwrap_err()), "REPLAYED");
    }
    for t in &pending {
        // Never committed while down, so each opens exactly once now.
        assert!(c.open(open_req(t)).await.unwrap().into_inner().consumed);
        assert_eq!(reason(&c.open(open_req(t)).await.unwrap_err()), "REPLAYED");
    }
    let (status, log) = p.terminate();
    assert!(status.success());
    assert!(!log.join("\n").contains(&relayed), "database URL logged");
}

#[test]
fn sled_refuses_several_replicas() {
    let tmp = tempfile::tempdir().unwrap();
    let args = ["--listen", "127.0.0.1:0", "--expected-replicas", "2"];
    crate::common::process::assert_refuses(&args, tmp.path(), "--ledger postgres");
}

#[test]
fn postgres_ledger_needs_a_url() {
    let tmp = tempfile::tempdir().unwrap();
    let args = ["--listen", "127.0.0.1:0", "--ledger", "postgres"];
    crate::common::process::assert_refuses(&args, tmp.path(), "--database-url");
}

/// Three processes on one database racing reserves and commits: exactly one
/// commit per token; every other attempt gets IN_USE or REPLAYED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_race_reserves_and_commits() {
    use stateseal::proto::{CommitRequest, OpenMode, OpenRequest};
    let pg = require_postgres!();
    let url = pg.url.clone();
    let tmp = tempfile::tempdir().unwrap();
    let (procs, mut clients) = three_replicas(&url, tmp.path()).await;
    const TOKENS: usize = 200;
    const CALLERS: usize = 6;
    let mut tokens = Vec::new();
    for i in 0..TOKENS {
        tokens.push(
            clients[i % 3]
                .seal(seal_req(b"race", true))
                .await
                .unwrap()
                .into_inner()
                .request_state,
        );
    }
    let (mut commits, mut others) = (0usize, std::collections::BTreeMap::new());
    for chunk in tokens.chunks(25) {
        let mut tasks = Vec::new();
        for t in chunk {
            for caller in 0..CALLERS {
                let mut c = clients[caller % 3].clone();
                let mut committer = clients[(caller + 1) % 3].clone();
                let t = t.clone();
                tasks.push(tokio::spawn(async move {
                    let r = c
                        .open(OpenRequest {
                            mode: OpenMode::Reserve as i32,
                            ..open_req(&t)
                        })
                        .await
                        .map_err(|e| reason(&e))?
                        .into_inner();
                    // Committed through another process than the reserving one.
                    committer
                        .commit(CommitRequest {
                            reservation: r.reservation,
                        })
                        .await
                        .map(|_| ())
                        .map_err(|e| reason(&e))
                }));
            }
        }
        let mut per_token = vec![0; chunk.len()];
        for (i, task) in tasks.into_iter().enumerate() {
            match task.await.unwrap() {
                Ok(()) => {
                    commits += 1;
                    per_token[i / CALLERS] += 1;
                }
                Err(r) => *others.entry(r).or_insert(0usize) += 1,
            }
        }
        assert!(
            per_token.iter().all(|&n| n == 1),
            "commits per token: {per_token:?}"
        );
    }
    assert_eq!(commits, TOKENS);
    for r in others.keys() {
        assert!(r == "IN_USE" || r == "REPLAYED", "{others:?}");
    }
    eprintln!("reserve/commit race: {commits} commits, others {others:?}");
    for p in procs {
        p.terminate();
    }
}

/// `sslmode=disable` starts (a private network may want it) but says at
/// start, as `prefer` does, what it gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_disable_warns_at_start() {
    let pg = require_postgres!();
    let url = pg.url.clone();
    let sep = if url.contains('?') { '&' } else { '?' };
    let tmp = tempfile::tempdir().unwrap();
    for (mode, want) in [
        ("disable", "is not encrypted"),
        ("prefer", "certificate is not verified"),
    ] {
        let url = format!("{url}{sep}sslmode={mode}");
        let p = spawn(
            &tmp.path().join(mode),
            &["--ledger", "postgres", "--database-url", &url],
            &[],
        );
        let (_, log) = p.terminate();
        assert!(
            log.iter().any(|l| l.contains("WARN") && l.contains(want)),
            "sslmode={mode}: no warning in {log:?}"
        );
        assert!(
            !log.iter().any(|l| l.contains(&url)),
            "the URL is never logged"
        );
    }
}

/// Issue 57, item 4: stateseal reads how the primary replicates, at start
/// and then periodically, and shows it (`stateseal_ledger_replication`).
/// The test database has no standby: standalone, served; with
/// `--require-synchronous-replication` the replica is NOT_SERVING and
/// refuses consumptions `LEDGER_UNAVAILABLE` (and says why, once).
/// Asynchronous and synchronous standbys are checked on the Patroni
/// cluster (tests/patroni.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replication_mode_is_checked_and_can_be_required() {
    let pg = require_postgres!();
    let tmp = tempfile::tempdir().unwrap();
    let base = [
        "--ledger",
        "postgres",
        "--database-url",
        pg.url.as_str(),
        "--health-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--replication-check-interval-ms",
        "200",
    ];
    let p = spawn(&tmp.path().join("plain"), &base, &[]);
    let metrics =
        crate::common::process::http_get(crate::common::process::metrics_addr(&p), "/metrics");
    assert!(
        metrics.contains("stateseal_ledger_replication{mode=\"standalone\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("stateseal_ledger_replication{mode=\"asynchronous\"} 0"));
    wait_health(
        crate::common::process::health_addr(&p),
        ServingStatus::Serving,
    )
    .await;
    consume_one(&mut connect(p.addr).await).await;
    p.terminate();

    let mut args = base.to_vec();
    args.push("--require-synchronous-replication");
    let p = spawn(&tmp.path().join("required"), &args, &[]);
    wait_health(
        crate::common::process::health_addr(&p),
        ServingStatus::NotServing,
    )
    .await;
    let mut c = connect(p.addr).await;
    let t = seal_tokens(&mut c, 1, true).await.remove(0);
    let e = c.open(open_req(&t)).await.unwrap_err();
    assert_eq!(reason(&e), "LEDGER_UNAVAILABLE");
    let (_, log) = p.terminate();
    assert_eq!(
        log.iter()
            .filter(|l| l.contains("no standby, and synchronous replication is required"))
            .count(),
        1,
        "{log:?}"
    );
}
