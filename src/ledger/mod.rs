//! The single-use ledger: one atomic operation, *consume if absent*, keyed by
//! a token's tenant-scoped ledger id and its authenticated expiry.
//!
//! Contract every backend keeps:
//! - `consume` answers [`Consumed::Now`] to exactly one caller per key, ever
//!   (until the record is garbage-collected after the token expired), and only
//!   once the record is durable;
//! - when the backend cannot answer it returns [`LedgerError`], and the
//!   service turns that into `LEDGER_UNAVAILABLE`: it fails closed;
//! - records are removed only after `expires_at + clock skew`.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;

pub mod postgres;
pub mod sled;

/// A ledger record key: the token's expiry (for ordered garbage collection)
/// and its keyed, tenant-scoped id. Never the token itself.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LedgerKey {
    pub expires_at: u64,
    pub id: [u8; 32],
}

impl std::fmt::Debug for LedgerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerKey")
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

impl LedgerKey {
    pub const LEN: usize = 40;

    /// Big-endian expiry first, so keys sort by expiry.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut k = [0u8; Self::LEN];
        k[..8].copy_from_slice(&self.expires_at.to_be_bytes());
        k[8..].copy_from_slice(&self.id);
        k
    }
}

/// The outcome of a consume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consumed {
    /// This call consumed the token; the record is durable.
    Now,
    /// The token was consumed before.
    Before,
}

/// The ledger could not answer. The detail is for logs only (it never holds
/// token or key bytes) and never reaches a client.
#[derive(Debug, thiserror::Error)]
#[error("ledger unavailable: {0}")]
pub struct LedgerError(pub String);

#[async_trait::async_trait]
pub trait Ledger: Send + Sync + 'static {
    /// Records `key` if absent. `Ok(Now)` only once the record is durable.
    async fn consume(&self, key: &LedgerKey) -> Result<Consumed, LedgerError>;
    /// Whether the ledger can take consumptions now (readiness).
    async fn ready(&self) -> bool;
    /// Removes up to `limit` records whose expiry is before `before_unix`;
    /// returns how many it removed.
    async fn remove_expired(&self, before_unix: u64, limit: usize) -> Result<usize, LedgerError>;
    /// Makes everything recorded so far durable (at shutdown).
    async fn close(&self) -> Result<(), LedgerError>;
    /// A short backend name for logs and metrics.
    fn backend(&self) -> &'static str;
    /// Group-commit figures, where the backend keeps them.
    fn flush_stats(&self) -> Option<Arc<sled::FlushStats>> {
        None
    }
}

/// Garbage collection: every `every`, removes records that expired more than
/// `skew` seconds ago, in batches of `batch`.
pub async fn run_gc(
    ledger: Arc<dyn Ledger>,
    clock: Arc<dyn Clock>,
    skew: u64,
    every: Duration,
    batch: usize,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let before = clock.now_unix().saturating_sub(skew);
        let mut removed = 0usize;
        loop {
            match ledger.remove_expired(before, batch).await {
                Ok(n) => {
                    removed += n;
                    if n < batch {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "ledger garbage collection failed");
                    break;
                }
            }
        }
        if removed > 0 {
            tracing::debug!(
                removed,
                backend = ledger.backend(),
                "ledger records expired"
            );
        }
    }
}
