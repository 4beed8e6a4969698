//! The embedded sled ledger, for one replica.
//!
//! sled writes to disk only on flush. A consumption is inserted with an atomic
//! compare-and-swap (absent → present), then waits for a flush that started
//! after its insert; one flusher thread serves every waiter that queued up
//! while the previous flush ran (group commit), so N concurrent consumptions
//! cost one flush, not N. Each flush is followed by `fdatasync` of sled's data
//! file: sled's own flush uses `sync_file_range`, which survives a killed
//! process but not a power loss.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use tokio::sync::oneshot;

use super::{Consumed, Ledger, LedgerError, LedgerKey};

type Waiter = oneshot::Sender<Result<(), String>>;

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
    /// `None` only while dropping.
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
            let db = db.clone();
            let healthy = healthy.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name("stateseal-ledger-flush".into())
                .spawn(move || flush_loop(&db, &file, &rx, &healthy, &stats))
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

    /// Waits for a flush that starts after this call.
    async fn durable(&self) -> Result<(), LedgerError> {
        let (tx, rx) = oneshot::channel();
        self.flusher
            .as_ref()
            .ok_or_else(|| LedgerError("flusher stopped".into()))?
            .send(tx)
            .map_err(|_| LedgerError("flusher stopped".into()))?;
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(LedgerError(e)),
            Err(_) => Err(LedgerError("flusher stopped".into())),
        }
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

fn flush_loop(
    db: &sled::Db,
    file: &File,
    rx: &mpsc::Receiver<Waiter>,
    healthy: &AtomicBool,
    stats: &FlushStats,
) {
    // Ends when the ledger (the only sender) is dropped.
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        let result = db
            .flush()
            .map(|_| ())
            .map_err(|e| format!("flush failed: {e}"))
            .and_then(|()| {
                file.sync_data()
                    .map_err(|e| format!("fdatasync failed: {e}"))
            });
        healthy.store(result.is_ok(), Ordering::Relaxed);
        let n = batch.len() as u64;
        stats.flushes.fetch_add(1, Ordering::Relaxed);
        stats.flushed_waiters.fetch_add(n, Ordering::Relaxed);
        stats.max_batch.fetch_max(n, Ordering::Relaxed);
        for w in batch {
            let _ = w.send(result.clone());
        }
    }
}

#[async_trait::async_trait]
impl Ledger for SledLedger {
    async fn consume(&self, key: &LedgerKey) -> Result<Consumed, LedgerError> {
        let k = key.to_bytes();
        match self
            .tree
            .compare_and_swap(k, None as Option<&[u8]>, Some(&[1u8][..]))
        {
            Ok(Ok(())) => {
                // Recorded in memory; answer only once it is on disk. If the
                // flush fails the record stays, so the token stays burned in
                // this process: fail closed.
                self.durable().await?;
                Ok(Consumed::Now)
            }
            Ok(Err(_)) => Ok(Consumed::Before),
            Err(e) => {
                self.healthy.store(false, Ordering::Relaxed);
                Err(LedgerError(format!("insert failed: {e}")))
            }
        }
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
        self.durable().await?;
        let _ = self.db.flush_async().await;
        File::open(&self.data_file)
            .and_then(|f| f.sync_data())
            .map_err(|e| LedgerError(format!("final fdatasync failed: {e}")))
    }

    fn backend(&self) -> &'static str {
        "sled"
    }
}
