//! The embedded sled ledger, for one replica.
//!
//! One writer thread owns every consumption: callers hand it their key and
//! wait; it takes everything that queued up while its previous round ran
//! (group commit), decides each key (absent from the tree and not earlier
//! in this round → consumed now; otherwise consumed before), writes the
//! round's changes as one record of the ledger's journal, `fdatasync`s it,
//! then applies them to sled, and only then answers. N concurrent
//! consumptions cost one write and one `fdatasync`, not N. A single writer
//! makes check-then-insert atomic without a per-key compare-and-swap (the
//! garbage collector only ever removes records that expired, which no open
//! can ask about). A round that changes nothing answers without writing:
//! what it read, earlier rounds made durable before they answered (but for
//! the collector's removals of expired records and ended leases, which are
//! not journaled: one may be undone by a crash, and is removed again later;
//! neither kind can be consumed afresh).
//!
//! sled itself is not flushed per round (nor by its own flusher, which is
//! off): a flush hands sled's log write to its thread pool and waits for
//! it, which cost more than the `fdatasync` (docs/performance.md). The
//! journal (journal.rs) holds every round since the last checkpoint; at
//! start it is replayed into sled, which is then flushed and `fdatasync`ed
//! before the journal starts afresh. A checkpoint (sled flushed, its file
//! `fdatasync`ed, the probe) also runs when the journal is full and at
//! least every five seconds while rounds come; the garbage collector's horizon
//! is written into sled and flushed as before. A crash
//! in the middle of a round keeps the round's record or not; either way
//! nothing of it was acknowledged, and a token whose record was replayed
//! stays burned (the same attempt, named by its attempt id, gets its
//! success again). A round too large for the journal is written into sled
//! and flushed instead.
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
//! recovers from its log and the ledger's journal: everything acknowledged
//! was fsynced before its answer.
//!
//! fsync's answer alone is not enough: on ext4, an `fdatasync` that races the
//! abort of the filesystem's own journal after an error can return success and the write is
//! still lost (reproduced by `tests/data/fsync_abort_race.py`; the trials
//! and the kernel they ran on are in docs/operations.md, "fsync's answer is
//! checked too"). So after each `fdatasync` the writer changes the size
//! of a probe file in the ledger directory (0 ↔ 1 byte): a size change must
//! start a journal transaction and reports its failure, and the journal is
//! marked aborted before any such fsync returns. A failed probe fails the
//! round like a failed fsync (fail-stop, nothing acknowledged); with the
//! probe the same script loses nothing acknowledged (same section).

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use tokio::sync::oneshot;

use super::journal::{self, Change, Journal};
use super::{
    Consumed, FlushStats, Held, Lease, LeaseAsk, LeaseEnd, Ledger, LedgerError, LedgerKey,
    Reserved, TenantTag,
};
use crate::clock::guard::{Reference, ReferenceError};
use crate::clock::{Clock, MonotonicClock};

/// Meta records: the horizon and the clock's high-water mark.
const META_TREE: &str = "meta/v1";
const META_HORIZON: &[u8] = b"gc_horizon";
const META_HIGH_WATER: &[u8] = b"high_water";

/// Record values: consumed; reserved (`until`, `rid`); consumed by the
/// commit of reservation `rid`. With [`V_TAGGED`] set, the kind byte is
/// followed by the owner's 8-byte [`TenantTag`] (every record written
/// today; records of earlier versions have none and count against the
/// total bound only).
const V_CONSUMED: u8 = 1;
const V_RESERVED: u8 = 2;
const V_COMMITTED: u8 = 3;
const V_TAGGED: u8 = 0x80;

/// Work for the writer thread. Every decision is made by this one thread,
/// so check-then-write needs no compare-and-swap. `now` is the ledger's
/// clock ([`MonotonicClock`] unless a test injects one), which judges every
/// lease of this ledger.
enum Job {
    /// Decide a consumption (an ended lease is taken over), by an attempt
    /// (keyed hash) if named.
    Consume {
        key: LedgerKey,
        now: u64,
        attempt: Option<[u8; 16]>,
        reply: oneshot::Sender<Result<Consumed, LedgerError>>,
    },
    /// Decide a reservation.
    Reserve {
        key: LedgerKey,
        ask: LeaseAsk,
        now: u64,
        reply: oneshot::Sender<Result<Reserved, LedgerError>>,
    },
    /// Extend a reservation's lease.
    Renew {
        key: LedgerKey,
        rid: [u8; 16],
        seconds: u32,
        cap: u64,
        now: u64,
        reply: oneshot::Sender<Result<Held, LedgerError>>,
    },
    /// Commit a reservation.
    Commit {
        key: LedgerKey,
        rid: [u8; 16],
        reply: oneshot::Sender<Result<Held, LedgerError>>,
    },
    /// Release a reservation.
    Release {
        key: LedgerKey,
        rid: [u8; 16],
        reply: oneshot::Sender<Result<(), LedgerError>>,
    },
    /// Answer once every round decided before it is durable.
    Barrier(oneshot::Sender<Result<(), LedgerError>>),
    /// Raise the horizon to `before`, durably, then remove up to `limit`
    /// records below it and up to `limit` reservations whose lease ended
    /// before it.
    Collect {
        before: u64,
        /// Reservations are collected once their lease ended before this,
        /// by the ledger's clock.
        lease_before: u64,
        limit: usize,
        reply: oneshot::Sender<Result<usize, LedgerError>>,
    },
    /// Record the clock's high-water mark (durable with the next flush).
    HighWater(u64),
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
            .map_err(|_| LedgerError::Corrupt("ledger meta record")),
        Ok(None) => Ok(None),
        Err(e) => Err(LedgerError::storage("read ledger meta", e)),
    }
}

/// sled 0.34 writes a snapshot to `snap.<LSN>.generating`, syncs it and
/// only then renames it; a write cut short (a full disk, a crash) leaves
/// an unfinished file, which sled's next open takes for the latest
/// snapshot and refuses as corrupt, for ever. Such a file holds nothing
/// the log does not: it is removed before sled opens. A `.generating` file
/// that passes sled's own check (its CRC-32 over the bytes before its
/// length and checksum) is complete — a crash between the sync and the
/// rename — and may be the only good snapshot: it stays, for sled to read.
fn drop_unfinished_snapshots(dir: &Path) -> Result<(), LedgerError> {
    let listing = |e| LedgerError::storage("read the ledger directory", e);
    match std::fs::read_dir(dir) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(listing(e)),
    }
    // Only while no other process holds the store: sled opens `db` (created
    // if absent) and locks it with flock; so does this, held until done.
    // Another's snapshot may be generating.
    let db = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .write(true)
        .truncate(false)
        .open(dir.join("db"))
        .map_err(|e| LedgerError::storage("open the ledger's db file", e))?;
    if rustix::fs::flock(&db, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
        // sled's own open reports the holder.
        return Ok(());
    }
    for entry in std::fs::read_dir(dir).map_err(listing)? {
        let entry = entry.map_err(listing)?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with("snap.") && name.ends_with(".generating")) {
            continue;
        }
        let bytes = std::fs::read(entry.path())
            .map_err(|e| LedgerError::storage("read an unfinished sled snapshot", e))?;
        if snapshot_is_complete(&bytes) {
            tracing::info!(file = %name, "sled ledger: kept a complete snapshot that was not yet renamed");
            continue;
        }
        std::fs::remove_file(entry.path())
            .map_err(|e| LedgerError::storage("remove an unfinished sled snapshot", e))?;
        tracing::warn!(file = %name, "sled ledger: removed an unfinished snapshot");
    }
    drop(db);
    Ok(())
}

/// sled 0.34's check of a snapshot file: the bytes, their length (8 bytes)
/// and a CRC-32 of the bytes (4 bytes, little-endian).
fn snapshot_is_complete(file: &[u8]) -> bool {
    let len = file.len();
    if len <= 12 {
        return false;
    }
    let want = u32::from_le_bytes([file[len - 4], file[len - 3], file[len - 2], file[len - 1]]);
    crc32fast::hash(&file[..len - 12]) == want
}

impl SledLedger {
    /// Opens (or creates) the ledger in `dir`. Fails if another process holds it.
    pub fn open(dir: &Path) -> Result<Self, LedgerError> {
        drop_unfinished_snapshots(dir)?;
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(CACHE_BYTES)
            // The journal makes rounds durable; sled is flushed at
            // checkpoints only (journal.rs).
            .flush_every_ms(None)
            .open()
            .map_err(|e| LedgerError::storage("open sled ledger", e))?;
        let tree = db
            .open_tree("consumed/v1")
            .map_err(|e| LedgerError::storage("open ledger tree", e))?;
        let meta = db
            .open_tree(META_TREE)
            .map_err(|e| LedgerError::storage("open ledger meta tree", e))?;
        let data_file = dir.join("db");
        let file =
            File::open(&data_file).map_err(|e| LedgerError::storage("open ledger data file", e))?;
        let probe = Probe::open(dir)?;
        // Rounds acknowledged since the last checkpoint, into sled again;
        // then durable there, and only then does the journal start afresh.
        let (mut journal, replayed) = Journal::open(dir, |c| apply(&tree, &meta, &c))?;
        if replayed > 0 {
            make_durable(&db, &file, &probe)?;
            journal.rotate()?;
            tracing::info!(rounds = replayed, "sled ledger: journal replayed");
        }
        let horizon = read_u64(&meta, META_HORIZON)?.unwrap_or(0);
        let stored_high_water = read_u64(&meta, META_HIGH_WATER)?;
        let dead = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(FlushStats::default());
        // sled keeps every live record in memory whatever its cache capacity
        // (about 200 bytes each, measured), so the count is what bounds it.
        stats.records.store(tree.len() as u64, Ordering::Relaxed);
        stats.max_records.store(u64::MAX, Ordering::Relaxed);
        stats.max_tenant_records.store(u64::MAX, Ordering::Relaxed);
        // Each tenant's records and every held lease, from the records.
        let mut tenants: HashMap<TenantTag, u64> = HashMap::new();
        let mut leases = BTreeSet::new();
        for item in tree.iter() {
            let (k, v) = item.map_err(|e| LedgerError::storage("scan the ledger", e))?;
            let (record, tag) = Record::decode(Some(&v));
            if let Some(t) = tag {
                *tenants.entry(t).or_default() += 1;
            }
            if let (Record::Reserved { until, .. }, Ok(k)) =
                (record, <[u8; LedgerKey::LEN]>::try_from(&k[..]))
            {
                leases.insert((until, k));
            }
        }
        stats.top_tenant_records.store(
            tenants.values().copied().max().unwrap_or(0),
            Ordering::Relaxed,
        );
        let (tx, rx) = mpsc::channel::<Job>();
        let writer_thread = {
            let mut w = Writer {
                db: db.clone(),
                tree,
                meta,
                file,
                journal,
                probe,
                checkpointed: std::time::Instant::now(),
                horizon,
                dead: dead.clone(),
                stats: stats.clone(),
                tenants,
                inherited: leases.iter().map(|(_, k)| *k).collect(),
                leases,
            };
            std::thread::Builder::new()
                .name("stateseal-ledger".into())
                .spawn(move || w.run(&rx))
                .map_err(|e| LedgerError::storage("start the ledger writer", e))?
        };
        Ok(SledLedger {
            db,
            writer: Some(tx),
            writer_thread: Some(writer_thread),
            dead,
            stats,
            data_file,
            stored_high_water,
            clock: Arc::new(MonotonicClock::new()),
        })
    }

    /// The clock that judges every lease: when one is granted or renewed,
    /// and whether it ended when a reservation or a plain consumption meets
    /// it. By default a [`MonotonicClock`] made at open (tests inject a
    /// manual clock).
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

    /// Bounds the records of any one tenant (its share of
    /// `--max-ledger-records`): a tenant at its bound gets
    /// [`Consumed::Full`] for a key it does not hold yet, and no other
    /// tenant is affected.
    pub fn with_max_tenant_records(self, max: u64) -> Self {
        self.stats.max_tenant_records.store(max, Ordering::Relaxed);
        self
    }

    /// Divides the record bound among `tenants` (the default share, set
    /// again at each reload of the tenants file): each tenant may hold
    /// `max_records / tenants`, so that no set of tenants can take the
    /// room the others are given, however few of them are busy.
    pub fn with_share_among(self, tenants: u64) -> Self {
        self.stats.share_by_tenants.store(true, Ordering::Relaxed);
        self.share_among(tenants);
        self
    }

    /// Lengthens by `seconds` every lease that an earlier process granted
    /// (held in the store at open and not written since), when this
    /// process judges whether it ended; the holder is still told the
    /// recorded end. That process judged its leases by its own
    /// [`MonotonicClock`], anchored to the wall clock when it opened, which
    /// the operator keeps within `--clock-skew` of the true time
    /// (docs/operations.md, Clocks), as this one's: a lease it granted may
    /// end up to twice the skew early by this process's clock
    /// (`tests/it/at_most_once.rs`). The server sets twice the skew.
    pub fn with_inherited_lease_grace(self, seconds: u64) -> Self {
        self.stats
            .inherited_lease_grace
            .store(seconds, Ordering::Relaxed);
        self
    }

    /// Collects a reservation only once its lease ended `seconds` ago by
    /// the ledger's own clock (which judges leases), whatever the wall
    /// clock that sets the collection horizon says. The server sets the
    /// clock skew.
    pub fn with_lease_collection_margin(self, seconds: u64) -> Self {
        self.stats
            .lease_collection_margin
            .store(seconds, Ordering::Relaxed);
        self.stats
            .lease_collection_by_own_clock
            .store(true, Ordering::Relaxed);
        self
    }

    /// The records the ledger holds now.
    pub fn records(&self) -> u64 {
        self.stats.records.load(Ordering::Relaxed)
    }

    fn send(&self, job: Job) -> Result<(), LedgerError> {
        self.writer
            .as_ref()
            .ok_or(LedgerError::Stopped("ledger writer"))?
            .send(job)
            .map_err(|_| LedgerError::Stopped("ledger writer"))
    }

    async fn ask<T>(
        &self,
        job: impl FnOnce(oneshot::Sender<Result<T, LedgerError>>) -> Job,
    ) -> Result<T, LedgerError> {
        let (tx, rx) = oneshot::channel();
        self.send(job(tx))?;
        match rx.await {
            Ok(r) => r,
            Err(_) => Err(LedgerError::Stopped("ledger writer")),
        }
    }

    /// Waits until every round decided before this call is durable.
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
    journal: Journal,
    /// When sled was last made durable on its own (see `durable_round`).
    checkpointed: std::time::Instant,
    probe: Probe,
    horizon: u64,
    dead: Arc<AtomicBool>,
    stats: Arc<FlushStats>,
    /// Records per tenant (tagged records only).
    tenants: HashMap<TenantTag, u64>,
    /// Every reservation the tree holds, by the end of its lease: what
    /// garbage collection frees early.
    leases: BTreeSet<(u64, [u8; LedgerKey::LEN])>,
    /// The reservations an earlier process wrote, not written since: their
    /// leases end `stats.inherited_lease_grace` later.
    inherited: std::collections::HashSet<[u8; LedgerKey::LEN]>,
}

/// sled's page cache; the ledger holds 40-byte keys, so this bounds memory
/// (live records are kept apart from it: see `open`).
const CACHE_BYTES: u64 = 16 * 1024 * 1024;

/// In the ledger directory, beside sled's files.
const PROBE_FILE: &str = "stateseal-probe";
/// The most jobs one round decides: a change is at most 6 + 40 + 50 bytes
/// in the journal, so a round's record stays under 1 MiB.
const MAX_ROUND: usize = 8192;
/// The longest a round goes without a checkpoint after the last one.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

impl Writer {
    fn run(&mut self, rx: &mpsc::Receiver<Job>) {
        // Ends when the ledger (the only sender) is dropped.
        while let Ok(first) = rx.recv() {
            // At most MAX_ROUND per round (the rest wait for the next), so
            // that a round's journal record always fits in the journal.
            let jobs = super::gather(first, rx.try_iter(), MAX_ROUND);
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
                        lease_before,
                        limit,
                        reply,
                    } => collects.push((before, lease_before, limit, reply)),
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
            for (before, lease_before, limit, reply) in collects {
                let r = if self.dead.load(Ordering::SeqCst) {
                    Err(LedgerError::FailedForGood)
                } else {
                    self.collect(before, lease_before, limit)
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
    fn round(&mut self, jobs: &[Job], high_water: Option<u64>) -> Result<Vec<Answer>, LedgerError> {
        let mut overlay: HashMap<[u8; LedgerKey::LEN], Slot> = HashMap::new();
        let tree = &self.tree;
        // The end of a lease as this process judges it: later by the grace
        // for one an earlier process granted and nobody wrote since.
        let (inherited, grace) = (
            &self.inherited,
            self.stats.inherited_lease_grace.load(Ordering::Relaxed),
        );
        let ends = |overlay: &HashMap<_, Slot>, k: &[u8; LedgerKey::LEN], until: u64| {
            if !overlay.contains_key(k) && inherited.contains(k) {
                until.saturating_add(grace)
            } else {
                until
            }
        };
        let get = |overlay: &HashMap<_, Slot>, k: &[u8; LedgerKey::LEN]| match overlay.get(k) {
            Some(slot) => Ok(slot.now.clone()),
            None => tree
                .get(k)
                .map(|v| v.map(|v| v.to_vec()))
                .map_err(|e| LedgerError::storage("read", e)),
        };
        let mut room = Room {
            stats: &self.stats,
            tenants: &self.tenants,
            records: self.stats.records.load(Ordering::Relaxed),
            max_records: self.stats.max_records.load(Ordering::Relaxed),
            max_tenant: self.stats.max_tenant_records.load(Ordering::Relaxed),
            added: 0,
            added_by: HashMap::new(),
        };
        let mut answers = Vec::with_capacity(jobs.len());
        for job in jobs {
            let answer = match job {
                Job::Consume { key, .. } | Job::Reserve { key, .. }
                    if key.expires_at < self.horizon =>
                {
                    match job {
                        Job::Reserve { .. } => Answer::Reserved(Reserved::PastHorizon),
                        _ => Answer::Consumed(Consumed::PastHorizon),
                    }
                }
                Job::Consume {
                    key, now, attempt, ..
                } => {
                    let k = key.to_bytes();
                    let raw = get(&overlay, &k)?;
                    let (record, _) = Record::decode(raw.as_deref());
                    let c = match record {
                        Record::Absent if !room.take(key.tenant) => Consumed::Full,
                        Record::Absent => Consumed::Now,
                        Record::Reserved { until, .. } if ends(&overlay, &k, until) < *now => {
                            Consumed::Now
                        }
                        Record::Reserved { .. } => Consumed::InUse,
                        Record::Consumed { attempt: a } if attempt.is_some() && a == *attempt => {
                            Consumed::Again
                        }
                        // An attempt ends with its Commit: Before for all.
                        Record::Consumed { .. } | Record::Committed { .. } => Consumed::Before,
                    };
                    if c == Consumed::Now {
                        let mut v = tagged(V_CONSUMED, key.tenant);
                        v.extend(attempt.iter().flatten());
                        Slot::write(&mut overlay, k, &raw, Some(v));
                    }
                    Answer::Consumed(c)
                }
                Job::Reserve { key, ask, now, .. } => {
                    let k = key.to_bytes();
                    let raw = get(&overlay, &k)?;
                    let (record, _) = Record::decode(raw.as_deref());
                    let lease = Lease {
                        rid: ask.rid,
                        end: LeaseEnd::from(*now, ask.seconds, ask.cap),
                        attempt: ask.attempt,
                    };
                    let c = match record {
                        Record::Absent if !room.take(key.tenant) => Reserved::Full,
                        Record::Absent => Reserved::Now(lease),
                        Record::Reserved { until, .. } if ends(&overlay, &k, until) < *now => {
                            Reserved::Now(lease)
                        }
                        Record::Reserved {
                            until,
                            rid,
                            attempt: a,
                        } if ask.attempt.is_some() && a == ask.attempt => Reserved::Again(Lease {
                            rid,
                            // The recorded end, grace or not: a grace is
                            // not written, so a later process may judge it
                            // by another anchor; telling the holder less is
                            // safe.
                            end: LeaseEnd::from(*now, u32::MAX, until),
                            attempt: a,
                        }),
                        Record::Reserved { .. } => Reserved::InUse,
                        Record::Consumed { .. } | Record::Committed { .. } => Reserved::Before,
                    };
                    if let Reserved::Now(l) = c {
                        Slot::write(&mut overlay, k, &raw, Some(reserved_value(key, &l)));
                    }
                    Answer::Reserved(c)
                }
                Job::Renew {
                    key,
                    rid,
                    seconds,
                    cap,
                    now,
                    ..
                } => {
                    let k = key.to_bytes();
                    let raw = get(&overlay, &k)?;
                    let (record, _) = Record::decode(raw.as_deref());
                    let c = match record {
                        Record::Reserved {
                            rid: r,
                            attempt,
                            until,
                        } if r == *rid => {
                            // Never shorter than the lease it extends
                            // (its holder was told that end).
                            let mut end = LeaseEnd::from(*now, *seconds, *cap);
                            if end.until < until {
                                end = LeaseEnd::from(*now, u32::MAX, until);
                            }
                            let lease = Lease {
                                rid: r,
                                end,
                                attempt,
                            };
                            Slot::write(&mut overlay, k, &raw, Some(reserved_value(key, &lease)));
                            Held::Yes(Some(lease.end))
                        }
                        _ => Held::Lost,
                    };
                    Answer::Held(c)
                }
                Job::Commit { key, rid, .. } => {
                    let k = key.to_bytes();
                    let raw = get(&overlay, &k)?;
                    let (record, _) = Record::decode(raw.as_deref());
                    let c = match record {
                        // Whether or not its lease ended: nobody took it over.
                        Record::Reserved { rid: r, .. } if r == *rid => {
                            // The attempt is over: not kept.
                            let mut v = tagged(V_COMMITTED, key.tenant);
                            v.extend_from_slice(rid);
                            Slot::write(&mut overlay, k, &raw, Some(v));
                            Held::Yes(None)
                        }
                        Record::Committed { rid: r, .. } if r == *rid => Held::Yes(None),
                        _ => Held::Lost,
                    };
                    Answer::Held(c)
                }
                Job::Release { key, rid, .. } => {
                    let k = key.to_bytes();
                    let raw = get(&overlay, &k)?;
                    let (record, _) = Record::decode(raw.as_deref());
                    if let Record::Reserved { rid: r, .. } = record {
                        if r == *rid {
                            Slot::write(&mut overlay, k, &raw, None);
                        }
                    }
                    Answer::Released
                }
                // Classified out by `run`.
                Job::Barrier(_) | Job::Collect { .. } | Job::HighWater(_) => Answer::Released,
            };
            answers.push(answer);
        }
        let high_water = high_water.map(u64::to_be_bytes);
        let changes: Vec<Change<'_>> = overlay
            .iter()
            .map(|(k, slot)| Change {
                tree: journal::Tree::Records,
                key: &k[..],
                value: slot.now.as_deref(),
            })
            .chain(high_water.as_ref().map(|t| Change {
                tree: journal::Tree::Meta,
                key: META_HIGH_WATER,
                value: Some(&t[..]),
            }))
            .collect();
        // A round that changes nothing answers from what earlier rounds
        // made durable before they answered.
        if !changes.is_empty() {
            self.durable_round(&changes)?;
        }
        drop(changes);
        for (k, slot) in overlay {
            self.account(k, slot.was, slot.now.as_deref());
        }
        Ok(answers)
    }

    /// Makes a round's changes durable, then applies them to sled: one
    /// journal record and its `fdatasync` (after a checkpoint when the
    /// journal is full). A round too large for the journal itself is
    /// written into sled and flushed, as every round was before it.
    fn durable_round(&mut self, changes: &[Change<'_>]) -> Result<(), LedgerError> {
        let fits = match self.journal.encode(changes) {
            None => {
                self.checkpoint()?;
                self.journal.encode(changes)
            }
            fits => fits,
        };
        if fits == Some(true) {
            self.journal.write()?;
            self.probe.check()?;
            for c in changes {
                apply(&self.tree, &self.meta, c)?;
            }
            // sled writes its log buffers out by itself when they fill
            // (with `sync_file_range`, no `fdatasync`), and may then reuse
            // the space of what it moved: a checkpoint at least every five
            // seconds (ext4's own commit interval) bounds how long such
            // writes wait for an `fdatasync` of sled's file and its size.
            // Every second measured lower: reserve 0.33 × noop against
            // 0.39-0.46 without it.
            if self.checkpointed.elapsed() >= CHECKPOINT_EVERY {
                self.checkpoint()?;
            }
        } else {
            // Straight into sled and made durable there; and a checkpoint,
            // so that no older record of this epoch is replayed over it.
            for c in changes {
                apply(&self.tree, &self.meta, c)?;
            }
            self.checkpoint()?;
        }
        Ok(())
    }

    /// Makes sled durable on its own, then starts the journal's next epoch.
    fn checkpoint(&mut self) -> Result<(), LedgerError> {
        self.sync()?;
        self.journal.rotate()?;
        self.checkpointed = std::time::Instant::now();
        Ok(())
    }

    /// Keeps the counts and the lease index in step with a record of `k`
    /// that was `was` and is now `now` (written durably).
    fn account(&mut self, k: [u8; LedgerKey::LEN], was: Option<Vec<u8>>, now: Option<&[u8]>) {
        // Written by this process from now on.
        self.inherited.remove(&k);
        let (before, before_tag) = Record::decode(was.as_deref());
        let (after, after_tag) = Record::decode(now);
        if let Record::Reserved { until, .. } = before {
            self.leases.remove(&(until, k));
        }
        if let Record::Reserved { until, .. } = after {
            self.leases.insert((until, k));
        }
        let present = |r: &Record| !matches!(r, Record::Absent);
        let (was_there, is_there) = (present(&before), present(&after));
        if was_there && !is_there {
            // Never below zero, whatever a caller does twice.
            let _ = self
                .stats
                .records
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_sub(1))
                });
        } else if !was_there && is_there {
            self.stats.records.fetch_add(1, Ordering::Relaxed);
        }
        // A tenant counts the records that carry its tag: a record written
        // before tags existed and rewritten with one (a renewal, a commit)
        // starts to count when it gains the tag, as it stops when removed.
        let before_tag = before_tag.filter(|_| was_there);
        let after_tag = after_tag.filter(|_| is_there);
        if before_tag != after_tag {
            if let Some(n) = before_tag.and_then(|t| self.tenants.get_mut(&t)) {
                *n = n.saturating_sub(1);
            }
            if let Some(t) = after_tag {
                let n = self.tenants.entry(t).or_default();
                *n += 1;
                self.stats
                    .top_tenant_records
                    .fetch_max(*n, Ordering::Relaxed);
            }
        }
    }

    fn sync(&self) -> Result<(), LedgerError> {
        make_durable(&self.db, &self.file, &self.probe)
    }

    /// Raises the horizon durably, then removes records below it, then
    /// reservations whose lease ended before `lease_before` (the ledger's
    /// clock, which judges leases, minus the skew; never after `before`).
    fn collect(
        &mut self,
        before: u64,
        lease_before: u64,
        limit: usize,
    ) -> Result<usize, LedgerError> {
        if before > self.horizon {
            self.meta
                .insert(META_HORIZON, &before.to_be_bytes()[..])
                .map_err(|e| LedgerError::storage("meta write", e))?;
            self.sync()?;
            self.horizon = before;
        }
        let end = self.horizon.to_be_bytes();
        let mut gone = Vec::new();
        for item in self.tree.range(..&end[..]).take(limit) {
            let (k, v) = item.map_err(|e| LedgerError::storage("scan", e))?;
            gone.push((k, v));
        }
        // Reservations nobody took over, whose lease ended before
        // `lease_before` (the clock skew ago, by the clock that judged the
        // lease: a wall clock ahead of it must not end a lease early, whose
        // holder's Commit would then fail): removing one leaves the token as if never
        // opened, which is what a takeover would have found. Their holder's
        // late Commit then answers LEASE_EXPIRED.
        let (inherited, grace) = (
            &self.inherited,
            self.stats.inherited_lease_grace.load(Ordering::Relaxed),
        );
        let ended: Vec<_> = self
            .leases
            .range(..(lease_before, [0u8; LedgerKey::LEN]))
            .filter(|(until, k)| {
                !inherited.contains(k) || until.saturating_add(grace) < lease_before
            })
            .take(limit)
            .copied()
            .collect();
        let mut early = 0u64;
        let expired: std::collections::HashSet<Vec<u8>> =
            gone.iter().map(|(k, _)| k.to_vec()).collect();
        for (until, k) in ended {
            // Expired and past its lease at once: already in `gone`.
            if expired.contains(&k[..]) {
                continue;
            }
            let v = self
                .tree
                .get(&k[..])
                .map_err(|e| LedgerError::storage("read", e))?;
            match Record::decode(v.as_deref()).0 {
                Record::Reserved { until: u, .. } if u == until => {
                    gone.push((k[..].into(), v.expect("read above")));
                    early += 1;
                }
                // Stale index entry (cannot happen: kept in step).
                _ => {
                    self.leases.remove(&(until, k));
                }
            }
        }
        let n = gone.len();
        for (k, v) in gone {
            self.tree
                .remove(&k)
                .map_err(|e| LedgerError::storage("remove", e))?;
            if let Ok(k) = <[u8; LedgerKey::LEN]>::try_from(&k[..]) {
                self.account(k, Some(v.to_vec()), None);
            }
        }
        self.stats
            .collected_leases
            .fetch_add(early, Ordering::Relaxed);
        self.stats.top_tenant_records.store(
            self.tenants.values().copied().max().unwrap_or(0),
            Ordering::Relaxed,
        );
        // Removals need no flush of their own: one lost in a crash is
        // removed again later; the horizon already refuses an expired key,
        // and a lease that ended may be taken over anyway.
        Ok(n)
    }
}

/// Whether a round may add one more record, overall and for its tenant.
struct Room<'a> {
    stats: &'a FlushStats,
    tenants: &'a HashMap<TenantTag, u64>,
    records: u64,
    max_records: u64,
    max_tenant: u64,
    added: u64,
    added_by: HashMap<TenantTag, u64>,
}

impl Room<'_> {
    fn take(&mut self, tenant: TenantTag) -> bool {
        if self.records.saturating_add(self.added) >= self.max_records {
            self.stats.refused_full.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let held = self.tenants.get(&tenant).copied().unwrap_or(0);
        let adding = self.added_by.entry(tenant).or_default();
        if held.saturating_add(*adding) >= self.max_tenant {
            self.stats.refused_full.fetch_add(1, Ordering::Relaxed);
            self.stats
                .refused_tenant_full
                .fetch_add(1, Ordering::Relaxed);
            return false;
        }
        *adding += 1;
        self.added += 1;
        true
    }
}

/// A record value's first bytes: its kind, tagged with its tenant.
fn tagged(kind: u8, tenant: TenantTag) -> Vec<u8> {
    let mut v = Vec::with_capacity(1 + 8 + 40);
    v.push(kind | V_TAGGED);
    v.extend_from_slice(&tenant.0);
    v
}

/// The value of a reservation under `lease`.
fn reserved_value(key: &LedgerKey, lease: &Lease) -> Vec<u8> {
    let mut v = tagged(V_RESERVED, key.tenant);
    v.extend_from_slice(&lease.end.until.to_be_bytes());
    v.extend_from_slice(&lease.rid);
    v.extend(lease.attempt.iter().flatten());
    v
}

/// A key a round writes: its value before the round (so the round knows
/// how many records it adds and removes, and whose), and its new value
/// (`None`: removed).
struct Slot {
    was: Option<Vec<u8>>,
    now: Option<Vec<u8>>,
}

impl Slot {
    /// Writes `now` for `k`, whose value this round read as `read`: from
    /// the tree when the round had not written `k` yet.
    fn write(
        overlay: &mut HashMap<[u8; LedgerKey::LEN], Slot>,
        k: [u8; LedgerKey::LEN],
        read: &Option<Vec<u8>>,
        now: Option<Vec<u8>>,
    ) {
        overlay
            .entry(k)
            .or_insert_with(|| Slot {
                was: read.clone(),
                now: None,
            })
            .now = now;
    }
}

/// A decision's answer, to go back to its job's caller.
enum Answer {
    Consumed(Consumed),
    Reserved(Reserved),
    Held(Held),
    Released,
}

fn answer_job(job: Job, answer: Result<Answer, LedgerError>) {
    const MISMATCH: LedgerError = LedgerError::Corrupt("internal: mismatched answer");
    match (job, answer) {
        (Job::Consume { reply, .. }, a) => {
            let _ = reply.send(a.and_then(|a| match a {
                Answer::Consumed(c) => Ok(c),
                _ => Err(MISMATCH),
            }));
        }
        (Job::Reserve { reply, .. }, a) => {
            let _ = reply.send(a.and_then(|a| match a {
                Answer::Reserved(c) => Ok(c),
                _ => Err(MISMATCH),
            }));
        }
        (Job::Renew { reply, .. } | Job::Commit { reply, .. }, a) => {
            let _ = reply.send(a.and_then(|a| match a {
                Answer::Held(c) => Ok(c),
                _ => Err(MISMATCH),
            }));
        }
        (Job::Release { reply, .. }, a) => {
            let _ = reply.send(a.map(|_| ()));
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
#[derive(Debug, PartialEq)]
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
    },
}

fn arr16(b: &[u8]) -> [u8; 16] {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[..16]);
    a
}

impl Record {
    /// The record and, for a tagged one, its tenant.
    fn decode(v: Option<&[u8]>) -> (Record, Option<TenantTag>) {
        match v {
            Some([kind, rest @ ..]) if kind & V_TAGGED != 0 && rest.len() >= 8 => {
                let mut t = [0u8; 8];
                t.copy_from_slice(&rest[..8]);
                let mut untagged = Vec::with_capacity(rest.len() - 7);
                untagged.push(kind & !V_TAGGED);
                untagged.extend_from_slice(&rest[8..]);
                (Record::decode_untagged(Some(&untagged)), Some(TenantTag(t)))
            }
            v => (Record::decode_untagged(v), None),
        }
    }

    fn decode_untagged(v: Option<&[u8]>) -> Record {
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

/// The probe file in the ledger directory, resized (0 ↔ 1 byte) after
/// every `fdatasync` (see the module's notes).
struct Probe {
    file: File,
    /// Its size now.
    len: std::cell::Cell<u64>,
}

impl Probe {
    fn open(dir: &Path) -> Result<Self, LedgerError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.join(PROBE_FILE))
            .map_err(|e| LedgerError::storage("open the ledger's probe file", e))?;
        let len = file
            .metadata()
            .map_err(|e| LedgerError::storage("read the ledger's probe file", e))?
            .len();
        Ok(Probe {
            file,
            len: std::cell::Cell::new(len),
        })
    }

    /// After an `fdatasync`: a journalled metadata change of the file
    /// system, which fails if its journal was aborted, even when the
    /// `fdatasync` raced the abort and said 0.
    fn check(&self) -> Result<(), LedgerError> {
        let next = u64::from(self.len.get() == 0);
        self.file
            .set_len(next)
            .map_err(|e| LedgerError::storage("filesystem check after fdatasync", e))?;
        self.len.set(next);
        Ok(())
    }
}

/// sled flushed, its data file `fdatasync`ed, and the probe.
fn make_durable(db: &sled::Db, file: &File, probe: &Probe) -> Result<(), LedgerError> {
    db.flush().map_err(|e| LedgerError::storage("flush", e))?;
    file.sync_data()
        .map_err(|e| LedgerError::storage("fdatasync", e))?;
    probe.check()
}

/// One change into sled (no flush).
fn apply(tree: &sled::Tree, meta: &sled::Tree, c: &Change<'_>) -> Result<(), LedgerError> {
    let tree = match c.tree {
        journal::Tree::Records => tree,
        journal::Tree::Meta => meta,
    };
    match c.value {
        Some(v) => tree.insert(c.key, v).map(|_| ()),
        None => tree.remove(c.key).map(|_| ()),
    }
    .map_err(|e| LedgerError::storage("write", e))
}

fn refuse(jobs: Vec<Job>) {
    for j in jobs {
        answer_job(j, Err(LedgerError::FailedForGood));
    }
}

#[async_trait::async_trait]
impl Reference for SledLedger {
    async fn record_high_water(&self, now_unix: u64) -> Result<(), ReferenceError> {
        Ok(self.send(Job::HighWater(now_unix))?)
    }

    fn stored_high_water(&self) -> Option<u64> {
        self.stored_high_water
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
        self.ask(|reply| Job::Consume {
            key,
            now,
            attempt,
            reply,
        })
        .await
    }

    async fn reserve(&self, key: &LedgerKey, ask: LeaseAsk) -> Result<Reserved, LedgerError> {
        let (key, now) = (*key, self.clock.now_unix());
        self.ask(|reply| Job::Reserve {
            key,
            ask,
            now,
            reply,
        })
        .await
    }

    async fn renew(
        &self,
        key: &LedgerKey,
        rid: [u8; 16],
        seconds: u32,
        cap: u64,
    ) -> Result<Held, LedgerError> {
        let (key, now) = (*key, self.clock.now_unix());
        self.ask(|reply| Job::Renew {
            key,
            rid,
            seconds,
            cap,
            now,
            reply,
        })
        .await
    }

    async fn commit(&self, key: &LedgerKey, rid: [u8; 16]) -> Result<Held, LedgerError> {
        let key = *key;
        self.ask(|reply| Job::Commit { key, rid, reply }).await
    }

    async fn release(&self, key: &LedgerKey, rid: [u8; 16]) -> Result<(), LedgerError> {
        let key = *key;
        self.ask(|reply| Job::Release { key, rid, reply }).await
    }

    async fn ready(&self) -> bool {
        // A dead writer never comes back in this process.
        !self.dead.load(Ordering::SeqCst)
    }

    async fn remove_expired(&self, before_unix: u64, limit: usize) -> Result<usize, LedgerError> {
        let lease_before = if self
            .stats
            .lease_collection_by_own_clock
            .load(Ordering::Relaxed)
        {
            let margin = self.stats.lease_collection_margin.load(Ordering::Relaxed);
            before_unix.min(self.clock.now_unix().saturating_sub(margin))
        } else {
            before_unix
        };
        self.ask(|reply| Job::Collect {
            before: before_unix,
            lease_before,
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
        self.db
            .flush_async()
            .await
            .map_err(|e| LedgerError::storage("final flush", e))?;
        File::open(&self.data_file)
            .and_then(|f| f.sync_data())
            .map_err(|e| LedgerError::storage("final fdatasync", e))
    }

    fn backend(&self) -> &'static str {
        "sled"
    }

    fn share_among(&self, tenants: u64) {
        if !self.stats.share_by_tenants.load(Ordering::Relaxed) {
            return;
        }
        let max = self.stats.max_records.load(Ordering::Relaxed);
        self.stats
            .max_tenant_records
            .store(super::default_share(max, tenants), Ordering::Relaxed);
    }

    fn flush_stats(&self) -> Option<Arc<FlushStats>> {
        Some(self.stats.clone())
    }

    fn failed_for_good(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Ledger key `n` of the default tenant, expiring far ahead.
    fn key(n: u8) -> LedgerKey {
        LedgerKey {
            expires_at: 4_000_000_000,
            id: [n; 32],
            tenant: TenantTag::default(),
        }
    }

    /// Issue 58, finding 5: a record written before tenant tags existed
    /// counts against its tenant's share once it is rewritten with a tag
    /// (it was not counted then, but was subtracted when removed, so the
    /// tenant could pass its share until a restart).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_untagged_record_rewritten_with_a_tag_counts_for_its_tenant() {
        let dir = tempfile::tempdir().unwrap();
        let tenant = TenantTag::of("t");
        let k = LedgerKey { tenant, ..key(1) };
        let rid = [9u8; 16];
        {
            // As an earlier version wrote it: no tag. No flusher thread, so
            // that dropping the store lets go of its lock at once (with one,
            // the ledger's open below could find it still held).
            let db = sled::Config::new()
                .path(dir.path())
                .flush_every_ms(None)
                .open()
                .unwrap();
            let tree = db.open_tree("consumed/v1").unwrap();
            let mut v = vec![V_RESERVED];
            v.extend_from_slice(&4_000_000_000u64.to_be_bytes());
            v.extend_from_slice(&rid);
            tree.insert(k.to_bytes(), v).unwrap();
            db.flush().unwrap();
        }
        let l = SledLedger::open(dir.path())
            .unwrap()
            .with_max_tenant_records(1);
        // Renewed by its holder: now tagged, and counted.
        assert!(matches!(
            l.renew(&k, rid, 60, u64::MAX).await.unwrap(),
            Held::Yes(_)
        ));
        let other = LedgerKey { tenant, ..key(2) };
        let ask = LeaseAsk {
            rid: [1; 16],
            attempt: None,
            seconds: 60,
            cap: u64::MAX,
        };
        assert_eq!(
            l.reserve(&other, ask).await.unwrap(),
            Reserved::Full,
            "the tenant is at its share of one"
        );
        // Committed, then the count goes when the record does.
        assert_eq!(l.commit(&k, rid).await.unwrap(), Held::Yes(None));
        assert_eq!(l.stats.top_tenant_records.load(Ordering::Relaxed), 1);
        l.close().await.unwrap();
    }

    #[test]
    fn only_unfinished_snapshots_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let names = [
            "snap.00000000000a1b2c.generating",
            "snap.00000000000a1b2c",
            "blobs.generating",
            "snap.",
            "conf",
        ];
        for n in names {
            std::fs::write(dir.path().join(n), b"x").unwrap();
        }
        // Issue 58, S1: a complete one (synced, not yet renamed) passes
        // sled's own check and may be the only good snapshot: it stays.
        let body = b"a snapshot's bytes".to_vec();
        let mut complete = body.clone();
        complete.extend_from_slice(&(body.len() as u64).to_le_bytes());
        complete.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        let kept = "snap.00000000000a1b2d.generating";
        std::fs::write(dir.path().join(kept), &complete).unwrap();
        // Cut one byte short: unfinished.
        let cut = "snap.00000000000a1b2e.generating";
        std::fs::write(dir.path().join(cut), &complete[..complete.len() - 1]).unwrap();
        drop_unfinished_snapshots(dir.path()).unwrap();
        for n in names {
            assert_eq!(
                dir.path().join(n).exists(),
                n != "snap.00000000000a1b2c.generating",
                "{n}"
            );
        }
        assert!(dir.path().join(kept).exists());
        assert!(!dir.path().join(cut).exists());
    }

    /// Issue 58, S2: the cleanup takes sled's lock the way sled does
    /// (creating `db` when absent), so it never runs beside another
    /// process; a `db` that cannot be opened is an error, not a cleanup
    /// without the lock.
    #[test]
    fn the_cleanup_locks_db_as_sled_does() {
        let dir = tempfile::tempdir().unwrap();
        let unfinished = dir.path().join("snap.0000000000000001.generating");
        std::fs::write(&unfinished, b"x").unwrap();
        // `db` a directory: sled could not open it either.
        std::fs::create_dir(dir.path().join("db")).unwrap();
        let e = drop_unfinished_snapshots(dir.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("db file"), "{e}");
        assert!(unfinished.exists(), "cleaned up without the lock");
        std::fs::remove_dir(dir.path().join("db")).unwrap();
        // Absent: created and locked, as sled does.
        drop_unfinished_snapshots(dir.path()).unwrap();
        assert!(!unfinished.exists());
        assert!(dir.path().join("db").is_file());
    }

    #[test]
    fn a_snapshot_another_process_may_be_writing_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let unfinished = dir.path().join("snap.0000000000000001.generating");
        std::fs::write(&unfinished, b"x").unwrap();
        // Another open file description holds sled's lock, as sled does.
        let db = File::create(dir.path().join("db")).unwrap();
        rustix::fs::flock(&db, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
        drop_unfinished_snapshots(dir.path()).unwrap();
        assert!(unfinished.exists());
        drop(db);
        drop_unfinished_snapshots(dir.path()).unwrap();
        assert!(!unfinished.exists());
    }

    #[test]
    fn a_directory_that_cannot_be_read_is_an_error_and_a_missing_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        drop_unfinished_snapshots(&dir.path().join("not yet")).unwrap();
        let file = dir.path().join("a file");
        std::fs::write(&file, b"x").unwrap();
        let e = drop_unfinished_snapshots(&file).unwrap_err().to_string();
        assert!(e.contains("read the ledger directory"), "{e}");
    }

    #[test]
    fn the_probe_changes_the_file_size_at_each_check() {
        let dir = tempfile::tempdir().unwrap();
        let size = || {
            std::fs::metadata(dir.path().join(PROBE_FILE))
                .unwrap()
                .len()
        };
        let probe = Probe::open(dir.path()).unwrap();
        assert_eq!(size(), 0);
        for want in [1, 0, 1] {
            probe.check().unwrap();
            assert_eq!(size(), want);
        }
        drop(probe);
        // Reopened at 1 byte: the next check goes to 0.
        Probe::open(dir.path()).unwrap().check().unwrap();
        assert_eq!(size(), 0);
    }

    #[test]
    fn records_of_every_version_decode_and_anything_else_is_consumed() {
        let (t, until, rid, a) = ([9u8; 8], 7u64.to_be_bytes(), [5u8; 16], [6u8; 16]);
        let cat = |parts: &[&[u8]]| parts.concat();
        let reserved = |attempt| Record::Reserved {
            until: 7,
            rid,
            attempt,
        };
        let consumed = |attempt| Record::Consumed { attempt };
        let tagged = Some(TenantTag(t));
        let cases: Vec<(Vec<u8>, Record, Option<TenantTag>)> = vec![
            // Today's: the kind with the tag bit, the tenant, the rest.
            (cat(&[&[0x81], &t]), consumed(None), tagged),
            (cat(&[&[0x81], &t, &a]), consumed(Some(a)), tagged),
            (cat(&[&[0x82], &t, &until, &rid]), reserved(None), tagged),
            (
                cat(&[&[0x82], &t, &until, &rid, &a]),
                reserved(Some(a)),
                tagged,
            ),
            (cat(&[&[0x83], &t, &rid]), Record::Committed { rid }, tagged),
            (
                cat(&[&[0x83], &t, &rid, &a]),
                Record::Committed { rid },
                tagged,
            ),
            // Earlier versions': no tag bit, no tenant.
            (vec![1], consumed(None), None),
            (cat(&[&[1], &a]), consumed(Some(a)), None),
            (cat(&[&[2], &until, &rid]), reserved(None), None),
            (cat(&[&[2], &until, &rid, &a]), reserved(Some(a)), None),
            (cat(&[&[3], &rid]), Record::Committed { rid }, None),
            (cat(&[&[3], &rid, &a]), Record::Committed { rid }, None),
            // Anything else is consumed (fail closed).
            (cat(&[&[2], &until]), consumed(None), None),
            (cat(&[&[3], &rid[..5]]), consumed(None), None),
            (cat(&[&[0x82], &t, &until]), consumed(None), tagged),
            (vec![0x82, 1, 2], consumed(None), None),
            (vec![0x7f], consumed(None), None),
        ];
        assert_eq!(Record::decode(None), (Record::Absent, None));
        for (v, record, tag) in cases {
            assert_eq!(Record::decode(Some(&v)), (record, tag), "{v:?}");
        }
    }

    /// A checkpoint makes sled durable on its own before the journal starts
    /// afresh: a copy of the directory taken then (what a process killed
    /// at that moment leaves) holds every acknowledged record, from sled's
    /// files alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_leaves_every_record_in_sleds_own_files() {
        fn copy(from: &Path, to: &Path) {
            std::fs::create_dir_all(to).unwrap();
            for e in std::fs::read_dir(from).unwrap() {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    copy(&e.path(), &to.join(e.file_name()));
                } else {
                    std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
                }
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let (live, copied) = (dir.path().join("live"), dir.path().join("copy"));
        let l = SledLedger::open(&live).unwrap();
        assert_eq!(l.consume(&key(1)).await.unwrap(), Consumed::Now);
        // The next round after CHECKPOINT_EVERY since the last checkpoint
        // (the open) ends with one.
        tokio::time::sleep(CHECKPOINT_EVERY + std::time::Duration::from_millis(100)).await;
        assert_eq!(l.consume(&key(2)).await.unwrap(), Consumed::Now);
        copy(&live, &copied);
        assert_eq!(
            Journal::open(&copied, |_| Ok(())).unwrap().1,
            0,
            "no checkpoint"
        );
        let c = SledLedger::open(&copied).unwrap();
        for n in [1, 2] {
            assert_eq!(c.consume(&key(n)).await.unwrap(), Consumed::Before, "{n}");
        }
        drop(l);
    }

    /// Opens the ledger in `dir` again after this test dropped it: sled's
    /// own threads may hold the lock a while longer on a busy machine (as
    /// `tests/it/common::open_sled_again` waits for). A liveness bound.
    fn reopen(dir: &Path) -> SledLedger {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            match SledLedger::open(dir) {
                Err(e) if e.to_string().contains("could not acquire lock") => {
                    assert!(std::time::Instant::now() < deadline, "{e}");
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                r => return r.unwrap(),
            }
        }
    }

    /// The rounds a start replays go into sled, durably, and the journal
    /// starts afresh: the next start replays nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_journal_starts_afresh_after_a_replay() {
        let dir = tempfile::tempdir().unwrap();
        let rounds_in_journal = || Journal::open(dir.path(), |_| Ok(())).unwrap().1;
        // A checkpoint (every 5 s while rounds come) may empty the journal
        // first on a slow machine: then again, with other keys.
        let mut n = 0;
        let replayed = loop {
            let l = reopen(dir.path());
            for _ in 0..3 {
                n += 1;
                assert_eq!(l.consume(&key(n)).await.unwrap(), Consumed::Now);
            }
            l.close().await.unwrap();
            drop(l);
            let replayed = rounds_in_journal();
            if replayed > 0 || n >= 30 {
                break replayed;
            }
        };
        assert!(replayed > 0, "no round stayed in the journal");
        let l = reopen(dir.path());
        l.close().await.unwrap();
        drop(l);
        assert_eq!(
            rounds_in_journal(),
            0,
            "replayed rounds left in the journal"
        );
        let l = reopen(dir.path());
        for k in 1..=n {
            assert_eq!(l.consume(&key(k)).await.unwrap(), Consumed::Before);
        }
    }
}
