//! The history: one JSON object per line, one line per operation
//! (docs/testing.md, "The history format"), and the fault windows beside
//! it in `HISTORY.faults`, one JSON object per line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// One operation as the history records it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Op {
    /// The caller: `c<N>`, or `final` for the replay after recovery.
    pub process: String,
    /// `seal`, `open_consume`, `open_reserve`, `renew`, `commit`, `release`.
    pub op: String,
    /// A stable id of the token (`t<N>`), never the token.
    pub token: String,
    /// The attempt id the Open carried; for renew, commit and release the
    /// attempt that reserved. Null for seal.
    pub attempt: Option<String>,
    /// A stable id of the reservation (`r<N>`), or null.
    pub reservation: Option<String>,
    /// Unix seconds, as floats, on the harness's clock (never skewed).
    pub invoke: f64,
    pub complete: f64,
    /// `ok`, `fail` (a definite refusal: nothing happened) or `info`
    /// (indeterminate: a timeout, a cut connection, an unavailable ledger).
    pub outcome: String,
    /// The stateseal reason (`REPLAYED`, `IN_USE`, …), the gRPC code when
    /// there is none, or `timeout`; null when ok.
    pub reason: Option<String>,
    /// For opens: whether this call consumed the token.
    pub consumed: Option<bool>,
    /// Extra: the replica the call went to (0-based).
    #[serde(default)]
    pub replica: Option<usize>,
    /// Extra: for ok opens in reserve mode and ok renews, the lease
    /// granted, in seconds.
    #[serde(default)]
    pub lease: Option<f64>,
}

/// The harness's clock for the history: Unix seconds taken once, then a
/// monotonic clock, so a clock step on the machine cannot reorder lines.
#[derive(Clone, Copy)]
pub struct Clock {
    unix0: f64,
    t0: Instant,
}

impl Clock {
    pub fn new() -> Clock {
        Clock {
            unix0: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs_f64(),
            t0: Instant::now(),
        }
    }
    pub fn now(&self) -> f64 {
        self.unix0 + self.t0.elapsed().as_secs_f64()
    }
}

/// Appends JSON lines from any task: the history ([`Writer`]) and the
/// fault windows ([`FaultLog`]).
pub struct JsonLines<T> {
    out: Mutex<Option<std::io::BufWriter<std::fs::File>>>,
    clock: Clock,
    count: std::sync::atomic::AtomicU64,
    _line: std::marker::PhantomData<fn(&T)>,
}

pub type Writer = JsonLines<Op>;
pub type FaultLog = JsonLines<Fault>;

impl<T: Serialize> JsonLines<T> {
    pub fn create(path: &Path, clock: Clock) -> JsonLines<T> {
        let f = std::fs::File::create(path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        JsonLines {
            out: Mutex::new(Some(std::io::BufWriter::with_capacity(1 << 20, f))),
            clock,
            count: Default::default(),
            _line: std::marker::PhantomData,
        }
    }
    pub fn clock(&self) -> Clock {
        self.clock
    }
    pub fn now(&self) -> f64 {
        self.clock.now()
    }
    pub fn record(&self, line: &T) {
        let mut bytes = serde_json::to_vec(line).unwrap();
        bytes.push(b'\n');
        if let Some(w) = self.out.lock().unwrap().as_mut() {
            w.write_all(&bytes).unwrap();
        }
        self.count
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    pub fn count(&self) -> u64 {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }
    pub fn finish(&self) {
        if let Some(mut w) = self.out.lock().unwrap().take() {
            w.flush().unwrap();
            w.get_ref().sync_all().unwrap();
        }
    }
}

/// One fault window.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Fault {
    /// `partition-db`, `partition-db-in`, `partition-db-out`,
    /// `partition-clients`, `partition-clients-in`, `partition-clients-out`,
    /// `slow-db`, `slow-clients`, `clock-within`, `clock-beyond`, `pause`,
    /// `kill`, `pg-restart-fast`, `pg-restart-immediate`, `disk-full`.
    pub kind: String,
    /// `replica<N>` or `postgres`.
    pub target: String,
    pub start: f64,
    pub end: f64,
    /// The fault's parameters, as text (an offset, a delay, a duration).
    pub detail: String,
}

pub fn faults_path(history: &Path) -> PathBuf {
    let mut p = history.as_os_str().to_owned();
    p.push(".faults");
    PathBuf::from(p)
}

pub fn read_faults(path: &Path) -> Vec<Fault> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}
