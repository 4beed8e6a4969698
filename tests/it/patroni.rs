//! Replicated PostgreSQL, the way operators run it (issue 57): three
//! PostgreSQL 15 nodes managed by Patroni with etcd (tests/patroni/), and
//! stateseal connected with a multi-host URL and
//! `target_session_attrs=read-write`.
//!
//! - Synchronous replication: through a `kill -9` of the primary, a planned
//!   switchover and the primary cut from its standbys and etcd (its clients
//!   still reach it), every answer is a consumption that holds or
//!   `LEDGER_UNAVAILABLE`; every consumption answered before or during the
//!   fault is `REPLAYED` after it, on the new primary; stateseal finds the
//!   new primary by itself. The time from each fault to the first durable
//!   Open is printed.
//! - Asynchronous replication: reported (WARN, `stateseal_ledger_replication`)
//!   and, with `--require-synchronous-replication`, refused.
//!
//! Needs root (cgroups, nftables), Patroni, etcd and PostgreSQL 15
//! (`.ci/run` installs them; `STATESEAL_PATRONI` names Patroni).
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::process::{http_get, metrics_addr, spawn, ServerProcess};
use crate::common::*;

use crate::common::patroni::{unavailable, Cluster, Timing, SCRIPT};

fn stateseal(url: &str, data: &std::path::Path, extra: &[&str]) -> ServerProcess {
    let mut args = vec![
        "--ledger",
        "postgres",
        "--database-url",
        url,
        "--db-timeout-ms",
        "2000",
        "--replication-check-interval-ms",
        "500",
        "--health-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    spawn(data, &args, &[])
}

/// Waits for `stateseal_ledger_replication{mode="…"} 1`.
fn wait_mode(p: &ServerProcess, mode: &str) {
    let want = format!("stateseal_ledger_replication{{mode=\"{mode}\"}} 1");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = http_get(metrics_addr(p), "/metrics");
        if m.contains(&want) {
            return;
        }
        assert!(Instant::now() < deadline, "never {want}: {m}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What one single-use Open answered.
enum Use {
    Consumed(String),
    Unavailable,
}

/// Seals a fresh single-use token and consumes it: consumed, or
/// `LEDGER_UNAVAILABLE` (fail closed). Anything else is a wrong answer.
async fn use_one(
    c: &mut stateseal::proto::request_state_client::RequestStateClient<tonic::transport::Channel>,
) -> Use {
    let t = seal_tokens(c, 1, true).await.remove(0);
    let mut open = open_req(&t);
    open.attempt_id = format!("a-{}", rand::random::<u64>());
    match c.open(open).await {
        Ok(_) => Use::Consumed(t),
        Err(e) => {
            assert_eq!(
                reason(&e),
                "LEDGER_UNAVAILABLE",
                "a fresh token refused: {e:?}"
            );
            Use::Unavailable
        }
    }
}

/// Consumes fresh tokens until `stop` says so, given how many landed; the
/// tokens consumed and how many uses were refused `LEDGER_UNAVAILABLE`.
async fn use_until(
    c: &mut stateseal::proto::request_state_client::RequestStateClient<tonic::transport::Channel>,
    deadline: Duration,
    mut stop: impl FnMut(usize) -> bool,
) -> Result<(Vec<String>, usize), String> {
    let end = Instant::now() + deadline;
    let (mut acked, mut refused) = (Vec::new(), 0);
    while !stop(acked.len()) {
        if Instant::now() >= end {
            return Err(format!(
                "no durable Open within {deadline:?} ({refused} refused)"
            ));
        }
        match use_one(c).await {
            Use::Consumed(t) => acked.push(t),
            Use::Unavailable => {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    Ok((acked, refused))
}

/// Fails with what the cluster and the replica say.
fn stuck(cluster: &Cluster, p: &ServerProcess, fault: &str, when: &str, e: &str) -> ! {
    let status = cluster.run(&["status"]);
    let log = p.log.lock().unwrap().clone();
    let tail = &log[log.len().saturating_sub(40)..];
    panic!(
        "{fault} ({when} the fault): {e}\ncluster: {status}\nstateseal:\n{}",
        tail.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_lose_no_acknowledged_consumption() {
    if let Some(why) = unavailable() {
        crate::common::skip::skipped("patroni-failover", &why);
        return;
    }
    let cluster = Cluster::up(false, Timing::default());
    let data = tempfile::tempdir().unwrap();
    let p = stateseal(
        &cluster.url(),
        data.path(),
        &["--require-synchronous-replication"],
    );
    wait_mode(&p, "synchronous");
    let mut c = connect(p.addr).await;
    let mut acked = Vec::new();
    let mut report = Vec::new();
    for fault in ["kill-primary", "switchover", "partition-primary"] {
        // A leader, two streaming standbys, a synchronous one in etcd (only
        // that one may be promoted): a failover can happen.
        cluster.run(&["wait-healthy"]);
        // Before: every use lands.
        let (before, refused) = use_until(&mut c, Duration::from_secs(60), |n| n >= 20)
            .await
            .unwrap_or_else(|e| stuck(&cluster, &p, fault, "before", &e));
        assert_eq!(refused, 0, "{fault}: refused before the fault");
        acked.extend(before);
        let leader = cluster.run(&["status"])["leader"].clone();
        let at = Instant::now();
        // A switchover returns once the new leader leads: run it beside
        // the uses, as the other faults are.
        let injected = {
            let dir = cluster.dir.path().display().to_string();
            std::thread::spawn(move || {
                Command::new("python3")
                    .args([SCRIPT, fault, dir.as_str()])
                    .output()
                    .unwrap()
            })
        };
        // Uses go on through the fault: each holds or is refused; then
        // the first durable Open on the new primary.
        let (during, refused) = use_until(&mut c, Duration::from_secs(150), |n| {
            // Done once a use landed after the leader changed.
            n > 0 && at.elapsed() > Duration::from_secs(1) && {
                let now = cluster.run(&["status"])["leader"].clone();
                now != leader && !now.is_null()
            }
        })
        .await
        .unwrap_or_else(|e| stuck(&cluster, &p, fault, "through", &e));
        let took = at.elapsed();
        let out = injected.join().unwrap();
        assert!(
            out.status.success(),
            "{fault}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        acked.extend(during);
        report.push(format!(
            "{fault}: {:.1} s to a durable Open on the new primary ({refused} refused meanwhile)",
            took.as_secs_f64()
        ));
        // Every consumption answered so far is REPLAYED on the new primary
        // (a refusal while the pool still finds the old one is fail-closed:
        // asked again).
        for t in &acked {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                match c.open(open_req(t)).await {
                    Ok(_) => {
                        panic!("{fault}: an acknowledged consumption was lost: it opened again")
                    }
                    Err(e) if reason(&e) == "LEDGER_UNAVAILABLE" && Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => {
                        assert_eq!(reason(&e), "REPLAYED", "{fault}: {e:?}");
                        break;
                    }
                }
            }
        }
        if fault != "switchover" {
            cluster.run(&["heal", "--wait"]);
        }
        wait_mode(&p, "synchronous");
    }
    println!(
        "patroni failovers ({} acknowledged consumptions, none lost):",
        acked.len()
    );
    for r in report {
        println!("  {r}");
    }
    p.terminate();
}

/// Asynchronous standbys are reported, and refused when synchronous
/// replication is required; on the same cluster, PgBouncer in transaction
/// pooling mode in front of the primary is refused at start with one line
/// that names it, with and without `ignore_startup_parameters = options`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_replication_and_pgbouncer_are_refused_in_clear_words() {
    if let Some(why) = unavailable() {
        crate::common::skip::skipped("patroni-asynchronous", &why);
        return;
    }
    let cluster = Cluster::up(true, Timing::default());
    let data = tempfile::tempdir().unwrap();
    let p = stateseal(&cluster.url(), &data.path().join("a"), &[]);
    wait_mode(&p, "asynchronous");
    let mut c = connect(p.addr).await;
    assert!(matches!(use_one(&mut c).await, Use::Consumed(_)));
    let (_, log) = p.terminate();
    assert!(
        log.iter()
            .any(|l| l.contains("WARN") && l.contains("replicates asynchronously")),
        "{log:?}"
    );
    let p = stateseal(
        &cluster.url(),
        &data.path().join("b"),
        &["--require-synchronous-replication"],
    );
    wait_mode(&p, "asynchronous");
    let mut c = connect(p.addr).await;
    assert!(matches!(use_one(&mut c).await, Use::Unavailable));
    p.terminate();

    for (ignore, want) in [
        ("", "refused stateseal's session options (unsupported startup parameter), as PgBouncer does"),
        ("options", "ignore the statement_timeout stateseal sets (a pooler that drops startup options, such as PgBouncer"),
    ] {
        let pgb = cluster.run(&["pgbouncer", "--pool-mode", "transaction", "--ignore-startup-parameters", ignore]);
        let url = pgb["url"].as_str().unwrap();
        crate::common::process::assert_refuses(
            &["--listen", "127.0.0.1:0", "--ledger", "postgres", "--database-url", url],
            &data.path().join("c"),
            want,
        );
    }
}
