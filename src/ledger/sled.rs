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

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use tokio::sync::oneshot;

use super::{Consumed, Ledger, LedgerError, LedgerKey};

/// A consumption to decide (`None`: a durability barrier only).
type Waiter = (Option<LedgerKey>, oneshot::Sender<Result<Consumed, String>>);

/// Figures a caller may read (batch sizes show group commit at work).
#[derive(Debug, Default)]
pub struct FlushStats {
    pub flushes: AtomicU64,
    pub flushed_waiters: AtomicU64,
    pub max_batch: AtomicU64,
}

pub struct SledLedger {
    db: sled::Db,
    tree: sled::Tree,
    /// To the writer thread; `None` only while dropping.
    flusher: Option<mpsc::Sender<Waiter>>,
    flush_thread: Option<std::thread::JoinHandle<()>>,
    healthy: Arc<AtomicBool>,
    stats: Arc<FlushStats>,
    data_file: PathBuf,
}

impl std::fmt::Debug for SledLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledLedger").finish_non_exhaustive()
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
        let data_file = dir.join("db");
        let file = File::open(&data_file)
            .map_err(|e| LedgerError(format!("cannot open ledger data file: {e}")))?;
        let healthy = Arc::new(AtomicBool::new(true));
        let stats = Arc::new(FlushStats::default());
        let (tx, rx) = mpsc::channel::<Waiter>();
        let flush_thread = {
            let (db, tree) = (db.clone(), tree.clone());
            let healthy = healthy.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name("stateseal-ledger".into())
                .spawn(move || writer_loop(&db, &tree, &file, &rx, &healthy, &stats))
                .map_err(|e| LedgerError(format!("cannot start flusher: {e}")))?
        };
        Ok(SledLedger {
            db,
            tree,
            flusher: Some(tx),
            flush_thread: Some(flush_thread),
            healthy,
            stats,
            data_file,
        })
    }

    pub fn stats(&self) -> &FlushStats {
        &self.stats
    }

    /// Hands `key` to the writer and waits for its durable answer; with
    /// `None`, waits for a flush that starts after this call.
    async fn submit(&self, key: Option<LedgerKey>) -> Result<Consumed, LedgerError> {
        let (tx, rx) = oneshot::channel();
        self.flusher
            .as_ref()
            .ok_or_else(|| LedgerError("ledger writer stopped".into()))?
            .send((key, tx))
            .map_err(|_| LedgerError("ledger writer stopped".into()))?;
        match rx.await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(LedgerError(e)),
            Err(_) => Err(LedgerError("ledger writer stopped".into())),
        }
    }

    async fn durable(&self) -> Result<(), LedgerError> {
        self.submit(None).await.map(|_| ())
    }
}

impl Drop for SledLedger {
    fn drop(&mut self) {
        // Stop the flusher and wait for it, so that sled's lock on the
        // directory is released when the ledger is gone.
        self.flusher.take();
        if let Some(t) = self.flush_thread.take() {
            let _ = t.join();
        }
    }
}

fn writer_loop(
    db: &sled::Db,
    tree: &sled::Tree,
    file: &File,
    rx: &mpsc::Receiver<Waiter>,
    healthy: &AtomicBool,
    stats: &FlushStats,
) {
    let mut seen = HashSet::new();
    // Ends when the ledger (the only sender) is dropped.
    while let Ok(first) = rx.recv() {
        let mut round = vec![first];
        round.extend(rx.try_iter());
        seen.clear();
        let mut batch = sled::Batch::default();
        let mut decided = Vec::with_capacity(round.len());
        let mut read_error = None;
        for (key, _) in &round {
            let Some(key) = key else {
                decided.push(Consumed::Before); // a barrier: no record
                continue;
            };
            let k = key.to_bytes();
            let fresh = match tree.contains_key(k) {
                Ok(present) => !present && seen.insert(k),
                Err(e) => {
                    read_error = Some(format!("read failed: {e}"));
                    false
                }
            };
            if fresh {
                batch.insert(&k[..], &[1u8][..]);
            }
            decided.push(if fresh {
                Consumed::Now
            } else {
                Consumed::Before
            });
        }
        let result = match read_error {
            Some(e) => Err(e),
            None => tree
                .apply_batch(batch)
                .map_err(|e| format!("insert failed: {e}"))
                .and_then(|()| {
                    db.flush()
                        .map(|_| ())
                        .map_err(|e| format!("flush failed: {e}"))
                })
                .and_then(|()| {
                    file.sync_data()
                        .map_err(|e| format!("fdatasync failed: {e}"))
                }),
        };
        healthy.store(result.is_ok(), Ordering::Relaxed);
        let n = round.len() as u64;
        stats.flushes.fetch_add(1, Ordering::Relaxed);
        stats.flushed_waiters.fetch_add(n, Ordering::Relaxed);
        stats.max_batch.fetch_max(n, Ordering::Relaxed);
        for ((_, reply), c) in round.into_iter().zip(decided) {
            // On failure nobody is told "consumed": a key that made it into
            // the tree stays there, so the token stays burned (fail closed).
            let _ = reply.send(result.clone().map(|()| c));
        }
    }
}

#[async_trait::async_trait]
impl Ledger for SledLedger {
    async fn consume(&self, key: &LedgerKey) -> Result<Consumed, LedgerError> {
        self.submit(Some(*key)).await
    }

    async fn ready(&self) -> bool {
        if self.healthy.load(Ordering::Relaxed) {
            return true;
        }
        // After a failure, a successful flush is what makes us ready again.
        self.durable().await.is_ok()
    }

    async fn remove_expired(&self, before_unix: u64, limit: usize) -> Result<usize, LedgerError> {
        let tree = self.tree.clone();
        tokio::task::spawn_blocking(move || {
            let end = before_unix.to_be_bytes();
            let mut n = 0;
            for item in tree.range(..&end[..]).keys().take(limit) {
                let k = item.map_err(|e| LedgerError(format!("scan failed: {e}")))?;
                tree.remove(k)
                    .map_err(|e| LedgerError(format!("remove failed: {e}")))?;
                n += 1;
            }
            Ok(n)
        })
        .await
        .map_err(|e| LedgerError(format!("gc task failed: {e}")))?
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
}
