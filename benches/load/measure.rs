//! What the server and the disk were seen doing over each measured window
//! (the server's CPU from /proc, in all and by thread group; the requests
//! its store's block device served), and [`Totals`], one scenario's
//! figures summed over its rounds.

use std::collections::BTreeMap;
use std::path::PathBuf;

use hdrhistogram::Histogram;

use super::runner::RunResult;
use super::scenarios::Scenario;

/// One scenario's figures, summed over its measured windows.
#[derive(Default)]
pub struct Totals {
    pub ops: u64,
    pub secs: f64,
    pub hist: Option<Histogram<u64>>,
    pub errors: BTreeMap<String, u64>,
    /// The server's CPU (user + system, clock ticks) over the measured
    /// windows, when its process is known.
    pub server_ticks: Option<u64>,
    /// The same by thread group (see `ThreadGroup`), for the threads that
    /// lived through a whole window.
    pub server_threads: Option<BTreeMap<String, ThreadGroup>>,
    /// The requests the data directory's block device served over the
    /// measured windows, when its counters are readable.
    pub disk: Option<DiskStat>,
}

/// What the server was seen doing over one measured window.
pub struct Window {
    pub ticks: Option<u64>,
    pub threads: Option<BTreeMap<String, ThreadGroup>>,
    pub disk: Option<DiskStat>,
}

/// A block device's request counters (`/sys/dev/block/MAJ:MIN/stat`, the
/// kernel's Documentation/block/stat.rst): write requests, 512-byte sectors
/// written, and cache flushes. They count every process's requests to the
/// device, not only the server's.
#[derive(Clone, Copy, Debug)]
pub struct DiskStat {
    pub writes: u64,
    pub write_sectors: u64,
    pub flushes: u64,
}

impl DiskStat {
    /// The counters file of the block device that holds `dir`; `None`
    /// where it has none (tmpfs, overlay on a non-block device).
    pub fn file_of(dir: &std::path::Path) -> Option<PathBuf> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(dir).ok()?.dev();
        let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
        let file = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
        file.exists().then_some(file)
    }

    /// The counters now; `None` if unreadable or the kernel does not count
    /// flushes (before Linux 5.5).
    pub fn read(file: &std::path::Path) -> Option<Self> {
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
    pub fn zip_with(self, other: Self, f: impl Fn(u64, u64) -> u64) -> Self {
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
pub struct ThreadGroup {
    pub ticks: u64,
    /// Threads in the group (the most seen in one window).
    pub threads: usize,
}

impl Totals {
    pub fn add(&mut self, r: RunResult, w: Window) {
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
    pub fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.ops as f64 / self.secs
        } else {
            0.0
        }
    }
    /// Calls per second (each op of `sc` makes `calls_per_op` calls).
    pub fn call_rate(&self, sc: Scenario) -> f64 {
        self.rate() * sc.calls_per_op()
    }
    /// Calls per second against a baseline's (0 without a baseline).
    pub fn calls_against(&self, sc: Scenario, base: f64) -> f64 {
        if base > 0.0 {
            self.call_rate(sc) / base
        } else {
            0.0
        }
    }
    /// The server's CPU µs per call (not per op: a flow op is two calls).
    pub fn server_us_per_call(&self, calls_per_op: f64) -> Option<f64> {
        self.us_per_call(self.server_ticks?, calls_per_op)
    }
    /// The same by thread group, largest first.
    pub fn server_threads_us_per_call(&self, calls_per_op: f64) -> Vec<(String, usize, f64)> {
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
    pub fn disk_per_call(&self, calls_per_op: f64) -> Option<(f64, f64, f64)> {
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
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    stat_ticks(&format!("/proc/{pid}/stat")).map(|(_, t)| t)
}

/// Each thread's name and CPU so far, by thread id.
pub type ThreadTicks = BTreeMap<u32, (String, u64)>;

pub fn thread_ticks(pid: u32) -> Option<ThreadTicks> {
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
pub fn thread_delta(before: &ThreadTicks, after: &ThreadTicks) -> BTreeMap<String, ThreadGroup> {
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
