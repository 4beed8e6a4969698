//! The command line (`cargo bench --bench load -- --help`).

use std::path::PathBuf;

use clap::Parser;

use super::clients::ClientIo;

#[derive(Parser, Debug, Clone)]
#[command(about = "stateseal load generator")]
pub struct Args {
    /// A running stateseal; without it, one is started on a temporary dir.
    #[arg(long)]
    pub addr: Option<String>,
    /// The process id of the `--addr` server, to report its CPU per call
    /// (a server this bench starts is measured without it).
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// The `--addr` server's data directory, to report the requests its
    /// block device served per call (a server this bench starts is
    /// measured without it).
    #[arg(long)]
    pub server_data_dir: Option<PathBuf>,
    /// Comma-separated scenarios (noop always runs as the baseline).
    #[arg(
        long,
        default_value = "echo,seal,seal_json,open,consume,flow,reserve,reserve_carried,open_reserve,commit,echo_fsync,fdatasync,redis"
    )]
    pub scenarios: String,
    /// Requests in flight.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// HTTP/2 connections the requests are spread over.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Seconds measured per scenario per round.
    #[arg(long, default_value_t = 3.0)]
    pub duration: f64,
    /// Seconds measured for the no-op baseline (default: --duration).
    #[arg(long)]
    pub baseline_duration: Option<f64>,
    /// Stop a scenario after this many ops instead (per round).
    #[arg(long)]
    pub requests: Option<u64>,
    /// Bytes of state per token.
    #[arg(long, default_value_t = 256)]
    pub state_size: usize,
    /// Seconds of unmeasured warm-up before each scenario.
    #[arg(long, default_value_t = 0.5)]
    pub warmup: f64,
    /// Rounds of (noop, scenario, noop, scenario …), interleaved.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// TTL in seconds of the tokens sealed (0 = the server default). With a
    /// short TTL and a long `flow` run, the ledger churns: a constant live
    /// set, records expiring and collected all the time.
    #[arg(long, default_value_t = 0)]
    pub ttl: u32,
    /// Write the figures as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw throughput (× noop) and latency percentiles per scenario as SVG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Pace every scenario at this many ops/s in total (0 = as fast as the
    /// callers go).
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Write a CSV sample of the server (RSS, data dir, ops) every
    /// --sample-every seconds while the scenarios run.
    #[arg(long)]
    pub samples: Option<PathBuf>,
    #[arg(long, default_value_t = 60.0)]
    pub sample_every: f64,
    /// Draw the samples as SVG curves.
    #[arg(long)]
    pub samples_plot: Option<PathBuf>,
    /// Also sample the PostgreSQL ledger table (live rows, total size).
    #[arg(long)]
    pub sample_database_url: Option<String>,
    /// Write gRPC-framed request bodies for h2load into this directory
    /// (noop, seal, seal_json, open: a reusable token sealed on the server)
    /// and exit; `benches/h2load.sh` uses them.
    #[arg(long)]
    pub h2load_bodies: Option<PathBuf>,
    /// Only serve the echo baseline (Seal and a health check) on 127.0.0.1,
    /// print `addr=…` and run until killed; `benches/h2load.sh` uses it.
    #[arg(long)]
    pub serve_echo: bool,
    /// Extra arguments for the server this bench starts.
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    pub server_args: Vec<String>,
    /// How the bench's tonic client writes: `coalesced` (as stateseal's
    /// server connections do: payloads under 1 KiB copied into h2's write
    /// buffer) or `vectored` (tonic's default: every payload of 256 B or
    /// more written with a `writev` of its own).
    #[arg(long, value_enum, default_value = "coalesced")]
    pub client_io: ClientIo,
    /// Microseconds echo_fsync's journal waits after a round's first call
    /// before it takes the others (a commit delay, as PostgreSQL's
    /// `commit_delay`): larger rounds, fewer `fdatasync`s, longer waits.
    /// The sled ledger has no such delay; 0 measures the floor of the
    /// round it makes.
    #[arg(long, default_value_t = 0)]
    pub echo_fsync_delay_us: u64,
    /// Passed by `cargo bench`. Without it (`cargo test --all-targets` runs
    /// bench binaries too), the generator does a short smoke run instead.
    #[arg(long, hide = true)]
    pub bench: bool,
}

impl Args {
    /// Under `cargo test` (no `--bench`): prove the generator and every
    /// scenario work, briefly. The figures of such a run mean nothing.
    pub fn smoke(&mut self) {
        eprintln!("stateseal load: smoke run (no --bench flag); use `cargo bench --bench load` to measure");
        self.duration = 0.2;
        self.warmup = 0.0;
        self.rounds = 1;
        self.requests = Some(200);
        // A scenario left out of the default list runs in the smoke too.
        if !self.scenarios.split(',').any(|s| s.trim() == "handoff") {
            self.scenarios.push_str(",handoff");
        }
    }
}
