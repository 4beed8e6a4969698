//! The single-use ledger: one atomic operation, *consume if absent*, keyed by
//! a token's tenant-scoped ledger id and its authenticated expiry.
//!
//! Contract every backend keeps:
//! - `consume` answers [`Consumed::Now`] to exactly one caller per key, ever
//!   (until the record is garbage-collected after the token expired), and only
//!   once the record is durable;
//! - when the backend cannot answer it returns [`LedgerError`], and the
//!   service turns that into `LEDGER_UNAVAILABLE`: it fails closed;
//! - records are removed only after `expires_at + clock skew`, judged by
//!   the reference clock (the database's for PostgreSQL; the guarded local
//!   clock for sled, see `timeguard`);
//! - before a record can be removed, the ledger raises its *horizon*
//!   durably: from then on it answers [`Consumed::PastHorizon`] for any key
//!   that expired before it, so a removed record can never be consumed
//!   afresh, whatever a clock says later.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::timeguard::Vouch;

pub mod pgtls;
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
    /// The token expired before the ledger's horizon: its record may have
    /// been collected, so it is refused (as `EXPIRED`).
    PastHorizon,
    /// Another attempt holds a live reservation of the token (`IN_USE`).
    InUse,
    /// The ledger holds as many records as it may (`--max-ledger-records`):
    /// nothing was recorded, and the call is refused (`OVERLOADED`) until
    /// garbage collection makes room. Only a key the ledger does not hold yet
    /// can meet this; a replay is still answered `Before`.
    Full,
    /// The same attempt (its keyed attempt hash) consumed the token before
    /// (`None`), or holds its live reservation (`Some`, the lease it holds):
    /// the same success again.
    Again(Option<Lease>),
}

/// A reservation's id (random, 16 bytes), when its lease ends, and the
/// keyed hash of the attempt that took it, if the caller named one.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub rid: [u8; 16],
    pub until: u64,
    pub attempt: Option<[u8; 16]>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("until", &self.until)
            .finish_non_exhaustive()
    }
}

/// The outcome of a commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Committed {
    /// The consumption is durable (now, or by an earlier commit of the same
    /// reservation).
    Done,
    /// The reservation is gone: its lease ended, or it was released, taken
    /// over or collected. Nothing was recorded.
    LeaseLost,
}

/// The ledger could not answer. The detail is for logs only (it never holds
/// token or key bytes) and never reaches a client.
#[derive(Debug, thiserror::Error)]
#[error("ledger unavailable: {0}")]
pub struct LedgerError(pub String);

#[async_trait::async_trait]
pub trait Ledger: Send + Sync + 'static {
    /// Records `key` if absent, with `attempt` (a keyed hash of the
    /// caller's attempt id, if any): the same attempt asking again gets
    /// `Again(None)` instead of `Before`. `Ok(Now)` only once the record is
    /// durable.
    async fn consume_as(
        &self,
        key: &LedgerKey,
        attempt: Option<[u8; 16]>,
    ) -> Result<Consumed, LedgerError>;
    /// `consume_as` without an attempt id.
    async fn consume(&self, key: &LedgerKey) -> Result<Consumed, LedgerError> {
        self.consume_as(key, None).await
    }
    /// Reserves `key` for `lease` (`Consumed::Now` = reserved by this call):
    /// absent, or reserved under a lease that ended before `now`, becomes
    /// reserved; consumed is `Before`; reserved under a live lease is `InUse`.
    /// Durable before the answer, like `consume`.
    async fn reserve(
        &self,
        _key: &LedgerKey,
        _lease: Lease,
        _now: u64,
    ) -> Result<Consumed, LedgerError> {
        Err(LedgerError(
            "this ledger does not support reservations".into(),
        ))
    }
    /// Turns the reservation `rid` of `key` into a consumption, if its lease
    /// has not ended by `now`; durable before the answer.
    async fn commit(
        &self,
        _key: &LedgerKey,
        _rid: [u8; 16],
        _now: u64,
    ) -> Result<Committed, LedgerError> {
        Err(LedgerError(
            "this ledger does not support reservations".into(),
        ))
    }
    /// Removes the reservation `rid` of `key`, if it still holds it.
    async fn release(&self, _key: &LedgerKey, _rid: [u8; 16]) -> Result<(), LedgerError> {
        Err(LedgerError(
            "this ledger does not support reservations".into(),
        ))
    }
    /// Whether the ledger can take consumptions now (readiness).
    async fn ready(&self) -> bool;
    /// Raises the horizon to `before_unix` (capped, where the ledger has a
    /// clock of its own, at that clock minus the skew), durably, then
    /// removes up to `limit` records that expired before the horizon;
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
    /// The reference clock, where the ledger has one (the database's time,
    /// Unix seconds); `None` for a ledger without a clock of its own.
    async fn reference_now(&self) -> Result<Option<u64>, LedgerError> {
        Ok(None)
    }
    /// Records durably the latest time seen on a synced clock (sled keeps it
    /// to check the clock against at the next start).
    async fn record_high_water(&self, _now_unix: u64) -> Result<(), LedgerError> {
        Ok(())
    }
    /// The high-water mark recorded by an earlier run, if any.
    fn stored_high_water(&self) -> Option<u64> {
        None
    }
    /// Whether the ledger failed in a way it cannot recover from in this
    /// process (sled after a failed flush or fdatasync): the process must
    /// exit and be restarted.
    fn failed_for_good(&self) -> bool {
        false
    }
}

/// Garbage collection: every `every`, removes records that expired more than
/// `skew` seconds ago, in batches of `batch` — only while the clock guard
/// says the local clock agrees with the reference.
pub async fn run_gc(
    ledger: Arc<dyn Ledger>,
    clock: Arc<dyn Clock>,
    guard: Arc<crate::timeguard::TimeGuard>,
    skew: u64,
    every: Duration,
    batch: usize,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Judged afresh for this round: a step between two guard ticks must
        // not reach the horizon.
        let now = match guard.vouch(&*ledger).await {
            Vouch::Trusted(wall) => clock.now_unix().min(wall),
            Vouch::Unwatched => clock.now_unix(),
            Vouch::Unsynced => {
                tracing::debug!("clock not in agreement with the reference: not collecting");
                continue;
            }
        };
        let before = now.saturating_sub(skew);
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
