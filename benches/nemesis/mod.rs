//! The nemesis: three `stateseal serve` replicas on one PostgreSQL (or one
//! replica on sled) under partitions, latency and loss, clock offsets,
//! pauses, kills and database restarts at once, with callers running the
//! MCP flow and every operation written to a history that [`checker`]
//! reads back. docs/testing.md ("The nemesis: combined faults") describes
//! the topology, the faults, the history format and the checker's rules.
//!
//! With `--store patroni` the three replicas share a replicated PostgreSQL
//! (three nodes under Patroni, synchronous unless `--async-replication`),
//! the faults include failovers, and the callers model the packages: a
//! handler that completes is recorded (`"op":"handler"`) and its Commit is
//! kept until it lands.
//!
//! Entry points: `cargo bench --bench nemesis -- --duration SECS --history
//! FILE [--seed N]` (benches/nemesis.rs) and `cargo test --test nemesis`
//! (tests/nemesis.rs, the short mode).
#![allow(dead_code, clippy::unwrap_used)]

pub mod checker;
mod clients;
mod cluster;
pub mod history;
mod net;
mod proxy;
mod schedule;
pub mod svg;

#[path = "../../tests/it/common/patroni.rs"]
mod patroni;
#[path = "../../tests/it/common/private_pg.rs"]
mod private_pg;
#[path = "../../tests/it/common/process.rs"]
mod process;
#[path = "../../tests/it/common/skew.rs"]
pub mod skew;
#[path = "../../tests/it/common/skip.rs"]
pub mod skip;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which ledger the replicas share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// Three replicas, each in its own network namespace, on one private
    /// PostgreSQL.
    Postgres,
    /// One replica on sled, its data directory on a tmpfs of its own.
    Sled,
    /// Three replicas on three PostgreSQL nodes under Patroni (a multi-host
    /// URL), with failovers among the faults.
    Patroni,
}

impl Store {
    pub fn parse(s: &str) -> Option<Store> {
        match s {
            "postgres" | "pg" => Some(Store::Postgres),
            "sled" => Some(Store::Sled),
            "patroni" => Some(Store::Patroni),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Store::Postgres => "postgres",
            Store::Sled => "sled",
            Store::Patroni => "patroni",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub duration: Duration,
    pub history: PathBuf,
    pub seed: u64,
    pub store: Store,
    /// Concurrent callers running the MCP flow.
    pub callers: usize,
    /// The run goes on past `duration` until it has this many operations
    /// and faults, up to `max_duration` (the short mode's floors).
    pub min_operations: u64,
    pub min_faults: usize,
    /// On patroni: the run goes on until this many failovers (a new leader
    /// after a fault), up to `max_duration`.
    pub min_failovers: usize,
    pub max_duration: Duration,
    /// On patroni: asynchronous replication (the negative control: the
    /// replicas then run without `--require-synchronous-replication`).
    pub asynchronous: bool,
}

impl Config {
    /// Exactly `duration`, no floors.
    pub fn timed(
        duration: Duration,
        history: PathBuf,
        seed: u64,
        store: Store,
        callers: usize,
    ) -> Config {
        Config {
            duration,
            history,
            seed,
            store,
            callers,
            min_operations: 0,
            min_faults: 0,
            min_failovers: 0,
            max_duration: duration,
            asynchronous: false,
        }
    }
}

/// When callers and the nemesis stop, and the faults injected so far.
#[derive(Default)]
pub struct Stop {
    flag: std::sync::atomic::AtomicBool,
    pub faults: std::sync::atomic::AtomicUsize,
    /// Faults after which another node led (patroni).
    pub failovers: std::sync::atomic::AtomicUsize,
}

impl Stop {
    pub fn now(&self) -> bool {
        self.flag.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// What a run did and what the checker found.
#[derive(Debug)]
pub struct Summary {
    pub verdict: checker::Verdict,
    pub faults_by_kind: std::collections::BTreeMap<String, usize>,
    /// On patroni: faults after which another node led.
    pub failovers: usize,
    pub replica_exits: usize,
    pub faults_file: PathBuf,
    /// How far the real-time clock moved against the history's monotonic
    /// one during the run, in seconds (the database's clock judges leases
    /// by real time; a step would void the lease windows).
    pub clock_drift: f64,
    /// Steps of the machine's real-time clock seen during the run (a
    /// virtual machine's time sync, say), each recorded as a `clock-host`
    /// fault window: the database's clock, and every replica's, stepped.
    pub host_clock_steps: usize,
}

impl Summary {
    /// Faults injected, all kinds.
    pub fn faults(&self) -> usize {
        self.faults_by_kind.values().sum()
    }
    /// The pinned last line.
    pub fn line(&self) -> String {
        format!(
            "nemesis: operations={} faults={} violations={} indeterminate={} resolved={}",
            self.verdict.operations,
            self.faults(),
            self.verdict.violations.len(),
            self.verdict.indeterminate,
            self.verdict.resolved
        )
    }
}

/// Why a run cannot happen on this machine (not root, no PostgreSQL server
/// binaries, no nftables), or `None` when it can.
pub fn unavailable(store: Store) -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("the nemesis needs root (network namespaces, nftables, tmpfs, initdb)".into());
    }
    if store == Store::Patroni {
        if let Some(why) = patroni::unavailable() {
            return Some(why);
        }
    }
    if store == Store::Postgres {
        if let Err(e) = private_pg::available() {
            return Some(e.into());
        }
        for tool in ["ip", "nft"] {
            if which(tool).is_none() {
                return Some(format!("no `{tool}` on PATH (Debian: iproute2, nftables)"));
            }
        }
    }
    if which("cc").is_none() {
        return Some("no C compiler (cc) for the clock shim".into());
    }
    None
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(tool))
        .chain(["/usr/sbin", "/sbin"].map(|d| std::path::Path::new(d).join(tool)))
        .find(|p| p.exists())
}

/// Runs a nemesis as configured, writes the history to `cfg.history` (and
/// the fault windows beside it, `HISTORY.faults`), checks it, and returns
/// the summary. Panics with the reason when the harness itself fails.
pub fn run(cfg: &Config) -> Summary {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run_async(cfg))
}

async fn run_async(cfg: &Config) -> Summary {
    net::remove_stale();
    let dir = tempfile::Builder::new()
        .prefix("stateseal-nemesis-")
        .tempdir()
        .unwrap();
    let hist = Arc::new(history::Writer::create(&cfg.history, history::Clock::new()));
    let faults_file = history::faults_path(&cfg.history);
    let faults = Arc::new(history::FaultLog::create(&faults_file, hist.clock()));
    let cluster = Arc::new(cluster::Cluster::start(cfg, dir.path()).await);
    eprintln!(
        "nemesis: {} replica(s) on {}, {} callers, {} s, seed {}",
        cluster.replicas.len(),
        cfg.store.name(),
        cfg.callers,
        cfg.duration.as_secs(),
        cfg.seed
    );
    let stop = Arc::new(Stop::default());
    let work = clients::Workload::new(cfg, &cluster, hist.clone()).await;
    let nemesis = tokio::spawn(schedule::run(
        cluster.clone(),
        faults.clone(),
        cfg.seed,
        stop.clone(),
    ));
    let callers = work
        .clone()
        .spawn_callers(cfg.callers, cfg.seed, stop.clone());
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let host_clock = tokio::spawn(watch_host_clock(
        hist.clock(),
        faults.clone(),
        watching.clone(),
    ));
    let started = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t = started.elapsed();
        let floors = hist.count() >= cfg.min_operations
            && stop.faults.load(std::sync::atomic::Ordering::Relaxed) >= cfg.min_faults
            && stop.failovers.load(std::sync::atomic::Ordering::Relaxed) >= cfg.min_failovers;
        if (t >= cfg.duration && floors) || t >= cfg.max_duration {
            stop.flag.store(true, std::sync::atomic::Ordering::Relaxed);
            break;
        }
    }
    for c in callers {
        c.await.unwrap();
    }
    let injected = nemesis.await.unwrap();
    // Recovery: every fault healed (the schedule waits for its heals), every
    // replica running; then the leases still held run out and every token
    // that was opened is replayed once more.
    cluster.recover().await;
    tokio::time::sleep(Duration::from_secs(u64::from(cluster::LEASE_S) + 1)).await;
    work.final_replay().await;
    let exits = cluster.exits();
    watching.store(false, std::sync::atomic::Ordering::Relaxed);
    let host_clock_steps = host_clock.await.unwrap();
    let clock_drift = history::Clock::new().now() - hist.now();
    cluster.shutdown().await;
    hist.finish();
    faults.finish();
    let verdict = checker::check_file(&cfg.history, cfg.store == Store::Sled).unwrap();
    Summary {
        verdict,
        faults_by_kind: injected,
        failovers: stop.failovers.load(std::sync::atomic::Ordering::Relaxed),
        replica_exits: exits,
        faults_file,
        clock_drift,
        host_clock_steps,
    }
}

/// A step of the real-time clock larger than this, between two looks
/// 100 ms apart, is recorded.
pub const HOST_STEP_S: f64 = 0.1;

/// Watches the machine's real-time clock against the history's monotonic
/// clock while `watching`, and records each step as a `clock-host` fault
/// window from the look before it to the look that saw it. The database
/// judges leases by that clock (and every replica its tokens' expiry), so
/// the checker treats these windows as clock steps on both stores. Returns
/// how many it recorded.
async fn watch_host_clock(
    clock: history::Clock,
    faults: Arc<history::FaultLog>,
    watching: Arc<std::sync::atomic::AtomicBool>,
) -> usize {
    let offset = || history::Clock::new().now() - clock.now();
    let (mut last, mut seen, mut steps) = (offset(), clock.now(), 0);
    while watching.load(std::sync::atomic::Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (now, o) = (clock.now(), offset());
        if (o - last).abs() > HOST_STEP_S {
            faults.record(&history::Fault {
                kind: "clock-host".into(),
                target: "host".into(),
                start: seen,
                end: now,
                detail: format!("real time moved {:+.3} s", o - last),
            });
            steps += 1;
        }
        (last, seen) = (o, now);
    }
    steps
}
