//! The interleaved rounds (no-op, each scenario, no-op again, round after
//! round), so that every ratio to the no-op holds on a noisy machine.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::args::Args;
use super::baselines::{start_echo, FloorFile, Handoff, Journal};
use super::clients::{connect, Ctx};
use super::measure::{cpu_ticks, thread_delta, thread_ticks, DiskStat, Totals, Window};
use super::runner;
use super::scenarios::Scenario;

/// What the rounds run against, set up beforehand.
pub struct Setup {
    /// The stateseal server's address.
    pub addr: String,
    /// The scenarios besides the no-op, in order.
    pub scenarios: Vec<Scenario>,
    /// The process whose CPU is read (a server this bench started, or
    /// `--server-pid`).
    pub server_pid: Option<u32>,
    /// echo_fsync's journal, for the echo server.
    pub echo_journal: Option<Journal>,
    /// The fdatasync scenario's file.
    pub floor_file: Option<FloorFile>,
    /// The private redis-server's port.
    pub redis_port: Option<u16>,
    /// The block device counters (`DiskStat::file_of`) of the server's data
    /// directory, of Redis's, of the echo journal's and of the fdatasync
    /// scenario's file's.
    pub disk_file: Option<PathBuf>,
    pub redis_disk_file: Option<PathBuf>,
    pub journal_disk_file: Option<PathBuf>,
    pub floor_disk_file: Option<PathBuf>,
}

/// Connects to stateseal and the baselines, then runs the rounds: in each,
/// the no-op, every scenario, and the no-op again, each after its tokens
/// are made and its warm-up run, with what the server and the disk did
/// over each measured window. Returns each scenario's totals.
pub async fn run(args: &Args, setup: Setup) -> BTreeMap<Scenario, Totals> {
    let Setup {
        addr,
        scenarios,
        server_pid,
        mut echo_journal,
        floor_file,
        redis_port,
        disk_file,
        redis_disk_file,
        journal_disk_file,
        floor_disk_file,
    } = setup;
    let mut channels = Vec::new();
    for _ in 0..args.connections.max(1) {
        channels.push(connect(&addr, "stateseal", args.client_io).await);
    }
    let mut echo = Vec::new();
    if scenarios.contains(&Scenario::Echo) || echo_journal.is_some() {
        let echo_addr = start_echo(echo_journal.take()).await;
        for _ in 0..args.connections.max(1) {
            echo.push(connect(&echo_addr, "the echo server", args.client_io).await);
        }
    }
    let mut redis_cons = Vec::new();
    if let Some(port) = redis_port {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).expect("redis url");
        for _ in 0..args.connections.max(1) {
            redis_cons.push(
                client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect to redis-server"),
            );
        }
    }
    let ctx = Arc::new(Ctx {
        ttl: args.ttl,
        channels,
        echo,
        redis: redis_cons,
        state: vec![0x5a; args.state_size],
        floor: floor_file,
        handoff: scenarios
            .contains(&Scenario::Handoff)
            .then(|| Handoff::start().expect("start the handoff scenario's thread")),
        echo_token: "A".repeat(stateseal::internals::token::encoded_len(
            stateseal::internals::token::OVERHEAD + args.state_size,
        )),
    });
    let measure = Duration::from_secs_f64(args.duration);
    let warm = Duration::from_secs_f64(args.warmup);
    let mut totals: BTreeMap<Scenario, Totals> = BTreeMap::new();
    // Reusable tokens for `open`.
    let open_pool = Arc::new(ctx.preseal(1000, false, args.concurrency).await);
    for round in 0..args.rounds {
        for &sc in std::iter::once(&Scenario::Noop)
            .chain(scenarios.iter())
            .chain(
                // noop again after the scenarios, so every scenario sits
                // between two baseline runs.
                std::iter::once(&Scenario::Noop),
            )
        {
            let pool = sc.tokens(&ctx, args, &open_pool).await;
            if warm > Duration::ZERO {
                let _ = runner::run(&ctx, sc, args, warm, None, pool.clone(), false).await;
            }
            eprintln!("round {}/{}: {}", round + 1, args.rounds, sc.name());
            let window = match (sc, args.baseline_duration) {
                (Scenario::Noop, Some(b)) => Duration::from_secs_f64(b),
                _ => measure,
            };
            // The device of the store the scenario writes to: Redis's
            // own directory for `redis`, the echo journal's for
            // `echo_fsync`, the server's data directory for the rest.
            let disk_file = match sc {
                Scenario::Redis => redis_disk_file.as_deref(),
                Scenario::EchoFsync => journal_disk_file.as_deref(),
                Scenario::Fdatasync => floor_disk_file.as_deref(),
                _ => disk_file.as_deref(),
            };
            let disk_stat = || disk_file.and_then(DiskStat::read);
            let disk_before = disk_stat();
            let before = server_pid.and_then(cpu_ticks);
            let threads_before = server_pid.and_then(thread_ticks);
            let r = runner::run(&ctx, sc, args, window, args.requests, pool, true).await;
            let threads_after = server_pid.and_then(thread_ticks);
            let after = server_pid.and_then(cpu_ticks);
            let disk_after = disk_stat();
            let w = Window {
                ticks: before.zip(after).map(|(b, a)| a.saturating_sub(b)),
                threads: threads_before
                    .zip(threads_after)
                    .map(|(b, a)| thread_delta(&b, &a)),
                disk: disk_before
                    .zip(disk_after)
                    .map(|(b, a)| a.zip_with(b, u64::saturating_sub)),
            };
            totals.entry(sc).or_default().add(r, w);
        }
    }
    totals
}
