//! The embedded sled ledger, for one replica.
//!
//! sled writes to disk when it is flushed: by this writer, or by sled's own
//! flusher every 500 ms. One writer thread owns every
//! consumption: callers hand it their key and wait; it takes everything that
//! queued up while its previous round ran (group commit), decides each key
//! (absent from the tree and not earlier in this round → consumed now;
//! otherwise consumed before), writes each changed key with its own sled
//! `insert` or `remove`, flushes once, `fdatasync`s sled's data file, and
//! only then answers. N concurrent consumptions cost one flush, not N.
//! A single writer makes check-then-insert atomic without a per-key
//! compare-and-swap (the garbage collector only ever removes records that
//! expired, which no open can ask about).
//!
//! Not one `apply_batch` per round: sled makes a batch atomic by writing its
//! log buffer out before the batch and sealing another right after the
//! batch's manifest, so a batch costs two more device writes, each waited
//! for in turn (measured: 4.1 against 3.1 write requests per round at one
//! consumption per round, 4.8 against 3.0–3.3 at 64 in flight;
//! docs/performance.md, "What a durable round asks of the disk"). Nothing
//! needs a round to be atomic as a whole: every record is one key's, each
//! key is written at most once per round, and nobody is answered before the
//! round's flush and `fdatasync`. A crash in the middle of a round may keep
//! some of its records (sled's own flusher writes every 500 ms): those
//! consumptions were never acknowledged, as after a crash between a durable
//! round and its answers, and the tokens stay burned (the same attempt,
//! named by its attempt id, gets its success again).
//!
//! sled's own flush uses `sync_file_range`, which survives a killed process
//! but not a power loss; the `fdatasync` covers the latter.
//!
//! Garbage collection runs on the same writer thread, between rounds: it
//! first raises the *horizon* (kept in a meta tree) and makes it durable,
//! then removes records that expired before it. The writer answers
//! `PastHorizon` for any key below the horizon, so a removed record can never
//! be consumed afresh — whatever a clock says later, across restarts too.
//!
//! Fail-stop: after any failed write, flush or `fdatasync`, the writer never
//! touches the store again (after a failed fsync the kernel may have dropped
//! dirty pages, and a later successful fsync would prove nothing about
//! them). Every later consumption fails (`LEDGER_UNAVAILABLE`), readiness
//! goes `NOT_SERVING`, and [`Ledger::failed_for_good`] tells the server to
//! exit non-zero, so that the orchestrator restarts the process and sled
//! recovers from its log: everything acknowledged was fsynced before its
//! answer.
//!
//! fsync's answer alone is not enough: on ext4, an `fdatasync` that races the
//! journal abort of a filesystem error can return success and the write is
//! still lost (measured: 5 of 30 runs of an append + `fdatasync` loop lost
//! the last write whose `fdatasync` returned 0 within ~20 ms of the error;
//! `tests/disk.rs`). So after each `fdatasync` the writer changes the size
//! of a probe file in the ledger directory (0 ↔ 1 byte): a size change must
//! start a journal transaction and reports its failure, and the journal is
//! marked aborted before any such fsync returns. A failed probe fails the
//! round like a failed fsync (fail-stop, nothing acknowledged). With the
//! probe, 60 runs of the same loop lost nothing that was acknowledged.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use tokio::sync::oneshot;

use super::{Committed, Consumed, Lease, Ledger, LedgerError, LedgerKey};
use crate::clock::{Clock, WallClock};

/// Meta records: the horizon and the clock's high-water mark.
const META_TREE: &str = "meta/v1";
const META_HORIZON: &[u8] = b"gc_horizon";
const META_HIGH_WATER: &[u8] = b"high_water";

/// Record values: consumed; reserved (`until`, `rid`); consumed by the
/// commit of reservation `rid`.
const V_CONSUMED: u8 = 1;
const V_RESERVED: u8 = 2;
const V_COMMITTED: u8 = 3;

/// Work for the writer thread. Every decision is made by this one thread,
/// so check-then-write needs no compare-and-swap.
enum Job {
    /// Decide a consumption at `now` (an expired reservation is taken over),
    /// by an attempt (keyed hash) if named.
    Consume(
        LedgerKey,
        u64,
        Option<[u8; 16]>,
        oneshot::Sender<Result<Consumed, String>>,
    ),
    /// Decide a reservation.
    Reserve(
        LedgerKey,
        Lease,
        u64,
        oneshot::Sender<Result<Consumed, String>>,
    ),
    /// Commit a reservation.
    Commit(
        LedgerKey,
        [u8; 16],
        u64,
        oneshot::Sender<Result<Committed, String>>,
    ),
    /// Release a reservation.
    Release(LedgerKey, [u8; 16], oneshot::Sender<Result<(), String>>),
    /// Answer after a flush that starts after this job was queued.
    Barrier(oneshot::Sender<Result<(), String>>),
    /// Raise the horizon to `before`, durably, then remove up to `limit`
    /// records below it.
    Collect {
        before: u64,
        limit: usize,
        reply: oneshot::Sender<Result<usize, String>>,
    },
    /// Record the clock's high-water mark (durable with the next flush).
    HighWater(u64),
}

/// Figures a caller may read (batch sizes show group commit at work; the
/// record count against its bound).
#[derive(Debug, Default)]
pub struct FlushStats {
    pub flushes: AtomicU64,
    pub flushed_waiters: AtomicU64,
    pub max_batch: AtomicU64,
    /// Records the ledger holds now (counted at open, then kept by the
    /// writer: the only thread that adds or removes any).
    pub records: AtomicU64,
    /// The bound on `records` (`u64::MAX`: none).
    pub max_records: AtomicU64,
    /// Consumptions and reservations refused because the ledger was full.
    pub refused_full: AtomicU64,
}

pub struct SledLedger {
    db: sled::Db,
    /// To the writer thread; `None` only while dropping.
    writer: Option<mpsc::Sender<Job>>,
    writer_thread: Option<std::thread::JoinHandle<()>>,
    /// Set for good after a failed write, flush or fdatasync.
    dead: Arc<AtomicBool>,
    stats: Arc<FlushStats>,
    data_file: PathBuf,
    stored_high_water: Option<u64>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for SledLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledLedger").finish_non_exhaustive()
    }
}

fn read_u64(tree: &sled::Tree, key: &[u8]) -> Result<Option<u64>, LedgerError> {
    match tree.get(key) {
        Ok(Some(v)) => <[u8; 8]>::try_from(&v[..])
            .map(|b| Some(u64::from_be_bytes(b)))
            .map_err(|_| LedgerError("corrupt ledger meta record".into())),
        Ok(None) => Ok(None),
        Err(e) => Err(LedgerError(format!("cannot read ledger meta: {e}"))),
    }
}

impl SledLedger {
    /// Opens (or creates) the ledger in `dir`. Fails if another process holds it.
    pub fn open(dir: &Path) -> Result<Self, LedgerError> {
        let db = sled::Config::new()
            .path(dir)
            // sled's page cache; the ledger holds 40-byte keys, so this bounds memory.
            .cache_capacity(16 * 1024 * 1024)
            .open()
            .map_err(|e| LedgerError(format!("cannot open sled ledger: {e}")))?;
        let tree = db
            .open_tree("consumed/v1")
            .map_err(|e| LedgerError(format!("cannot open ledger tree: {e}")))?;
        let meta = db
            .open_tree(META_TREE)
            .map_err(|e| LedgerError(format!("cannot open ledger meta tree: {e}")))?;
        let horizon = read_u64(&meta, META_HORIZON)?.unwrap_or(0);
        let stored_high_water = read_u64(&meta, META_HIGH_WATER)?;
        let data_file = dir.join("db");
        let file = File::open(&data_file)
            .map_err(|e| LedgerError(format!("cannot open ledger data file: {e}")))?;
        let probe = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.join(PROBE_FILE))
            .map_err(|e| LedgerError(format!("cannot open the ledger's probe file: {e}")))?;
        let dead = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(FlushStats::default());
        // sled keeps every live record in memory whatever its cache capacity
        // (about 200 bytes each, measured), so the count is what bounds it.
        stats.records.store(tree.len() as u64, Ordering::Relaxed);
        stats.max_records.store(u64::MAX, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel::<Job>();
        let writer_thread = {
            let mut w = Writer {
                db: db.clone(),
                tree,
                meta,
                file,
                probe,
                probe_len: std::cell::Cell::new(0),
                horizon,
                dead: dead.clone(),
                stats: stats.clone(),
            };
            std::thread::Builder::new()
                .name("stateseal-ledger".into())
                .spawn(move || w.run(&rx))
                .map_err(|e| LedgerError(format!("cannot start the ledger writer: {e}")))?
        };
        Ok(SledLedger {
            db,
            writer: Some(tx),
            writer_thread: Some(writer_thread),
            dead,
            stats,
            data_file,
            stored_high_water,
            clock: Arc::new(WallClock),
        })
    }

    /// The clock that judges whether a reservation's lease ended when a
    /// plain consumption meets it (tests inject a manual clock).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    pub fn stats(&self) -> &FlushStats {
        &self.stats
    }

    /// Bounds the records the ledger may hold: past it, a consumption or
    /// reservation of a key it does not hold is answered [`Consumed::Full`]
    /// (nothing recorded) until garbage collection makes room.
    pub fn with_max_records(self, max: u64) -> Self {
        self.stats.max_records.store(max, Ordering::Relaxed);
        self
    }

    /// The records the ledger holds now.
    pub fn records(&self) -> u64 {
        self.stats.records.load(Ordering::Relaxed)
    }

    fn send(&self, job: Job) -> Result<(), LedgerError> {
        self.writer
            .as_ref()
            .ok_or_else(|| LedgerError("ledger writer stopped".into()))?
            .send(job)
            .map_err(|_| LedgerError("ledger writer stopped".into()))
    }

    async fn ask<T>(
        &self,
        job: impl FnOnce(oneshot::Sender<Result<T, String>>) -> Job,
    ) -> Result<T, LedgerError> {
        let (tx, rx) = oneshot::channel();
        self.send(job(tx))?;
        match rx.await {
            Ok(r) => r.map_err(LedgerError),
            Err(_) => Err(LedgerError("ledger writer stopped".into())),
        }
    }

    /// Waits for a flush that starts after this call.
    async fn durable(&self) -> Result<(), LedgerError> {
        self.ask(Job::Barrier).await
    }
}

impl Drop for SledLedger {
    fn drop(&mut self) {
        // Stop the writer and wait for it, so that sled's lock on the
        // directory is released when the ledger is gone.
        self.writer.take();
        if let Some(t) = self.writer_thread.take() {
            let _ = t.join();
        }
    }
}

struct Writer {
    db: sled::Db,
    tree: sled::Tree,
    meta: sled::Tree,
    file: File,
    /// Resized after every fdatasync (see the module's notes).
    probe: File,
    probe_len: std::cell::Cell<u64>,
    horizon: u64,
    dead: Arc<AtomicBool>,
    stats: Arc<FlushStats>,
}

/// In the ledger directory, beside sled's files.
const PROBE_FILE: &str = "stateseal-probe";

const DEAD: &str = "ledger stopped after an I/O failure; restart the process";

impl Writer {
    fn run(&mut self, rx: &mpsc::Receiver<Job>) {
        // Ends when the ledger (the only sender) is dropped.
        while let Ok(first) = rx.recv() {
            let mut jobs = vec![first];
            jobs.extend(rx.try_iter());
            if self.dead.load(Ordering::SeqCst) {
                refuse(jobs);
                continue;
            }
            let mut decisions = Vec::new();
            let mut barriers = Vec::new();
            let mut collects = Vec::new();
            let mut high_water = None;
            for j in jobs {
                match j {
                    Job::Barrier(r) => barriers.push(r),
                    Job::Collect {
                        before,
                        limit,
                        reply,
                    } => collects.push((before, limit, reply)),
                    Job::HighWater(t) => high_water = high_water.max(Some(t)),
                    other => decisions.push(other),
                }
            }
            let n = (decisions.len() + barriers.len()) as u64;
            let result = self.round(&decisions, high_water);
            if result.is_err() {
                self.dead.store(true, Ordering::SeqCst);
            }
            self.stats.flushes.fetch_add(1, Ordering::Relaxed);
            self.stats.flushed_waiters.fetch_add(n, Ordering::Relaxed);
            self.stats.max_batch.fetch_max(n, Ordering::Relaxed);
            match result {
                Ok(answers) => {
                    for (job, answer) in decisions.into_iter().zip(answers) {
                        answer_job(job, Ok(answer));
                    }
                    for r in barriers {
                        let _ = r.send(Ok(()));
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "sled ledger write failed; refusing every consumption until the process restarts");
                    // Nobody is told "consumed": a key that made it into the
                    // tree stays there, so the token stays burned.
                    for job in decisions {
                        answer_job(job, Err(e.clone()));
                    }
                    for r in barriers {
                        let _ = r.send(Err(e.clone()));
                    }
                }
            }
            for (before, limit, reply) in collects {
                let r = if self.dead.load(Ordering::SeqCst) {
                    Err(DEAD.to_owned())
                } else {
                    self.collect(before, limit)
                };
                if r.is_err() {
                    self.dead.store(true, Ordering::SeqCst);
                }
                let _ = reply.send(r);
            }
        }
    }

    /// Decides the jobs in order (each sees the writes of the ones before it
    /// in this round), writes every change (and the high-water mark) key by
    /// key, flushes once and fdatasyncs.
    fn round(&self, jobs: &[Job], high_water: Option<u64>) -> Result<Vec<Answer>, String> {
        let mut overlay: HashMap<[u8; LedgerKey::LEN], Slot> = HashMap::new();
        let get = |overlay: &HashMap<_, Slot>, k: &[u8; LedgerKey::LEN]| match overlay.get(k) {
            Some(slot) => Ok(slot.now.clone()),
            None => self
                .tree
                .get(k)
                .map(|v| v.map(|v| v.to_vec()))
                .map_err(|e| format!("read failed: {e}")),
        };
        let records = self.stats.records.load(Ordering::Relaxed);
        let max_records = self.stats.max_records.load(Ordering::Relaxed);
        let mut added = 0u64;
        // Room for one more record?
        let mut room = || {
            if records.saturating_add(added) >= max_records {
                self.stats.refused_full.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            added += 1;
            true
        };
        let mut answers = Vec::with_capacity(jobs.len());
        for job in jobs {
            let answer = match job {
                Job::Consume(key, ..) | Job::Reserve(key, ..) if key.expires_at < self.horizon => {
                    Answer::Consumed(Consumed::PastHorizon)
                }
                Job::Consume(key, now, attempt, _) => {
                    let k = key.to_bytes();
                    let same = |a: Option<[u8; 16]>| attempt.is_some() && a == *attempt;
                    let record = Record::decode(get(&overlay, &k)?.as_deref());
                    let c = match record {
                        Record::Absent if !room() => Consumed::Full,
                        Record::Absent => Consumed::Now,
                        Record::Reserved { until, .. } if until < *now => Consumed::Now,
                        Record::Reserved { .. } => Consumed::InUse,
                        Record::Consumed { attempt: a } | Record::Committed { attempt: a, .. }
                            if same(a) =>
                        {
                            Consumed::Again(None)
                        }
                        Record::Consumed { .. } | Record::Committed { .. } => Consumed::Before,
                    };
                    if c == Consumed::Now {
                        let mut v = vec![V_CONSUMED];
                        v.extend(attempt.iter().flatten());
                        Slot::write(&mut overlay, k, &record, Some(v));
                    }
                    Answer::Consumed(c)
                }
                Job::Reserve(key, lease, now, _) => {
                    let k = key.to_bytes();
                    let record = Record::decode(get(&overlay, &k)?.as_deref());
                    let c = match record {
                        Record::Absent if !room() => Consumed::Full,
                        Record::Absent => Consumed::Now,
                        Record::Reserved { until, .. } if until < *now => Consumed::Now,
                        Record::Reserved {
                            until,
                            rid,
                            attempt: a,
                        } if lease.attempt.is_some() && a == lease.attempt => {
                            Consumed::Again(Some(Lease {
                                rid,
                                until,
                                attempt: a,
                            }))
                        }
                        Record::Reserved { .. } => Consumed::InUse,
                        Record::Consumed { .. } | Record::Committed { .. } => Consumed::Before,
                    };
                    if c == Consumed::Now {
                        let mut v = vec![V_RESERVED];
                        v.extend_from_slice(&lease.until.to_be_bytes());
                        v.extend_from_slice(&lease.rid);
                        v.extend(lease.attempt.iter().flatten());
                        Slot::write(&mut overlay, k, &record, Some(v));
                    }
                    Answer::Consumed(c)
                }
                Job::Commit(key, rid, now, _) => {
                    let k = key.to_bytes();
                    let record = Record::decode(get(&overlay, &k)?.as_deref());
                    let c = match record {
                        Record::Reserved {
                            until,
                            rid: r,
                            attempt,
                        } if r == *rid && until >= *now => {
                            let mut v = vec![V_COMMITTED];
                            v.extend_from_slice(rid);
                            v.extend(attempt.iter().flatten());
                            Slot::write(&mut overlay, k, &record, Some(v));
                            Committed::Done
                        }
                        Record::Committed { rid: r, .. } if r == *rid => Committed::Done,
                        _ => Committed::LeaseLost,
                    };
                    Answer::Committed(c)
                }
                Job::Release(key, rid, _) => {
                    let k = key.to_bytes();
                    let record = Record::decode(get(&overlay, &k)?.as_deref());
                    if let Record::Reserved { rid: r, .. } = record {
                        if r == *rid {
                            Slot::write(&mut overlay, k, &record, None);
                        }
                    }
                    Answer::Released
                }
                // Classified out by `run`.
                Job::Barrier(_) | Job::Collect { .. } | Job::HighWater(_) => Answer::Released,
            };
            answers.push(answer);
        }
        let (mut plus, mut minus) = (0u64, 0u64);
        for (k, slot) in overlay {
            match slot.now {
                Some(v) => {
                    plus += u64::from(!slot.was);
                    self.tree.insert(&k[..], v).map(|_| ())
                }
                None => {
                    minus += u64::from(slot.was);
                    self.tree.remove(&k[..]).map(|_| ())
                }
            }
            .map_err(|e| format!("write failed: {e}"))?;
        }
        if let Some(t) = high_water {
            self.meta
                .insert(META_HIGH_WATER, &t.to_be_bytes()[..])
                .map_err(|e| format!("meta write failed: {e}"))?;
        }
        self.sync()?;
        self.stats.records.store(
            records.saturating_add(plus).saturating_sub(minus),
            Ordering::Relaxed,
        );
        Ok(answers)
    }

    fn sync(&self) -> Result<(), String> {
        self.db.flush().map_err(|e| format!("flush failed: {e}"))?;
        self.file
            .sync_data()
            .map_err(|e| format!("fdatasync failed: {e}"))?;
        // A journalled metadata change: fails if the filesystem's journal was
        // aborted, even when the fdatasync above raced the abort and said 0.
        self.probe_len.set(self.probe_len.get() ^ 1);
        self.probe
            .set_len(self.probe_len.get())
            .map_err(|e| format!("filesystem check after fdatasync failed: {e}"))
    }

    /// Raises the horizon durably, then removes records below it.
    fn collect(&mut self, before: u64, limit: usize) -> Result<usize, String> {
        if before > self.horizon {
            self.meta
                .insert(META_HORIZON, &before.to_be_bytes()[..])
                .map_err(|e| format!("meta write failed: {e}"))?;
            self.sync()?;
            self.horizon = before;
        }
        let end = self.horizon.to_be_bytes();
        let mut n = 0;
        for item in self.tree.range(..&end[..]).keys().take(limit) {
            let k = item.map_err(|e| format!("scan failed: {e}"))?;
            let was = self
                .tree
                .remove(k)
                .map_err(|e| format!("remove failed: {e}"))?;
            n += 1;
            if was.is_some() {
                self.stats.records.fetch_sub(1, Ordering::Relaxed);
            }
        }
        // Removals need no flush of their own: one lost in a crash is
        // removed again later, and the horizon already refuses its key.
        Ok(n)
    }
}

/// A key a round writes: whether the tree held it before the round (so the
/// round knows how many records it adds and removes), and its new value
/// (`None`: removed).
struct Slot {
    was: bool,
    now: Option<Vec<u8>>,
}

impl Slot {
    /// Writes `now` for `k`, whose value this round read as `read`: from
    /// the tree when the round had not written `k` yet.
    fn write(
        overlay: &mut HashMap<[u8; LedgerKey::LEN], Slot>,
        k: [u8; LedgerKey::LEN],
        read: &Record,
        now: Option<Vec<u8>>,
    ) {
        overlay
            .entry(k)
            .or_insert(Slot {
                was: !matches!(read, Record::Absent),
                now: None,
            })
            .now = now;
    }
}

/// A decision's answer, to go back to its job's caller.
enum Answer {
    Consumed(Consumed),
    Committed(Committed),
    Released,
}

fn answer_job(job: Job, answer: Result<Answer, String>) {
    match (job, answer) {
        (Job::Consume(_, _, _, r) | Job::Reserve(_, _, _, r), a) => {
            let _ = r.send(a.and_then(|a| match a {
                Answer::Consumed(c) => Ok(c),
                _ => Err("internal: mismatched answer".into()),
            }));
        }
        (Job::Commit(_, _, _, r), a) => {
            let _ = r.send(a.and_then(|a| match a {
                Answer::Committed(c) => Ok(c),
                _ => Err("internal: mismatched answer".into()),
            }));
        }
        (Job::Release(_, _, r), a) => {
            let _ = r.send(a.map(|_| ()));
        }
        (Job::Barrier(r), a) => {
            let _ = r.send(a.map(|_| ()));
        }
        (Job::Collect { reply, .. }, a) => {
            let _ = reply.send(a.map(|_| 0));
        }
        (Job::HighWater(_), _) => {}
    }
}

/// A record's value, decoded. Each kind may end with the 16-byte keyed hash
/// of the attempt that made it.
enum Record {
    Absent,
    Consumed {
        attempt: Option<[u8; 16]>,
    },
    Reserved {
        until: u64,
        rid: [u8; 16],
        attempt: Option<[u8; 16]>,
    },
    Committed {
        rid: [u8; 16],
        attempt: Option<[u8; 16]>,
    },
}

fn arr16(b: &[u8]) -> [u8; 16] {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[..16]);
    a
}

impl Record {
    fn decode(v: Option<&[u8]>) -> Record {
        let attempt = |rest: &[u8], at: usize| (rest.len() == at + 16).then(|| arr16(&rest[at..]));
        match v {
            None => Record::Absent,
            Some([V_RESERVED, rest @ ..]) if rest.len() == 24 || rest.len() == 40 => {
                let mut until = [0u8; 8];
                until.copy_from_slice(&rest[..8]);
                Record::Reserved {
                    until: u64::from_be_bytes(until),
                    rid: arr16(&rest[8..24]),
                    attempt: attempt(rest, 24),
                }
            }
            Some([V_COMMITTED, rest @ ..]) if rest.len() == 16 || rest.len() == 32 => {
                Record::Committed {
                    rid: arr16(&rest[..16]),
                    attempt: attempt(rest, 16),
                }
            }
            Some([V_CONSUMED, rest @ ..]) if rest.len() == 16 => Record::Consumed {
                attempt: Some(arr16(rest)),
            },
            // V_CONSUMED, and anything unexpected: consumed (fail closed).
            Some(_) => Record::Consumed { attempt: None },
        }
    }
}

fn refuse(jobs: Vec<Job>) {
    for j in jobs {
        match j {
            Job::Consume(_, _, _, r) | Job::Reserve(_, _, _, r) => {
                let _ = r.send(Err(DEAD.to_owned()));
            }
            Job::Commit(_, _, _, r) => {
                let _ = r.send(Err(DEAD.to_owned()));
            }
            Job::Release(_, _, r) => {
                let _ = r.send(Err(DEAD.to_owned()));
            }
            Job::Barrier(r) => {
                let _ = r.send(Err(DEAD.to_owned()));
            }
            Job::Collect { reply, .. } => {
                let _ = reply.send(Err(DEAD.to_owned()));
            }
            Job::HighWater(_) => {}
        }
    }
}

#[async_trait::async_trait]
impl Ledger for SledLedger {
    async fn consume_as(
        &self,
        key: &LedgerKey,
        attempt: Option<[u8; 16]>,
    ) -> Result<Consumed, LedgerError> {
        let (key, now) = (*key, self.clock.now_unix());
        self.ask(|r| Job::Consume(key, now, attempt, r)).await
    }

    async fn reserve(
        &self,
        key: &LedgerKey,
        lease: Lease,
        now: u64,
    ) -> Result<Consumed, LedgerError> {
        let key = *key;
        self.ask(|r| Job::Reserve(key, lease, now, r)).await
    }

    async fn commit(
        &self,
        key: &LedgerKey,
        rid: [u8; 16],
        now: u64,
    ) -> Result<Committed, LedgerError> {
        let key = *key;
        self.ask(|r| Job::Commit(key, rid, now, r)).await
    }

    async fn release(&self, key: &LedgerKey, rid: [u8; 16]) -> Result<(), LedgerError> {
        let key = *key;
        self.ask(|r| Job::Release(key, rid, r)).await
    }

    async fn ready(&self) -> bool {
        // A dead writer never comes back in this process.
        !self.dead.load(Ordering::SeqCst)
    }

    async fn remove_expired(&self, before_unix: u64, limit: usize) -> Result<usize, LedgerError> {
        self.ask(|reply| Job::Collect {
            before: before_unix,
            limit,
            reply,
        })
        .await
    }

    async fn close(&self) -> Result<(), LedgerError> {
        let flushes = self.stats.flushes.load(Ordering::Relaxed);
        let waiters = self.stats.flushed_waiters.load(Ordering::Relaxed);
        tracing::info!(
            flushes,
            consumptions = waiters,
            max_batch = self.stats.max_batch.load(Ordering::Relaxed),
            "sled ledger group commit"
        );
        self.durable().await?;
        let _ = self.db.flush_async().await;
        File::open(&self.data_file)
            .and_then(|f| f.sync_data())
            .map_err(|e| LedgerError(format!("final fdatasync failed: {e}")))
    }

    fn backend(&self) -> &'static str {
        "sled"
    }

    fn flush_stats(&self) -> Option<Arc<FlushStats>> {
        Some(self.stats.clone())
    }

    async fn record_high_water(&self, now_unix: u64) -> Result<(), LedgerError> {
        self.send(Job::HighWater(now_unix))
    }

    fn stored_high_water(&self) -> Option<u64> {
        self.stored_high_water
    }

    fn failed_for_good(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }
}
