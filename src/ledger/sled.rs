//! The embedded sled ledger, for one replica.
//!
//! sled writes to disk only on flush. One writer thread owns every
//! consumption: callers hand it their key and wait; it takes everything that
//! queued up while its previous round ran (group commit), decides each key
//! (absent from the tree and not earlier in this batch → consumed now;
//! otherwise consumed before), writes the new keys with one atomic
//! `apply_batch`, flushes once, `fdatasync`s sled's data file, and only then
//! answers. N concurrent consumptions cost one batch and one flush, not N.
//! A single writer makes check-then-insert atomic without a per-key
//! compare-and-swap (the garbage collector only ever removes records that
//! expired, which no open can ask about).
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

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use tokio::sync::oneshot;

use super::{Consumed, Ledger, LedgerError, LedgerKey};

/// Meta records: the horizon and the clock's high-water mark.
const META_TREE: &str = "meta/v1";
const META_HORIZON: &[u8] = b"gc_horizon";
const META_HIGH_WATER: &[u8] = b"high_water";

/// Work for the writer thread.
enum Job {
    /// Decide a consumption.
    Consume(LedgerKey, oneshot::Sender<Result<Consumed, String>>),
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

/// Figures a caller may read (batch sizes show group commit at work).
#[derive(Debug, Default)]
pub struct FlushStats {
    pub flushes: AtomicU64,
    pub flushed_waiters: AtomicU64,
    pub max_batch: AtomicU64,
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
        let dead = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(FlushStats::default());
        let (tx, rx) = mpsc::channel::<Job>();
        let writer_thread = {
            let mut w = Writer {
                db: db.clone(),
                tree,
                meta,
                file,
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
        })
    }

    pub fn stats(&self) -> &FlushStats {
        &self.stats
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
    horizon: u64,
    dead: Arc<AtomicBool>,
    stats: Arc<FlushStats>,
}

const DEAD: &str = "ledger stopped after an I/O failure; restart the process";

impl Writer {
    fn run(&mut self, rx: &mpsc::Receiver<Job>) {
        let mut seen = HashSet::new();
        // Ends when the ledger (the only sender) is dropped.
        while let Ok(first) = rx.recv() {
            let mut jobs = vec![first];
            jobs.extend(rx.try_iter());
            if self.dead.load(Ordering::SeqCst) {
                refuse(jobs);
                continue;
            }
            let mut consumes = Vec::new();
            let mut barriers = Vec::new();
            let mut collects = Vec::new();
            let mut high_water = None;
            for j in jobs {
                match j {
                    Job::Consume(k, r) => consumes.push((k, r)),
                    Job::Barrier(r) => barriers.push(r),
                    Job::Collect {
                        before,
                        limit,
                        reply,
                    } => collects.push((before, limit, reply)),
                    Job::HighWater(t) => high_water = high_water.max(Some(t)),
                }
            }
            let n = (consumes.len() + barriers.len()) as u64;
            let result = self.round(&mut seen, &consumes, high_water);
            if result.is_err() {
                self.dead.store(true, Ordering::SeqCst);
            }
            self.stats.flushes.fetch_add(1, Ordering::Relaxed);
            self.stats.flushed_waiters.fetch_add(n, Ordering::Relaxed);
            self.stats.max_batch.fetch_max(n, Ordering::Relaxed);
            match result {
                Ok(decided) => {
                    for ((_, reply), c) in consumes.into_iter().zip(decided) {
                        let _ = reply.send(Ok(c));
                    }
                    for r in barriers {
                        let _ = r.send(Ok(()));
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "sled ledger write failed; refusing every consumption until the process restarts");
                    // Nobody is told "consumed": a key that made it into the
                    // tree stays there, so the token stays burned.
                    for (_, reply) in consumes {
                        let _ = reply.send(Err(e.clone()));
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

    /// Decides the consumptions, writes the new records (and the high-water
    /// mark) with one batch, flushes once and fdatasyncs.
    fn round(
        &self,
        seen: &mut HashSet<[u8; LedgerKey::LEN]>,
        consumes: &[(LedgerKey, oneshot::Sender<Result<Consumed, String>>)],
        high_water: Option<u64>,
    ) -> Result<Vec<Consumed>, String> {
        seen.clear();
        let mut batch = sled::Batch::default();
        let mut decided = Vec::with_capacity(consumes.len());
        for (key, _) in consumes {
            if key.expires_at < self.horizon {
                decided.push(Consumed::PastHorizon);
                continue;
            }
            let k = key.to_bytes();
            let present = self
                .tree
                .contains_key(k)
                .map_err(|e| format!("read failed: {e}"))?;
            let fresh = !present && seen.insert(k);
            if fresh {
                batch.insert(&k[..], &[1u8][..]);
            }
            decided.push(if fresh {
                Consumed::Now
            } else {
                Consumed::Before
            });
        }
        self.tree
            .apply_batch(batch)
            .map_err(|e| format!("insert failed: {e}"))?;
        if let Some(t) = high_water {
            self.meta
                .insert(META_HIGH_WATER, &t.to_be_bytes()[..])
                .map_err(|e| format!("meta write failed: {e}"))?;
        }
        self.sync()?;
        Ok(decided)
    }

    fn sync(&self) -> Result<(), String> {
        self.db.flush().map_err(|e| format!("flush failed: {e}"))?;
        self.file
            .sync_data()
            .map_err(|e| format!("fdatasync failed: {e}"))
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
            self.tree
                .remove(k)
                .map_err(|e| format!("remove failed: {e}"))?;
            n += 1;
        }
        // Removals need no flush of their own: one lost in a crash is
        // removed again later, and the horizon already refuses its key.
        Ok(n)
    }
}

fn refuse(jobs: Vec<Job>) {
    for j in jobs {
        match j {
            Job::Consume(_, r) => {
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
    async fn consume(&self, key: &LedgerKey) -> Result<Consumed, LedgerError> {
        let key = *key;
        self.ask(|r| Job::Consume(key, r)).await
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
