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
//!         [--state-size 256] [--warmup 1] [--rounds 2] [--json FILE] [--plot FILE.svg]
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

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use stateseal::proto::request_state_client::RequestStateClient;
use stateseal::proto::{binding::Params, Binding, OpenRequest, SealRequest};
use tonic::transport::{Channel, Endpoint};

#[path = "../tests/it/common/ports.rs"]
mod ports;

mod support;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

#[derive(Parser, Debug, Clone)]
#[command(about = "stateseal load generator")]
struct Args {
    /// A running stateseal; without it, one is started on a temporary dir.
    #[arg(long)]
    addr: Option<String>,
    /// The process id of the `--addr` server, to report its CPU per call
    /// (a server this bench starts is measured without it).
    #[arg(long)]
    server_pid: Option<u32>,
    /// The `--addr` server's data directory, to report the requests its
    /// block device served per call (a server this bench starts is
    /// measured without it).
    #[arg(long)]
    server_data_dir: Option<PathBuf>,
    /// Comma-separated scenarios (noop always runs as the baseline).
    #[arg(
        long,
        default_value = "echo,seal,seal_json,open,consume,flow,reserve,reserve_carried,open_reserve,commit,echo_fsync,fdatasync,redis"
    )]
    scenarios: String,
    /// Requests in flight.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// HTTP/2 connections the requests are spread over.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Seconds measured per scenario per round.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// Seconds measured for the no-op baseline (default: --duration).
    #[arg(long)]
    baseline_duration: Option<f64>,
    /// Stop a scenario after this many ops instead (per round).
    #[arg(long)]
    requests: Option<u64>,
    /// Bytes of state per token.
    #[arg(long, default_value_t = 256)]
    state_size: usize,
    /// Seconds of unmeasured warm-up before each scenario.
    #[arg(long, default_value_t = 0.5)]
    warmup: f64,
    /// Rounds of (noop, scenario, noop, scenario …), interleaved.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// TTL in seconds of the tokens sealed (0 = the server default). With a
    /// short TTL and a long `flow` run, the ledger churns: a constant live
    /// set, records expiring and collected all the time.
    #[arg(long, default_value_t = 0)]
    ttl: u32,
    /// Write the figures as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw throughput (× noop) and latency percentiles per scenario as SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Pace every scenario at this many ops/s in total (0 = as fast as the
    /// callers go).
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Write a CSV sample of the server (RSS, data dir, ops) every
    /// --sample-every seconds while the scenarios run.
    #[arg(long)]
    samples: Option<PathBuf>,
    #[arg(long, default_value_t = 60.0)]
    sample_every: f64,
    /// Draw the samples as SVG curves.
    #[arg(long)]
    samples_plot: Option<PathBuf>,
    /// Also sample the PostgreSQL ledger table (live rows, total size).
    #[arg(long)]
    sample_database_url: Option<String>,
    /// Write gRPC-framed request bodies for h2load into this directory
    /// (noop, seal, seal_json, open: a reusable token sealed on the server)
    /// and exit; `benches/h2load.sh` uses them.
    #[arg(long)]
    h2load_bodies: Option<PathBuf>,
    /// Only serve the echo baseline (Seal and a health check) on 127.0.0.1,
    /// print `addr=…` and run until killed; `benches/h2load.sh` uses it.
    #[arg(long)]
    serve_echo: bool,
    /// Extra arguments for the server this bench starts.
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// How the bench's tonic client writes: `coalesced` (as stateseal's
    /// server connections do: payloads under 1 KiB copied into h2's write
    /// buffer) or `vectored` (tonic's default: every payload of 256 B or
    /// more written with a `writev` of its own).
    #[arg(long, value_enum, default_value = "coalesced")]
    client_io: ClientIo,
    /// Microseconds echo_fsync's journal waits after a round's first call
    /// before it takes the others (a commit delay, as PostgreSQL's
    /// `commit_delay`): larger rounds, fewer `fdatasync`s, longer waits.
    /// The sled ledger has no such delay; 0 measures the floor of the
    /// round it makes.
    #[arg(long, default_value_t = 0)]
    echo_fsync_delay_us: u64,
    /// Passed by `cargo bench`. Without it (`cargo test --all-targets` runs
    /// bench binaries too), the generator does a short smoke run instead.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Scenario {
    Noop,
    Echo,
    Seal,
    SealJson,
    Open,
    Consume,
    Flow,
    Reserve,
    ReserveCarried,
    OpenReserve,
    Commit,
    EchoFsync,
    Fdatasync,
    Handoff,
    Redis,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Noop => "noop",
            Scenario::Seal => "seal",
            Scenario::SealJson => "seal_json",
            Scenario::Open => "open",
            Scenario::Consume => "consume",
            Scenario::Flow => "flow",
            Scenario::Reserve => "reserve",
            Scenario::ReserveCarried => "reserve_carried",
            Scenario::OpenReserve => "open_reserve",
            Scenario::Commit => "commit",
            Scenario::Fdatasync => "fdatasync",
            Scenario::Handoff => "handoff",
            Scenario::Echo => "echo",
            Scenario::EchoFsync => "echo_fsync",
            Scenario::Redis => "redis",
        }
    }
    /// Whether the calls go to stateseal (echo, echo_fsync and redis go to
    /// servers of their own, so stateseal's CPU says nothing about them).
    fn on_stateseal(self) -> bool {
        !matches!(
            self,
            Scenario::Echo
                | Scenario::EchoFsync
                | Scenario::Fdatasync
                | Scenario::Handoff
                | Scenario::Redis
        )
    }
    /// Whether every answer waits for an `fdatasync` of its own store.
    fn durable(self) -> bool {
        matches!(
            self,
            Scenario::Consume
                | Scenario::Flow
                | Scenario::Reserve
                | Scenario::ReserveCarried
                | Scenario::OpenReserve
                | Scenario::Commit
                | Scenario::EchoFsync
                | Scenario::Fdatasync
                | Scenario::Redis
        )
    }
    fn calls_per_op(self) -> f64 {
        if matches!(self, Scenario::Flow | Scenario::Reserve) {
            2.0
        } else {
            1.0
        }
    }
    fn parse(s: &str) -> Option<Self> {
        Some(match s.trim() {
            "noop" => Scenario::Noop,
            "seal" => Scenario::Seal,
            "seal_json" => Scenario::SealJson,
            "open" => Scenario::Open,
            "consume" => Scenario::Consume,
            "flow" => Scenario::Flow,
            "reserve" => Scenario::Reserve,
            "reserve_carried" => Scenario::ReserveCarried,
            "open_reserve" => Scenario::OpenReserve,
            "commit" => Scenario::Commit,
            "fdatasync" => Scenario::Fdatasync,
            "handoff" => Scenario::Handoff,
            "echo" => Scenario::Echo,
            "echo_fsync" => Scenario::EchoFsync,
            "redis" => Scenario::Redis,
            _ => return None,
        })
    }
}

#[derive(Default)]
struct Totals {
    ops: u64,
    secs: f64,
    hist: Option<Histogram<u64>>,
    errors: BTreeMap<String, u64>,
    /// The server's CPU (user + system, clock ticks) over the measured
    /// windows, when its process is known.
    server_ticks: Option<u64>,
    /// The same by thread group (see `ThreadGroup`), for the threads that
    /// lived through a whole window.
    server_threads: Option<BTreeMap<String, ThreadGroup>>,
    /// The requests the data directory's block device served over the
    /// measured windows, when its counters are readable.
    disk: Option<DiskStat>,
}

/// What the server was seen doing over one measured window.
struct Window {
    ticks: Option<u64>,
    threads: Option<BTreeMap<String, ThreadGroup>>,
    disk: Option<DiskStat>,
}

/// A block device's request counters (`/sys/dev/block/MAJ:MIN/stat`, the
/// kernel's Documentation/block/stat.rst): write requests, 512-byte sectors
/// written, and cache flushes. They count every process's requests to the
/// device, not only the server's.
#[derive(Clone, Copy, Debug)]
struct DiskStat {
    writes: u64,
    write_sectors: u64,
    flushes: u64,
}

impl DiskStat {
    /// The counters file of the block device that holds `dir`; `None`
    /// where it has none (tmpfs, overlay on a non-block device).
    fn file_of(dir: &std::path::Path) -> Option<PathBuf> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(dir).ok()?.dev();
        let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
        let file = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
        file.exists().then_some(file)
    }

    /// The counters now; `None` if unreadable or the kernel does not count
    /// flushes (before Linux 5.5).
    fn read(file: &std::path::Path) -> Option<Self> {
        let f: Vec<u64> = std::fs::read_to_string(file)
            .ok()?
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        Some(DiskStat {
            writes: *f.get(4)?,
            write_sectors: *f.get(6)?,
            flushes: *f.get(15)?,
        })
    }

    /// Each counter of `self` and `other` combined by `f`.
    fn zip_with(self, other: Self, f: impl Fn(u64, u64) -> u64) -> Self {
        DiskStat {
            writes: f(self.writes, other.writes),
            write_sectors: f(self.write_sectors, other.write_sectors),
            flushes: f(self.flushes, other.flushes),
        }
    }
}

/// The CPU of the threads of one name (a trailing number dropped, so sled's
/// `sled-io-0` … `sled-io-6` are one group) over the measured windows.
#[derive(Clone, Copy, Default)]
struct ThreadGroup {
    ticks: u64,
    /// Threads in the group (the most seen in one window).
    threads: usize,
}

impl Totals {
    fn add(&mut self, r: RunResult, w: Window) {
        let first = self.hist.is_none();
        self.server_ticks = known_in_every(first, self.server_ticks, w.ticks, |a, b| a + b);
        self.disk = known_in_every(first, self.disk, w.disk, |a, b| a.zip_with(b, |x, y| x + y));
        self.server_threads =
            known_in_every(first, self.server_threads.take(), w.threads, |mut a, b| {
                for (name, g) in b {
                    let e = a.entry(name).or_default();
                    e.ticks += g.ticks;
                    e.threads = e.threads.max(g.threads);
                }
                a
            });
        self.ops += r.ops;
        self.secs += r.secs;
        match &mut self.hist {
            Some(h) => h.add(&r.hist).expect("same histogram bounds"),
            None => self.hist = Some(r.hist),
        }
        for (k, v) in r.errors {
            *self.errors.entry(k).or_default() += v;
        }
    }
    fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.ops as f64 / self.secs
        } else {
            0.0
        }
    }
    /// Calls per second (each op of `sc` makes `calls_per_op` calls).
    fn call_rate(&self, sc: Scenario) -> f64 {
        self.rate() * sc.calls_per_op()
    }
    /// Calls per second against a baseline's (0 without a baseline).
    fn calls_against(&self, sc: Scenario, base: f64) -> f64 {
        if base > 0.0 {
            self.call_rate(sc) / base
        } else {
            0.0
        }
    }
    /// The server's CPU µs per call (not per op: a flow op is two calls).
    fn server_us_per_call(&self, calls_per_op: f64) -> Option<f64> {
        self.us_per_call(self.server_ticks?, calls_per_op)
    }
    /// The same by thread group, largest first.
    fn server_threads_us_per_call(&self, calls_per_op: f64) -> Vec<(String, usize, f64)> {
        let mut v: Vec<_> = self
            .server_threads
            .iter()
            .flatten()
            .filter_map(|(name, g)| {
                let us = self.us_per_call(g.ticks, calls_per_op)?;
                Some((name.clone(), g.threads, us))
            })
            .collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        v
    }
    /// The data directory's device: write requests, cache flushes and KiB
    /// written per call.
    fn disk_per_call(&self, calls_per_op: f64) -> Option<(f64, f64, f64)> {
        let d = self.disk?;
        let calls = self.ops as f64 * calls_per_op;
        (calls > 0.0).then(|| {
            (
                d.writes as f64 / calls,
                d.flushes as f64 / calls,
                d.write_sectors as f64 / 2.0 / calls,
            )
        })
    }
    fn us_per_call(&self, ticks: u64, calls_per_op: f64) -> Option<f64> {
        let calls = self.ops as f64 * calls_per_op;
        let hz = rustix::param::clock_ticks_per_second() as f64;
        (calls > 0.0 && hz > 0.0).then(|| ticks as f64 / hz * 1e6 / calls)
    }
}

/// A figure summed over the measured windows, known only if it was known
/// for every one of them (`first`: this is the first window).
fn known_in_every<T>(
    first: bool,
    sum: Option<T>,
    window: Option<T>,
    add: impl FnOnce(T, T) -> T,
) -> Option<T> {
    match (first, sum, window) {
        (true, _, w) => w,
        (false, Some(s), Some(w)) => Some(add(s, w)),
        _ => None,
    }
}

/// The command name and the CPU so far, user + system in clock ticks, from
/// a `/proc/…/stat` file (a process's, every thread of it; or one thread's).
fn stat_ticks(path: &str) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(path).ok()?;
    // The command name may hold spaces and parentheses; the fields after
    // its last `)` do not.
    let name = stat.get(stat.find('(')? + 1..stat.rfind(')')?)?.to_owned();
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((name, utime + stime))
}

/// A process's CPU so far, user + system, in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    stat_ticks(&format!("/proc/{pid}/stat")).map(|(_, t)| t)
}

/// Each thread's name and CPU so far, by thread id.
type ThreadTicks = BTreeMap<u32, (String, u64)>;

fn thread_ticks(pid: u32) -> Option<ThreadTicks> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let Some(tid) = entry
            .ok()
            .and_then(|e| e.file_name().to_str()?.parse().ok())
        else {
            continue;
        };
        // A thread that ended since the listing has no stat: skipped.
        if let Some(t) = stat_ticks(&format!("/proc/{pid}/task/{tid}/stat")) {
            out.insert(tid, t);
        }
    }
    Some(out)
}

/// What each thread group spent between two snapshots, counting the
/// threads present in both.
fn thread_delta(before: &ThreadTicks, after: &ThreadTicks) -> BTreeMap<String, ThreadGroup> {
    let mut groups: BTreeMap<String, ThreadGroup> = BTreeMap::new();
    for (tid, (name, t)) in after {
        let Some((_, b)) = before.get(tid) else {
            continue;
        };
        let group = name.trim_end_matches(|c: char| c.is_ascii_digit());
        let group = group.strip_suffix('-').unwrap_or(group);
        let g = groups.entry(group.to_owned()).or_default();
        g.ticks += t.saturating_sub(*b);
        g.threads += 1;
    }
    groups
}

struct RunResult {
    ops: u64,
    secs: f64,
    hist: Histogram<u64>,
    errors: BTreeMap<String, u64>,
}

struct Server {
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Server {
    fn data_dir(&self) -> PathBuf {
        self._dir.path().to_path_buf()
    }

    fn rss_kib(&self, field: &str) -> Option<u64> {
        support::status_kib(&self.child.id().to_string(), field)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(extra: &[String]) -> (Server, String) {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_stateseal"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .args(extra)
        .env("STATESEAL_LOG", "warn,stateseal::app::server=info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start stateseal");
    let stderr = child.stderr.take().expect("stderr");
    // Read on a thread of its own, so that a server that never reports its
    // address ends the bench with an error instead of hanging it; then keep
    // draining stderr so the server never blocks on it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(a) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("addr="))
            {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(a.to_string());
                }
            }
        }
    });
    // Owned first: a panic below kills the server on the way out.
    let server = Server { child, _dir: dir };
    let addr = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("stateseal exited, or logged no `addr=` line within 60 s");
    (server, addr)
}

/// The echo baseline: the RequestState service answering Seal with a
/// response of the size stateseal's would have, doing nothing else; and,
/// with a journal, Open with a response of an Open's size after the
/// journal's group commit (`echo_fsync`).
struct Echo {
    journal: Option<Journal>,
}

#[tonic::async_trait]
impl stateseal::proto::request_state_server::RequestState for Echo {
    async fn seal(
        &self,
        req: tonic::Request<SealRequest>,
    ) -> Result<tonic::Response<stateseal::proto::SealResponse>, tonic::Status> {
        let n = stateseal::internals::token::encoded_len(
            stateseal::internals::token::OVERHEAD + req.get_ref().state.len(),
        );
        Ok(tonic::Response::new(stateseal::proto::SealResponse {
            request_state: "A".repeat(n),
            expires_at_unix: 1_900_000_600,
            key_id: "1".into(),
        }))
    }
    async fn open(
        &self,
        req: tonic::Request<OpenRequest>,
    ) -> Result<tonic::Response<stateseal::proto::OpenResponse>, tonic::Status> {
        let journal = self
            .journal
            .as_ref()
            .ok_or_else(|| tonic::Status::unimplemented("echo without a journal"))?;
        let token = req.into_inner().request_state;
        // A record as the ledger's: 64 bytes from the token.
        let mut record = [0u8; Journal::RECORD];
        let n = token.len().min(record.len());
        record[..n].copy_from_slice(&token.as_bytes()[..n]);
        journal.append(record).await?;
        // The state an Open of this token would return.
        let state = (token.len() * 3 / 4).saturating_sub(stateseal::internals::token::OVERHEAD);
        Ok(tonic::Response::new(stateseal::proto::OpenResponse {
            state: vec![0x5a; state],
            expires_at_unix: 1_900_000_600,
            key_id: "1".into(),
            consumed: true,
            ..Default::default()
        }))
    }
    async fn commit(
        &self,
        _: tonic::Request<stateseal::proto::CommitRequest>,
    ) -> Result<tonic::Response<stateseal::proto::CommitResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("echo"))
    }
    async fn release(
        &self,
        _: tonic::Request<stateseal::proto::ReleaseRequest>,
    ) -> Result<tonic::Response<stateseal::proto::ReleaseResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("echo"))
    }
    async fn renew(
        &self,
        _: tonic::Request<stateseal::proto::RenewRequest>,
    ) -> Result<tonic::Response<stateseal::proto::RenewResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("echo"))
    }
}

type JournalJob = (
    [u8; Journal::RECORD],
    tokio::sync::oneshot::Sender<Result<(), String>>,
);

/// `echo_fsync`'s store: a group commit shaped as the sled ledger's writer
/// (one thread fed by a std channel, answers by oneshot; a round takes
/// every call waiting), whose round is the least a durable acknowledgement
/// needs: one `pwrite` of a 64-byte record per call into a preallocated,
/// zero-filled file (so `fdatasync` has no size to commit), one
/// `fdatasync`, and the ledger's probe (the size change of a second file)
/// before the answers. It decides nothing and keeps no index. Stops for
/// good at the first failure, as the ledger does. With a commit delay
/// (`--echo-fsync-delay-us`) it waits that long after a round's first call
/// before it takes the rest.
struct Journal {
    tx: std::sync::mpsc::Sender<JournalJob>,
    /// Removed with the journal.
    dir: tempfile::TempDir,
}

impl Journal {
    const RECORD: usize = 64;
    /// Written round after round from the start again: 64 Ki records.
    const SIZE: u64 = 4 << 20;

    /// A journal in a new temporary directory under `parent` (the system's
    /// temporary directory without one).
    fn create(
        parent: Option<&std::path::Path>,
        delay: std::time::Duration,
    ) -> std::io::Result<Self> {
        let (dir, file) = preallocated(parent, "journal")?;
        let probe = std::fs::File::create(dir.path().join("probe"))?;
        probe.sync_all()?;
        std::fs::File::open(dir.path())?.sync_all()?;
        let (tx, rx) = std::sync::mpsc::channel::<JournalJob>();
        std::thread::Builder::new()
            .name("echo-journal".into())
            .spawn(move || Self::run(&file, &probe, &rx, delay))?;
        Ok(Journal { tx, dir })
    }

    fn run(
        file: &std::fs::File,
        probe: &std::fs::File,
        rx: &std::sync::mpsc::Receiver<JournalJob>,
        delay: std::time::Duration,
    ) {
        use std::os::unix::fs::FileExt;
        let (mut at, mut probe_len, mut dead) = (0u64, 0u64, None::<String>);
        let mut buf = Vec::new();
        while let Ok(first) = rx.recv() {
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            let mut jobs = vec![first];
            jobs.extend(rx.try_iter());
            let result = match &dead {
                Some(e) => Err(e.clone()),
                None => {
                    buf.clear();
                    for (record, _) in &jobs {
                        buf.extend_from_slice(record);
                    }
                    if at + buf.len() as u64 > Self::SIZE {
                        at = 0;
                    }
                    let r = file
                        .write_all_at(&buf, at)
                        .and_then(|()| file.sync_data())
                        .and_then(|()| {
                            probe_len ^= 1;
                            probe.set_len(probe_len)
                        })
                        .map_err(|e| format!("echo journal: {e}"));
                    at += buf.len() as u64;
                    if let Err(e) = &r {
                        dead = Some(e.clone());
                    }
                    r
                }
            };
            for (_, reply) in jobs {
                let _ = reply.send(result.clone());
            }
        }
    }

    /// Returns once the record is on disk.
    async fn append(&self, record: [u8; Self::RECORD]) -> Result<(), tonic::Status> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.tx
            .send((record, reply))
            .map_err(|_| tonic::Status::unavailable("echo journal stopped"))?;
        answer
            .await
            .map_err(|_| tonic::Status::unavailable("echo journal stopped"))?
            .map_err(tonic::Status::unavailable)
    }
}

/// A new temporary directory under `parent` (the system's temporary
/// directory without one) holding `name`: `Journal::SIZE` zero bytes,
/// synced (the directory is not).
fn preallocated(
    parent: Option<&std::path::Path>,
    name: &str,
) -> std::io::Result<(tempfile::TempDir, std::fs::File)> {
    use std::io::Write;
    let dir = match parent {
        Some(p) => tempfile::tempdir_in(p)?,
        None => tempfile::tempdir()?,
    };
    let mut file = std::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(dir.path().join(name))?;
    file.write_all(&vec![0u8; Journal::SIZE as usize])?;
    file.sync_all()?;
    Ok((dir, file))
}

/// The fdatasync scenario's file: preallocated and zero-filled as the echo
/// journal's, so that `fdatasync` has no size to commit, written at the
/// next 64-byte slot each time.
struct FloorFile {
    file: std::fs::File,
    at: std::sync::Mutex<u64>,
    /// Removed with the file.
    dir: tempfile::TempDir,
}

impl FloorFile {
    fn create(parent: Option<&std::path::Path>) -> std::io::Result<Self> {
        let (dir, file) = preallocated(parent, "floor")?;
        std::fs::File::open(dir.path())?.sync_all()?;
        Ok(FloorFile {
            file,
            at: std::sync::Mutex::new(0),
            dir,
        })
    }

    fn write(&self) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut at = self.at.lock().expect("floor offset");
        if *at + Journal::RECORD as u64 > Journal::SIZE {
            *at = 0;
        }
        self.file.write_all_at(&[0x5a; Journal::RECORD], *at)?;
        *at += Journal::RECORD as u64;
        self.file.sync_data()
    }
}

/// The handoff scenario's thread: fed by a std channel and answering by
/// oneshot, as the sled ledger's writer is, and doing nothing else.
struct Handoff {
    tx: std::sync::mpsc::Sender<tokio::sync::oneshot::Sender<()>>,
}

impl Handoff {
    fn start() -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<tokio::sync::oneshot::Sender<()>>();
        std::thread::Builder::new()
            .name("handoff".into())
            .spawn(move || {
                for reply in rx {
                    let _ = reply.send(());
                }
            })?;
        Ok(Handoff { tx })
    }

    /// Returns once the thread has answered.
    async fn call(&self) -> Result<(), tonic::Status> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.tx
            .send(reply)
            .map_err(|_| tonic::Status::unavailable("handoff thread stopped"))?;
        answer
            .await
            .map_err(|_| tonic::Status::unavailable("handoff thread stopped"))
    }
}

/// Starts the echo server on 127.0.0.1 with stateseal's transport settings
/// (with `journal`, it answers Open too: `echo_fsync`).
async fn start_echo(journal: Option<Journal>) -> String {
    // stateseal's own listener: the same connection limits, TCP_NODELAY
    // and write coalescing as the server it is the baseline for.
    let lim = stateseal::internals::limits::TransportLimits::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind echo server");
    let addr = listener.local_addr().expect("echo addr");
    let incoming = stateseal::internals::accept::limited_incoming(
        listener,
        lim.max_connections,
        lim.max_tls_handshakes,
        lim.tls_handshake_timeout,
        stateseal::internals::conns::Conns::new(
            lim.conn_policy(lim.max_connections, false),
            Arc::default(),
        ),
    );
    // A health service too, so that `--serve-echo` has its own no-op.
    let (_, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        lim.apply(tonic::transport::Server::builder())
            .layer(stateseal::internals::conns::ConnActivityLayer)
            .add_service(health)
            .add_service(
                stateseal::proto::request_state_server::RequestStateServer::new(Echo { journal }),
            )
            .serve_with_incoming(incoming),
    );
    addr.to_string()
}

/// A private redis-server with every write fsynced before its answer.
struct RedisServer {
    child: std::process::Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_redis() -> Option<RedisServer> {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = ports::free_port();
    let child = std::process::Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--dir"])
        .arg(dir.path())
        .args([
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ])
        .stdout(std::process::Stdio::null())
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("\n*** SKIPPED: the redis scenario (cannot start redis-server: {e}) ***\n");
            // Under CI a skip fails, as in the tests (tests/it/common/skip.rs).
            let allowed = std::env::var("STATESEAL_ALLOW_SKIPS").unwrap_or_default();
            assert!(
                std::env::var("STATESEAL_FAIL_ON_SKIP").as_deref() != Ok("1")
                    || allowed.split(',').any(|a| a.trim() == "redis-scenario"),
                "SKIPPED under STATESEAL_FAIL_ON_SKIP=1: the redis scenario"
            );
            return None;
        }
    };
    let srv = RedisServer { child, port, dir };
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(srv)
}

/// Successful ops over the whole process (for the sampler).
static OPS_DONE: AtomicU64 = AtomicU64::new(0);
/// Failures printed so far, by reason (the first 5 of each are).
static ERRORS_SHOWN: std::sync::LazyLock<std::sync::Mutex<BTreeMap<String, u64>>> =
    std::sync::LazyLock::new(Default::default);
static PROCESS_START: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

/// One row of --samples.
#[derive(Clone, Debug)]
struct Sample {
    secs: f64,
    rss_kib: u64,
    dir_kib: u64,
    ops: u64,
    /// PostgreSQL ledger: live rows and table size (with indexes, TOAST).
    pg_rows: Option<i64>,
    pg_kib: Option<i64>,
    /// The sled ledger's record count (`stateseal_ledger_records`).
    records: Option<i64>,
}

const SAMPLE_HEADER: &str =
    "seconds,rss_kib,data_dir_kib,ops,ops_per_s,pg_live_rows,pg_table_kib,ledger_records";

/// One gauge from the server's /metrics (Prometheus text), if it has it.
async fn scrape_gauge(addr: &str, name: &str) -> Option<i64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .ok()?;
    let mut body = Vec::new();
    s.read_to_end(&mut body).await.ok()?;
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Samples the server every `every` until `stop`, appending CSV rows to
/// `out` as they come (a long soak keeps its data if cut short).
async fn sampler(
    pid: u32,
    dir: PathBuf,
    db_url: Option<String>,
    metrics_addr: Option<String>,
    every: Duration,
    out: PathBuf,
    stop: Arc<AtomicBool>,
) -> Vec<Sample> {
    use std::io::Write;
    let db = match db_url {
        Some(u) => match tokio_postgres::connect(&u, tokio_postgres::NoTls).await {
            Ok((c, conn)) => {
                tokio::spawn(conn);
                Some(c)
            }
            Err(e) => {
                eprintln!("sampler: cannot connect to PostgreSQL ({e}); not sampling the table");
                None
            }
        },
        None => None,
    };
    let mut f = std::fs::File::create(&out).expect("create --samples file");
    writeln!(f, "{SAMPLE_HEADER}").expect("write samples");
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut last: Option<(f64, u64)> = None;
    let mut tick = tokio::time::interval(every);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let rss_kib = support::status_kib(&pid.to_string(), "VmRSS:").unwrap_or(0);
        let (pg_rows, pg_kib) = match &db {
            Some(c) => match c
                .query_one(
                    "SELECT count(*), pg_total_relation_size('stateseal_consumed_v1') / 1024 \
                     FROM stateseal_consumed_v1",
                    &[],
                )
                .await
            {
                Ok(r) => (Some(r.get::<_, i64>(0)), Some(r.get::<_, i64>(1))),
                Err(_) => (None, None),
            },
            None => (None, None),
        };
        let records = match &metrics_addr {
            Some(a) => scrape_gauge(a, "stateseal_ledger_records").await,
            None => None,
        };
        let s = Sample {
            records,
            secs: started.elapsed().as_secs_f64(),
            rss_kib,
            dir_kib: support::disk_usage(&dir) / 1024,
            ops: OPS_DONE.load(Ordering::Relaxed),
            pg_rows,
            pg_kib,
        };
        let rate = last
            .map(|(t, o)| (s.ops - o) as f64 / (s.secs - t).max(1e-9))
            .unwrap_or(0.0);
        last = Some((s.secs, s.ops));
        let opt = |v: Option<i64>| v.map(|v| v.to_string()).unwrap_or_default();
        writeln!(
            f,
            "{:.0},{},{},{},{:.0},{},{},{}",
            s.secs,
            s.rss_kib,
            s.dir_kib,
            s.ops,
            rate,
            opt(s.pg_rows),
            opt(s.pg_kib),
            opt(s.records)
        )
        .expect("write samples");
        let _ = f.flush();
        eprintln!(
            "sample {:>6.0}s: rss {:>7} KiB, data dir {:>7} KiB, {:>8.0} ops/s{}",
            s.secs,
            s.rss_kib,
            s.dir_kib,
            rate,
            s.pg_rows
                .map(|r| format!(", pg {r} rows, {} KiB", s.pg_kib.unwrap_or(0)))
                .or_else(|| s.records.map(|r| format!(", ledger {r} records")))
                .unwrap_or_default()
        );
        rows.push(s);
    }
    rows
}

/// The samples as curves over time, one panel per quantity.
fn samples_svg(rows: &[Sample]) -> String {
    use std::fmt::Write as _;
    let mut panels: Vec<(&str, Vec<(f64, f64)>)> = vec![
        (
            "server RSS (MiB)",
            rows.iter()
                .map(|r| (r.secs, r.rss_kib as f64 / 1024.0))
                .collect(),
        ),
        (
            "data directory on disk (MiB)",
            rows.iter()
                .map(|r| (r.secs, r.dir_kib as f64 / 1024.0))
                .collect(),
        ),
        (
            "ops/s (since the previous sample)",
            rows.windows(2)
                .map(|w| {
                    (
                        w[1].secs,
                        (w[1].ops - w[0].ops) as f64 / (w[1].secs - w[0].secs),
                    )
                })
                .collect(),
        ),
    ];
    // Panels for the quantities a run sampled (sled's record count, or the
    // PostgreSQL table), skipped when it did not.
    type Series = fn(&Sample) -> Option<f64>;
    let optional: [(&str, Series); 3] = [
        ("ledger records (live and not yet collected)", |r| {
            r.records.map(|v| v as f64)
        }),
        ("PostgreSQL ledger live rows", |r| {
            r.pg_rows.map(|v| v as f64)
        }),
        ("PostgreSQL ledger table size (MiB)", |r| {
            r.pg_kib.map(|v| v as f64 / 1024.0)
        }),
    ];
    for (title, value) in optional {
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .filter_map(|r| Some((r.secs, value(r)?)))
            .collect();
        if !pts.is_empty() {
            panels.push((title, pts));
        }
    }
    let (w, ph, left, top) = (720.0, 150.0, 70.0, 30.0);
    let h = top + panels.len() as f64 * (ph + 40.0);
    let tmax = rows.last().map(|r| r.secs).unwrap_or(1.0).max(1.0);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, (title, pts)) in panels.iter().enumerate() {
        let y0 = top + i as f64 * (ph + 40.0);
        let vmax = pts.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
        let _ = writeln!(
            out,
            "<text x=\"{left}\" y=\"{}\" font-weight=\"bold\">{title}</text>",
            y0 - 8.0
        );
        let _ = writeln!(out, "<rect x=\"{left}\" y=\"{y0}\" width=\"{}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>", w - left - 20.0);
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.1}</text>",
            left - 4.0,
            y0 + 10.0,
            vmax
        );
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">0</text>",
            left - 4.0,
            y0 + ph
        );
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.0} min</text>",
            w - 20.0,
            y0 + ph + 14.0,
            tmax / 60.0
        );
        let path: Vec<String> = pts
            .iter()
            .map(|(t, v)| {
                format!(
                    "{:.1},{:.1}",
                    left + t / tmax * (w - left - 20.0),
                    y0 + ph - v / vmax * ph
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"#1f6fb2\" stroke-width=\"1.5\" points=\"{}\"/>",
            path.join(" ")
        );
    }
    out.push_str("</svg>\n");
    out
}

/// The binding of the `seal_json` scenario: the service canonicalizes the
/// params itself (RFC 8785) and digests them.
fn json_binding() -> Binding {
    let mut b = binding();
    b.params = Some(Params::ParamsJson(
        r#"{"name":"deploy","arguments":{"service":"api","replicas":3,"confirm":true}}"#.into(),
    ));
    b
}

fn binding() -> Binding {
    Binding {
        subject: "bench-user".into(),
        method: "tools/call".into(),
        params: Some(Params::ParamsDigest(vec![7; 32])),
        binding_version: 0,
    }
}

/// One HTTP/2 connection to `addr`, with TCP_NODELAY.
async fn connect(addr: &str, what: &str, client_io: ClientIo) -> Channel {
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
enum ClientIo {
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

/// A gRPC message as it goes on the wire: uncompressed flag, big-endian
/// length, the protobuf bytes.
fn grpc_frame(m: &impl prost::Message) -> Vec<u8> {
    let body = m.encode_to_vec();
    let mut out = vec![0u8];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// The request bodies `benches/h2load.sh` sends: the same requests as the
/// noop, seal and open scenarios, plus a seal with `params_json`.
async fn write_h2load_bodies(dir: &std::path::Path, addr: &str, state_size: usize) {
    std::fs::create_dir_all(dir).expect("create the bodies directory");
    let state = vec![0x5a; state_size];
    let seal = SealRequest {
        binding: Some(binding()),
        state: state.clone(),
        ..Default::default()
    };
    let seal_json = SealRequest {
        binding: Some(json_binding()),
        state,
        ..Default::default()
    };
    let token = RequestStateClient::new(connect(addr, "stateseal", ClientIo::Vectored).await)
        .seal(seal.clone())
        .await
        .expect("seal the token the open body carries")
        .into_inner()
        .request_state;
    let open = OpenRequest {
        request_state: token,
        binding: Some(binding()),
        ..Default::default()
    };
    let noop = HealthCheckRequest {
        service: String::new(),
    };
    for (name, bytes) in [
        ("noop", grpc_frame(&noop)),
        ("seal", grpc_frame(&seal)),
        ("seal_json", grpc_frame(&seal_json)),
        ("open", grpc_frame(&open)),
    ] {
        std::fs::write(dir.join(format!("{name}.bin")), bytes).expect("write a body");
    }
    eprintln!("wrote h2load bodies to {}", dir.display());
}

fn reason(s: &tonic::Status) -> String {
    stateseal::internals::status::reason_of(s).unwrap_or_else(|| format!("{:?}", s.code()))
}

/// Tokens for the scenarios that open pre-sealed tokens.
#[derive(Clone)]
enum Tokens {
    /// Reusable tokens, handed out round-robin.
    Reusable(Arc<Vec<String>>, Arc<AtomicU64>),
    /// Single-use tokens, each handed out once.
    SingleUse(Arc<std::sync::Mutex<Vec<String>>>),
}

struct Ctx {
    ttl: u32,
    channels: Vec<Channel>,
    echo: Vec<Channel>,
    redis: Vec<redis::aio::MultiplexedConnection>,
    state: Vec<u8>,
    /// What echo_fsync sends as its token: as long as a sealed one.
    echo_token: String,
    /// The fdatasync scenario's file.
    floor: Option<FloorFile>,
    /// The handoff scenario's thread.
    handoff: Option<Handoff>,
}

impl Ctx {
    fn client(&self, i: usize) -> RequestStateClient<Channel> {
        RequestStateClient::new(self.channels[i % self.channels.len()].clone())
    }

    /// The seal request, to the echo server.
    async fn echo(&self, i: usize) -> Result<(), tonic::Status> {
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
    async fn echo_fsync(&self, i: usize) -> Result<(), tonic::Status> {
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
    async fn redis_set(&self, i: usize, n: u64) -> Result<(), tonic::Status> {
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

    async fn seal(&self, i: usize, single_use: bool) -> Result<String, tonic::Status> {
        self.seal_as(i, binding(), single_use).await
    }

    async fn seal_as(
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

    async fn open(&self, i: usize, token: String) -> Result<(), tonic::Status> {
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
    async fn reserve_commit(&self, i: usize, token: String) -> Result<(), tonic::Status> {
        let reservation = self.reserve(i, token).await?;
        self.commit(i, reservation).await
    }

    /// Open RESERVE carrying `commit` (the caller's previous reservation,
    /// as the client packages send it): the new reservation, once the
    /// carried commit is confirmed.
    async fn reserve_carrying(
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
    async fn reserve(&self, i: usize, token: String) -> Result<String, tonic::Status> {
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

    async fn commit(&self, i: usize, reservation: String) -> Result<(), tonic::Status> {
        self.client(i)
            .commit(stateseal::proto::CommitRequest { reservation })
            .await
            .map(|_| ())
    }

    /// One 64-byte `pwrite` and one `fdatasync` of the fdatasync
    /// scenario's file, on this worker thread (at one caller, the thread
    /// would wait anyway).
    fn fdatasync(&self) -> Result<(), tonic::Status> {
        let floor = self.floor.as_ref().expect("the fdatasync scenario's file");
        tokio::task::block_in_place(|| floor.write())
            .map_err(|e| tonic::Status::unavailable(format!("fdatasync scenario: {e}")))
    }

    /// Reserves each of `tokens`, 64 at a time (not measured).
    async fn prereserve(self: &Arc<Self>, tokens: Vec<String>) -> Vec<String> {
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
    async fn preseal(self: &Arc<Self>, n: usize, single_use: bool, conc: usize) -> Vec<String> {
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

async fn run(
    ctx: &Arc<Ctx>,
    scenario: Scenario,
    args: &Args,
    measure: Duration,
    limit: Option<u64>,
    tokens: Option<Tokens>,
    progress: bool,
) -> RunResult {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let ticker = progress.then(|| {
        let (stop, done) = (stop.clone(), done.clone());
        let name = scenario.name();
        tokio::spawn(async move {
            let mut last = 0;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let now = done.load(Ordering::Relaxed);
                eprintln!("  {name:>8}: {:>8} ops/s", now - last);
                last = now;
            }
        })
    });
    let (args_rate, concurrency) = (args.rate, args.concurrency);
    let workers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let (ctx, stop, done, tokens) =
                (ctx.clone(), stop.clone(), done.clone(), tokens.clone());
            tokio::spawn(async move {
                let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
                let mut errors: BTreeMap<String, u64> = BTreeMap::new();
                let mut ops = 0u64;
                // reserve_carried: the reservation the next Open carries.
                let mut carried: Option<String> = None;
                // Each caller takes its share of --rate.
                let mut pace = (args_rate > 0.0).then(|| {
                    let mut i = tokio::time::interval(Duration::from_secs_f64(
                        concurrency as f64 / args_rate,
                    ));
                    i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    i
                });
                while !stop.load(Ordering::Relaxed) && started.elapsed() < measure {
                    if let Some(p) = pace.as_mut() {
                        p.tick().await;
                    }
                    if let Some(l) = limit {
                        if done.fetch_add(1, Ordering::Relaxed) >= l {
                            break;
                        }
                    }
                    let token = match &tokens {
                        Some(Tokens::Reusable(pool, next)) => Some(
                            pool[next.fetch_add(1, Ordering::Relaxed) as usize % pool.len()]
                                .clone(),
                        ),
                        Some(Tokens::SingleUse(pool)) => match pool.lock().expect("pool").pop() {
                            Some(t) => Some(t),
                            None => break, // pool exhausted: the run ends early
                        },
                        None => None,
                    };
                    let t0 = Instant::now();
                    let r = match scenario {
                        Scenario::Noop => {
                            let mut h =
                                HealthClient::new(ctx.channels[w % ctx.channels.len()].clone());
                            h.check(HealthCheckRequest {
                                service: String::new(),
                            })
                            .await
                            .map(|_| ())
                        }
                        Scenario::Seal => ctx.seal(w, false).await.map(|_| ()),
                        Scenario::SealJson => {
                            ctx.seal_as(w, json_binding(), false).await.map(|_| ())
                        }
                        Scenario::Echo => ctx.echo(w).await,
                        Scenario::EchoFsync => ctx.echo_fsync(w).await,
                        Scenario::Redis => ctx.redis_set(w, ops).await,
                        Scenario::Open | Scenario::Consume => {
                            ctx.open(w, token.expect("pre-sealed token")).await
                        }
                        Scenario::Flow => match ctx.seal(w, true).await {
                            Ok(t) => ctx.open(w, t).await,
                            Err(e) => Err(e),
                        },
                        Scenario::Reserve => {
                            ctx.reserve_commit(w, token.expect("pre-sealed token"))
                                .await
                        }
                        Scenario::ReserveCarried => ctx
                            .reserve_carrying(w, token.expect("pre-sealed token"), carried.take())
                            .await
                            .map(|r| carried = Some(r)),
                        Scenario::OpenReserve => ctx
                            .reserve(w, token.expect("pre-sealed token"))
                            .await
                            .map(|_| ()),
                        Scenario::Commit => {
                            ctx.commit(w, token.expect("pre-made reservation")).await
                        }
                        Scenario::Fdatasync => ctx.fdatasync(),
                        Scenario::Handoff => {
                            ctx.handoff
                                .as_ref()
                                .expect("the handoff scenario's thread")
                                .call()
                                .await
                        }
                    };
                    let us = t0.elapsed().as_micros().max(1) as u64;
                    hist.saturating_record(us);
                    match r {
                        Ok(()) => {
                            ops += 1;
                            OPS_DONE.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            // The first few failures of each reason, with
                            // when and what, so a long run's rare errors can
                            // be placed.
                            let shown = {
                                let mut m = ERRORS_SHOWN.lock().expect("lock");
                                let n = m.entry(reason(&e)).or_default();
                                *n += 1;
                                *n
                            };
                            if shown <= 5 {
                                eprintln!(
                                    "error at {:.1}s into {}: {} ({:?}: {})",
                                    PROCESS_START.elapsed().as_secs_f64(),
                                    scenario.name(),
                                    reason(&e),
                                    e.code(),
                                    e.message()
                                );
                            }
                            *errors.entry(reason(&e)).or_default() += 1;
                        }
                    }
                    if limit.is_none() {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
                (ops, hist, errors)
            })
        })
        .collect();
    let mut total = RunResult {
        ops: 0,
        secs: 0.0,
        hist: Histogram::new_with_bounds(1, 60_000_000, 3).expect("bounds"),
        errors: BTreeMap::new(),
    };
    for w in workers {
        let (ops, hist, errors) = w.await.expect("worker");
        total.ops += ops;
        total.hist.add(&hist).expect("same bounds");
        for (k, v) in errors {
            *total.errors.entry(k).or_default() += v;
        }
    }
    total.secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = ticker {
        let _ = t.await;
    }
    total
}

fn main() {
    std::sync::LazyLock::force(&PROCESS_START);
    let mut args = Args::parse();
    if !args.bench {
        // Under `cargo test`: prove the generator and every scenario work,
        // briefly. The figures of such a run mean nothing.
        eprintln!("stateseal load: smoke run (no --bench flag); use `cargo bench --bench load` to measure");
        args.duration = 0.2;
        args.warmup = 0.0;
        args.rounds = 1;
        args.requests = Some(200);
        // A scenario left out of the default list runs in the smoke too.
        if !args.scenarios.split(',').any(|s| s.trim() == "handoff") {
            args.scenarios.push_str(",handoff");
        }
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
    let mut scenarios: Vec<Scenario> = args
        .scenarios
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| Scenario::parse(s).unwrap_or_else(|| panic!("unknown scenario {s:?}")))
        .filter(|s| *s != Scenario::Noop)
        .collect();
    scenarios.dedup();
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
    let mut metrics_addr: Option<String> = None;
    let (server, addr) = match &args.addr {
        Some(a) => (None, a.clone()),
        None => {
            let mut extra = args.server_args.clone();
            if !extra.iter().any(|a| a.starts_with("--max-ledger-records")) {
                // The durable scenarios leave a record per consumption (their
                // tokens live 600 s): on a fast machine a default run makes
                // more than the server's default bound of 250,000, and the
                // rest would be refused OVERLOADED. The bound is not what
                // this bench measures (tests/it/ledger_bound.rs tests it).
                extra.extend(["--max-ledger-records".into(), "0".into()]);
            }
            if args.samples.is_some() {
                // The sampler reads the ledger's record count from /metrics.
                let port = ports::free_port();
                extra.extend(["--metrics-listen".into(), format!("127.0.0.1:{port}")]);
                metrics_addr = Some(format!("127.0.0.1:{port}"));
            }
            let (s, a) = start_server(&extra);
            (Some(s), a)
        }
    };
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
    let mut echo_journal = scenarios.contains(&Scenario::EchoFsync).then(|| {
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
    let results = rt.block_on(async {
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
        if let Some(r) = &redis_server {
            let client =
                redis::Client::open(format!("redis://127.0.0.1:{}/", r.port)).expect("redis url");
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
                let pool = match sc {
                    Scenario::Open => Some(Tokens::Reusable(open_pool.clone(), Arc::default())),
                    Scenario::Consume
                    | Scenario::Reserve
                    | Scenario::ReserveCarried
                    | Scenario::OpenReserve => {
                        // Enough for the warm-up and the measured window at
                        // up to 40k consumptions/s (a run that drains the
                        // pool ends early and reports its true duration).
                        let need = args
                            .requests
                            .map(|r| r as usize + (40_000.0 * args.warmup) as usize)
                            .unwrap_or((40_000.0 * (args.duration + args.warmup)) as usize);
                        eprintln!("  (pre-sealing {need} single-use tokens)");
                        let v = ctx.preseal(need, true, args.concurrency.max(64)).await;
                        Some(Tokens::SingleUse(Arc::new(std::sync::Mutex::new(v))))
                    }
                    Scenario::Commit => {
                        // Reservations cost a durable round each: enough
                        // for 20k Commits/s, or for one caller 5k/s (a run
                        // that drains the pool ends early and says so in
                        // its duration).
                        let rate = if args.concurrency == 1 {
                            5_000.0
                        } else {
                            20_000.0
                        };
                        let need = args
                            .requests
                            .map(|r| r as usize + (rate * args.warmup) as usize)
                            .unwrap_or((rate * (args.duration + args.warmup)) as usize);
                        eprintln!("  (pre-sealing and reserving {need} single-use tokens)");
                        let v = ctx.preseal(need, true, args.concurrency.max(64)).await;
                        let v = ctx.prereserve(v).await;
                        Some(Tokens::SingleUse(Arc::new(std::sync::Mutex::new(v))))
                    }
                    _ => None,
                };
                if warm > Duration::ZERO {
                    let _ = run(&ctx, sc, &args, warm, None, pool.clone(), false).await;
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
                let r = run(&ctx, sc, &args, window, args.requests, pool, true).await;
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
    });

    if let Some(t) = sampler_task {
        sampling.store(true, Ordering::Relaxed);
        let rows = rt.block_on(t).expect("sampler");
        if let Some(p) = &args.samples_plot {
            std::fs::write(p, samples_svg(&rows)).expect("write --samples-plot");
            eprintln!("wrote {}", p.display());
        }
    }
    let noop_rate = results
        .get(&Scenario::Noop)
        .map(Totals::rate)
        .unwrap_or(0.0);
    let rss = server.as_ref().and_then(|s| s.rss_kib("VmHWM:"));
    println!();
    println!(
        "{:<10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>10} {:>12}  errors",
        "scenario",
        "ops/s",
        "calls/s",
        "p50 µs",
        "p90 µs",
        "p99 µs",
        "p99.9 µs",
        "× noop",
        "srv µs/call"
    );
    let mut json_rows = Vec::new();
    let mut thread_lines = Vec::new();
    let mut disk_lines = Vec::new();
    for (sc, t) in &results {
        let h = t.hist.as_ref().expect("at least one run");
        let calls = t.call_rate(*sc);
        let ratio = t.calls_against(*sc, noop_rate);
        let errs: Vec<String> = t.errors.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let cpu = t
            .server_us_per_call(sc.calls_per_op())
            .filter(|_| sc.on_stateseal());
        let by_thread = if sc.on_stateseal() {
            t.server_threads_us_per_call(sc.calls_per_op())
        } else {
            Vec::new()
        };
        let shown: Vec<String> = by_thread
            .iter()
            .filter(|(_, _, us)| *us >= 0.05)
            .map(|(name, n, us)| format!("{name} ×{n} {us:.1}"))
            .collect();
        if !shown.is_empty() {
            thread_lines.push(format!("{:<10} {}", sc.name(), shown.join(", ")));
        }
        let disk = t
            .disk_per_call(sc.calls_per_op())
            .filter(|_| sc.on_stateseal() || sc.durable());
        if let Some((writes, flushes, kib)) = disk {
            disk_lines.push(format!(
                "{:<10} writes {writes:.3}, flushes {flushes:.3}, KiB written {kib:.2}",
                sc.name()
            ));
        }
        println!(
            "{:<10} {:>10.0} {:>10.0} {:>9} {:>9} {:>9} {:>9} {:>10.2} {:>12}  {}",
            sc.name(),
            t.rate(),
            calls,
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.9),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            ratio,
            cpu.map_or("-".into(), |c| format!("{c:.1}")),
            if errs.is_empty() {
                "-".into()
            } else {
                errs.join(" ")
            }
        );
        json_rows.push(serde_json::json!({
            "scenario": sc.name(),
            "ops_per_sec": t.rate(),
            "calls_per_sec": calls,
            "ops": t.ops,
            "seconds": t.secs,
            "p50_us": h.value_at_quantile(0.5),
            "p90_us": h.value_at_quantile(0.9),
            "p99_us": h.value_at_quantile(0.99),
            "p999_us": h.value_at_quantile(0.999),
            "ratio_to_noop": ratio,
            "server_cpu_us_per_call": cpu,
            "disk_per_call": disk.map(|(writes, flushes, kib)| serde_json::json!({
                "writes": writes, "flushes": flushes, "kib_written": kib,
            })),
            "server_threads_cpu_us_per_call": by_thread
                .iter()
                .map(|(name, n, us)| (name.clone(), serde_json::json!({ "threads": n, "us_per_call": us })))
                .collect::<serde_json::Map<_, _>>(),
            "errors": t.errors,
        }));
    }
    if !thread_lines.is_empty() {
        println!("server CPU µs per call, by thread (× threads in the group):");
        for l in &thread_lines {
            println!("  {l}");
        }
    }
    if !disk_lines.is_empty() {
        println!(
            "requests per call to the block device of the store (the data directory; Redis's for redis, the echo journal's for echo_fsync; every process's):"
        );
        for l in &disk_lines {
            println!("  {l}");
        }
    }
    // Each durable scenario of stateseal against the durable round alone,
    // per call: what the ledger keeps of what this machine's disk allows.
    let floor = results
        .get(&Scenario::EchoFsync)
        .map(|t| t.call_rate(Scenario::EchoFsync))
        .filter(|f| *f > 0.0);
    let of_floor: Vec<(&str, f64)> = results
        .iter()
        .filter(|(sc, _)| sc.durable() && sc.on_stateseal())
        .filter_map(|(sc, t)| floor.map(|f| (sc.name(), t.calls_against(*sc, f))))
        .collect();
    if !of_floor.is_empty() {
        let shown: Vec<String> = of_floor
            .iter()
            .map(|(name, r)| format!("{name} {r:.2}"))
            .collect();
        println!(
            "calls/s against echo_fsync's (the durable round alone): {}",
            shown.join(", ")
        );
    }
    if let Some(kib) = rss {
        println!("server peak RSS (VmHWM): {:.1} MiB", kib as f64 / 1024.0);
    }
    if !args.bench {
        // The smoke run is a test: every scenario must have worked.
        for (sc, t) in &results {
            assert!(
                t.ops > 0 && t.errors.is_empty(),
                "smoke run: {} had {} ops and errors {:?}",
                sc.name(),
                t.ops,
                t.errors
            );
        }
        // The server's threads were read for every scenario on it: the
        // request workers and, once a consumption has run, the ledger's
        // writer.
        if server.is_some() {
            for (sc, t) in results.iter().filter(|(sc, _)| sc.on_stateseal()) {
                let groups = t.server_threads.as_ref();
                assert!(
                    groups
                        .is_some_and(|g| g.get("tokio-rt-worker").is_some_and(|w| w.threads >= 1)),
                    "smoke run: no request worker among the server's threads for {}",
                    sc.name()
                );
                if sc.durable() {
                    assert!(
                        groups.is_some_and(|g| g.contains_key("stateseal-ledge")),
                        "smoke run: no ledger writer among the server's threads for {}",
                        sc.name()
                    );
                }
            }
        }
        // A durable answer reaches the disk: where the device of the
        // scenario's store is known, it served writes.
        for (sc, t) in results.iter().filter(|(sc, _)| sc.durable()) {
            if let Some(d) = t.disk {
                assert!(
                    d.writes > 0 && d.write_sectors > 0,
                    "smoke run: {} wrote nothing to its store's device: {d:?}",
                    sc.name()
                );
            }
        }
        // And the picture draws a row per scenario.
        let picture = svg(&results, noop_rate);
        for sc in results.keys() {
            assert!(
                picture.contains(&format!(">{}</text>", sc.name())),
                "plot lacks {}",
                sc.name()
            );
        }
        println!("load smoke: {} scenarios ran without errors", results.len());
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, svg(&results, noop_rate)).expect("write --plot");
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "addr": addr,
            "concurrency": args.concurrency,
            "connections": args.connections,
            "state_size": args.state_size,
            "rounds": args.rounds,
            "duration_per_round": args.duration,
            "echo_fsync_delay_us": args.echo_fsync_delay_us,
            "server_peak_rss_kib": rss,
            "ratio_to_echo_fsync": of_floor
                .iter()
                .map(|(name, r)| ((*name).to_owned(), serde_json::json!(r)))
                .collect::<serde_json::Map<_, _>>(),
            "scenarios": json_rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc).expect("json"))
            .expect("write --json");
        eprintln!("wrote {}", path.display());
    }
}

/// Two panels: calls/s relative to the no-op, and latency percentiles (µs,
/// log scale), one row per scenario.
fn svg(results: &BTreeMap<Scenario, Totals>, noop_rate: f64) -> String {
    let rows: Vec<(&str, f64, [u64; 3])> = results
        .iter()
        .map(|(sc, t)| {
            let h = t.hist.as_ref().expect("at least one run");
            (
                sc.name(),
                t.calls_against(*sc, noop_rate),
                [
                    h.value_at_quantile(0.5),
                    h.value_at_quantile(0.9),
                    h.value_at_quantile(0.99),
                ],
            )
        })
        .collect();
    let (row_h, top, left, panel_w) = (26.0, 40.0, 80.0, 380.0);
    let height = top + row_h * rows.len() as f64 + 40.0;
    let width = left + panel_w * 2.0 + 120.0;
    let max_ratio = rows.iter().map(|r| r.1).fold(1.0f64, f64::max);
    let max_us = rows.iter().map(|r| r.2[2]).max().unwrap_or(1).max(10) as f64;
    let log = |us: u64| (us.max(1) as f64).log10() / max_us.log10();
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"20\" font-weight=\"bold\">calls/s × no-op (line at 1.0)</text>\n\
         <text x=\"{}\" y=\"20\" font-weight=\"bold\">latency µs, log scale: p50 ▮ p90 ▮ p99 ▮</text>\n",
        left + panel_w + 40.0
    );
    let one = left + panel_w * (1.0 / max_ratio);
    out.push_str(&format!(
        "<line x1=\"{one:.1}\" y1=\"{top}\" x2=\"{one:.1}\" y2=\"{:.1}\" stroke=\"#888\" stroke-dasharray=\"4 3\"/>\n",
        top + row_h * rows.len() as f64
    ));
    for (i, (name, ratio, p)) in rows.iter().enumerate() {
        let y = top + row_h * i as f64;
        out.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{name}</text>\n",
            left - 8.0,
            y + 16.0
        ));
        let w = panel_w * ratio / max_ratio;
        out.push_str(&format!(
            "<rect x=\"{left}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"18\" fill=\"#4477aa\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\">{ratio:.2}</text>\n",
            y + 3.0,
            left + w + 4.0,
            y + 16.0
        ));
        let x0 = left + panel_w + 40.0;
        for (j, (us, color)) in p.iter().zip(["#66ccee", "#228833", "#ee6677"]).enumerate() {
            let w = panel_w * log(*us);
            out.push_str(&format!(
                "<rect x=\"{x0}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"5\" fill=\"{color}\"/>\n",
                y + 3.0 + 6.0 * j as f64
            ));
        }
        out.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\">{} / {} / {}</text>\n",
            x0 + panel_w + 6.0,
            y + 16.0,
            p[0],
            p[1],
            p[2]
        ));
    }
    out.push_str("</svg>\n");
    out
}
