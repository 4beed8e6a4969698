//! The load generator: drives a running stateseal (or one it starts on a
//! temporary data dir) and compares every scenario with a no-op baseline
//! (`grpc.health.v1.Health/Check` on the same server) measured in the same
//! run, interleaved round by round so the ratio holds on a noisy machine.
//!
//!     cargo bench --bench load -- [--addr HOST:PORT]
//!         [--scenarios noop,echo,seal,seal_json,open,consume,flow,reserve,
//!                      reserve_carried,open_reserve,commit,echo_fsync,fdatasync,handoff,redis]
//!         [--client-io coalesced|vectored]
//!         [--concurrency 64] [--connections 4] [--duration 3] [--requests N]
//!         [--state-size 256] [--warmup 0.5] [--rounds 2] [--json FILE] [--plot FILE.svg]
//!         [--server-arg=--ledger --server-arg=postgres …]
//!         [--rate OPS_PER_S] [--samples FILE.csv [--sample-every 60]
//!          [--samples-plot FILE.svg] [--sample-database-url URL]]
//!
//! Soaks: a long `flow` run with a short `--ttl` churns the ledger at a
//! paced `--rate`; `--samples` writes, every `--sample-every` seconds, the
//! server's RSS, its data directory's size on disk, the ops done, and with
//! `--sample-database-url` the PostgreSQL ledger table's live rows and size
//! (`docs/performance.md`, "Soaks").
//!
//! Scenarios, one gRPC call per op unless said:
//! - noop: Health/Check — the baseline;
//! - seal: Seal of a reusable token;
//! - seal_json: the same with `params_json` (the service canonicalizes the
//!   params, RFC 8785, and digests them);
//! - open: Open of a reusable token sealed beforehand;
//! - consume: Open of a single-use token sealed beforehand (the durable path:
//!   the consumption is flushed to disk before the answer);
//! - flow: the MRTR round trip, Seal then Open of a single-use token (two
//!   calls per op; its ratio is per call);
//! - reserve: two-phase consumption of a single-use token sealed beforehand,
//!   Open with OPEN_MODE_RESERVE then Commit (two calls per op, each durable;
//!   its ratio is per call);
//! - open_reserve: the first call of reserve alone, Open with
//!   OPEN_MODE_RESERVE of a single-use token sealed beforehand (durable);
//! - commit: the second alone, Commit of a reservation made beforehand
//!   (durable; the reservations are made before the window, 64 at a time);
//! - echo: a Seal request of the seal scenario's size sent to a tonic server
//!   inside this binary, with the transport settings of stateseal's server
//!   (`TransportLimits::apply`), answering with a response of the token's
//!   size and doing nothing else: what HTTP/2 and protobuf cost for these
//!   sizes, so the report separates it from what stateseal adds;
//! - echo_fsync: consume's Open request sent to the same echo server, which
//!   answers with a response of an Open's size only after a group commit as
//!   the sled ledger's writer makes one (one thread fed by a channel; per
//!   round a 64-byte record per call written with one `pwrite` into a
//!   preallocated, zero-filled file, one `fdatasync`, the size change of a
//!   probe file, then every answer): the cheapest acknowledgement after its
//!   own `fdatasync` through the same stack, deciding nothing — what bounds
//!   consume on the machine and disk of the run;
//! - fdatasync: no call at all: a 64-byte `pwrite` into a preallocated,
//!   zero-filled file beside echo_fsync's journal, then `fdatasync`, in
//!   the bench's own process — what one durable write costs the disk, the
//!   floor a durable call at concurrency 1 is measured against;
//! - handoff: no call and no disk: a job sent to a thread of its own over
//!   a std channel and answered by a oneshot, the way every durable call
//!   reaches the sled ledger's writer and comes back — what the two thread
//!   wake-ups cost; paced with `--rate`, what they cost when both threads
//!   were idle (not in the default list; the smoke run adds it);
//! - redis: durable `SET key 1 NX EX 600` against a private `redis-server`
//!   started in a temporary directory with `appendonly yes` and
//!   `appendfsync always`, at the same concurrency over as many
//!   connections — what a user would otherwise get for durable single use
//!   (skipped, saying so, when `redis-server` is not installed).
//!
//! The code is in `benches/load/` (its `mod.rs` lists the parts).

#[path = "load/mod.rs"]
mod load;
#[path = "../tests/it/common/ports.rs"]
mod ports;
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use load::args::Args;
use load::baselines::{start_echo, start_redis, FloorFile, Journal};
use load::h2load::write_h2load_bodies;
use load::measure::DiskStat;
use load::rounds::Setup;
use load::runner::PROCESS_START;
use load::samples::{sampler, samples_svg};
use load::scenarios::{self, Scenario};
use load::server::{self, Server};
use load::{report, rounds};

/// The server's allocator (src/main.rs), so that the echo baseline is served
/// as stateseal serves.
#[global_allocator]
static ALLOCATOR: stateseal::Allocator = stateseal::Allocator;

fn main() {
    std::sync::LazyLock::force(&PROCESS_START);
    let mut args = Args::parse();
    if !args.bench {
        args.smoke();
    }
    // `--serve-echo` serves on the server's own runtime (without tokio's
    // LIFO slot), so that its no-op and echo are served as stateseal serves.
    // The client keeps tokio's default runtime, as in every earlier session:
    // a client without the slot writes its requests in fewer `sendto`s and
    // makes every call cheaper for the server as well (docs/performance.md,
    // "One write for many answers"), so switching it would move the
    // baseline rather than measure the server.
    let rt = if args.serve_echo {
        stateseal::internals::server::runtime()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
    }
    .expect("runtime");
    if args.serve_echo {
        rt.block_on(async {
            println!("addr={}", start_echo(None).await);
            std::future::pending::<()>().await
        });
    }
    let mut scenarios = scenarios::list(&args.scenarios);
    let redis_server = if scenarios.contains(&Scenario::Redis) {
        let r = start_redis();
        if r.is_none() {
            scenarios.retain(|s| *s != Scenario::Redis);
        }
        r
    } else {
        None
    };
    let redis_disk_file = redis_server
        .as_ref()
        .and_then(|r| DiskStat::file_of(r.dir.path()));
    let (server, addr, metrics_addr) = server::for_args(&args);
    eprintln!(
        "stateseal load: {addr}, concurrency {}, connections {}, state {} B, {} round(s) × {:.1}s per scenario",
        args.concurrency, args.connections, args.state_size, args.rounds, args.duration
    );
    if let Some(dir) = &args.h2load_bodies {
        rt.block_on(write_h2load_bodies(dir, &addr, args.state_size));
        return;
    }
    let server_pid = server.as_ref().map(|s| s.child.id()).or(args.server_pid);
    let disk_file = server
        .as_ref()
        .map(Server::data_dir)
        .or(args.server_data_dir.clone())
        .and_then(|d| DiskStat::file_of(&d));
    // echo_fsync's journal, on the file system of the server's data
    // directory where that is known (the system's temporary directory, as
    // for a server this bench starts, otherwise).
    let floor_file = scenarios.contains(&Scenario::Fdatasync).then(|| {
        FloorFile::create(args.server_data_dir.as_ref().and_then(|d| d.parent()))
            .expect("create the fdatasync scenario's file")
    });
    let floor_disk_file = floor_file
        .as_ref()
        .and_then(|f| DiskStat::file_of(f.dir.path()));
    let echo_journal = scenarios.contains(&Scenario::EchoFsync).then(|| {
        if args.echo_fsync_delay_us > 0 {
            eprintln!(
                "echo_fsync: a commit delay of {} µs before each round",
                args.echo_fsync_delay_us
            );
        }
        Journal::create(
            args.server_data_dir.as_ref().and_then(|d| d.parent()),
            std::time::Duration::from_micros(args.echo_fsync_delay_us),
        )
        .expect("create the echo_fsync journal")
    });
    let journal_disk_file = echo_journal
        .as_ref()
        .and_then(|j| DiskStat::file_of(j.dir.path()));
    let sampling = Arc::new(AtomicBool::new(false));
    let sampler_task = match (&args.samples, &server) {
        (Some(out), Some(srv)) => Some(rt.spawn(sampler(
            srv.child.id(),
            srv.data_dir(),
            args.sample_database_url.clone(),
            metrics_addr.clone(),
            Duration::from_secs_f64(args.sample_every.max(0.1)),
            out.clone(),
            sampling.clone(),
        ))),
        (Some(_), None) => {
            eprintln!("--samples needs a server this bench starts (not --addr)");
            None
        }
        _ => None,
    };
    let results = rt.block_on(rounds::run(
        &args,
        Setup {
            addr: addr.clone(),
            scenarios,
            server_pid,
            echo_journal,
            floor_file,
            redis_port: redis_server.as_ref().map(|r| r.port),
            disk_file,
            redis_disk_file,
            journal_disk_file,
            floor_disk_file,
        },
    ));
    if let Some(t) = sampler_task {
        sampling.store(true, Ordering::Relaxed);
        let rows = rt.block_on(t).expect("sampler");
        if let Some(p) = &args.samples_plot {
            std::fs::write(p, samples_svg(&rows)).expect("write --samples-plot");
            eprintln!("wrote {}", p.display());
        }
    }
    let rss = server.as_ref().and_then(|s| s.rss_kib("VmHWM:"));
    report::print(&results, &args, &addr, rss, server.is_some());
}
