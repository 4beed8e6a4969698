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
//!   clock for sled, see `clock::guard`);
//! - before a record can be removed, the ledger raises its *horizon*
//!   durably: from then on it answers [`Consumed::PastHorizon`] for any key
//!   that expired before it, so a removed record can never be consumed
//!   afresh, whatever a clock says later.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::guard::{Reference, ReferenceError, TimeGuard, Vouch};
use crate::clock::Clock;

mod journal;
pub mod pgtls;
pub mod postgres;
pub mod sled;

/// A ledger record key: the token's expiry (for ordered garbage collection)
/// and its keyed, tenant-scoped id. Never the token itself. `tenant` is the
/// owner's [`TenantTag`], stored with the record (not part of the key's
/// bytes) so that the ledger can bound the records of each tenant.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LedgerKey {
    pub expires_at: u64,
    pub id: [u8; 32],
    pub tenant: TenantTag,
}

/// A short, stable tag of a tenant's name: what the ledger counts records
/// by. Not a secret (tenant names are not), never the name itself.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct TenantTag(pub [u8; 8]);

impl TenantTag {
    pub fn of(tenant: &str) -> Self {
        use sha2::Digest;
        let d = sha2::Sha256::new()
            .chain_update(b"stateseal tenant tag v1\0")
            .chain_update(tenant.as_bytes())
            .finalize();
        let mut t = [0u8; 8];
        t.copy_from_slice(&d[..8]);
        TenantTag(t)
    }
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
    /// The token was consumed before (or committed: an attempt ends with its
    /// Commit, so even the committing attempt's id gets `Before`).
    Before,
    /// The token expired before the ledger's horizon: its record may have
    /// been collected, so it is refused (as `EXPIRED`).
    PastHorizon,
    /// Another attempt holds a live reservation of the token (`IN_USE`).
    InUse,
    /// The ledger holds as many records as it may (`--max-ledger-records`),
    /// or the token's tenant holds its share: nothing was recorded, and the
    /// call is refused (`OVERLOADED`) until garbage collection makes room.
    /// Only a key the ledger does not hold yet can meet this; a replay is
    /// still answered `Before`.
    Full,
    /// The same attempt (its keyed attempt hash) consumed the token before
    /// with a plain consume: the same success again.
    Again,
}

/// The outcome of a reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reserved {
    /// This call reserved the token under the lease; durable.
    Now(Lease),
    /// The same attempt holds a reservation of the token: the lease it
    /// holds (the same success again).
    Again(Lease),
    /// Consumed or committed before (`REPLAYED`).
    Before,
    /// As [`Consumed::PastHorizon`].
    PastHorizon,
    /// Another attempt's lease lives (`IN_USE`).
    InUse,
    /// As [`Consumed::Full`].
    Full,
}

/// A lease to ask for: the reservation's id (random, 16 bytes), the keyed
/// hash of the attempt, if the caller named one, how long, and the latest
/// end it may have (the token's expiry plus the clock skew its record is
/// kept for).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LeaseAsk {
    pub rid: [u8; 16],
    pub attempt: Option<[u8; 16]>,
    pub seconds: u32,
    pub cap: u64,
}

impl std::fmt::Debug for LeaseAsk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseAsk")
            .field("seconds", &self.seconds)
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

/// A reservation held: its id, when its lease ends and how long it was
/// granted for (both by the ledger's reference clock), and the keyed hash of
/// the attempt that took it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub rid: [u8; 16],
    pub end: LeaseEnd,
    pub attempt: Option<[u8; 16]>,
}

/// When a lease ends (Unix seconds) and the seconds it had left when granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseEnd {
    pub until: u64,
    pub seconds: u32,
}

impl LeaseEnd {
    /// The end of a lease of `seconds` granted at `now`, capped at `cap`.
    pub fn from(now: u64, seconds: u32, cap: u64) -> Self {
        let until = now.saturating_add(u64::from(seconds)).min(cap);
        LeaseEnd {
            until,
            seconds: u32::try_from(until.saturating_sub(now)).unwrap_or(u32::MAX),
        }
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("end", &self.end)
            .finish_non_exhaustive()
    }
}

/// The outcome of a commit or a renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// The reservation still held the token: committed (durably; now, or by
    /// an earlier commit of the same reservation), or renewed until the new
    /// end. A reservation whose lease ended but that nobody took over still
    /// holds the token.
    Yes(Option<LeaseEnd>),
    /// The reservation is gone: another attempt took the token over after
    /// its lease ended, or it was released or collected. Nothing was
    /// recorded.
    Lost,
}

/// The ledger could not answer. The detail is for logs only (it never holds
/// token, key or URL bytes) and never reaches a client. `Clone`: one
/// failed round answers every caller it held.
#[derive(Clone, Debug, thiserror::Error)]
pub enum LedgerError {
    /// The local store (sled, the file system) failed a step; the detail is
    /// the storage engine's or the operating system's own words.
    #[error("ledger unavailable: {step} failed: {detail}")]
    Storage { step: &'static str, detail: String },
    /// The database failed or refused a statement; the detail is the
    /// database's message and SQLSTATE, or the client library's words.
    #[error("ledger unavailable: {step}: {detail}")]
    Database { step: &'static str, detail: String },
    /// No answer within the limit.
    #[error("ledger unavailable: {step}: timed out after {limit:?}")]
    Timeout {
        step: &'static str,
        limit: std::time::Duration,
    },
    /// The ledger's writer (sled) or batcher (PostgreSQL) has stopped: the
    /// ledger failed for good, or is shutting down.
    #[error("ledger unavailable: the {0} stopped")]
    Stopped(&'static str),
    /// An earlier write failed and the ledger stopped for good, rather than
    /// answer from a state it cannot vouch for.
    #[error("ledger unavailable: stopped after an I/O failure; restart the process")]
    FailedForGood,
    /// Bytes read back are not what this version writes.
    #[error("ledger unavailable: corrupt data: {0}")]
    Corrupt(&'static str),
    /// TLS to the database failed when connecting.
    #[error("ledger unavailable: connect: {0}")]
    Tls(pgtls::TlsFailure),
    /// A setting of the ledger (URL, TLS files, session settings) cannot
    /// work.
    #[error("ledger unavailable: {0}")]
    Config(ConfigFault),
    /// `--require-synchronous-replication`, and the primary's last check did
    /// not find a synchronous standby: nothing is written.
    #[error("ledger unavailable: replication is {0}, and synchronous replication is required")]
    NotSynchronous(&'static str),
}

/// How the ledger's database replicates what it acknowledges, as its
/// primary last said (PostgreSQL; checked at start and periodically).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ReplicationMode {
    /// Not checked yet, or the check could not tell (no privilege to read
    /// `pg_stat_replication`'s states, or a standby answered).
    Unknown = 0,
    /// No standby streams: one server, nothing to fail over to.
    Standalone = 1,
    /// Standbys stream, none synchronously: a failover can lose
    /// acknowledged consumptions.
    Asynchronous = 2,
    /// A synchronous standby confirms every commit before it is answered.
    Synchronous = 3,
}

impl ReplicationMode {
    pub const ALL: [ReplicationMode; 4] = [
        ReplicationMode::Unknown,
        ReplicationMode::Standalone,
        ReplicationMode::Asynchronous,
        ReplicationMode::Synchronous,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ReplicationMode::Unknown => "unknown",
            ReplicationMode::Standalone => "standalone",
            ReplicationMode::Asynchronous => "asynchronous",
            ReplicationMode::Synchronous => "synchronous",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => ReplicationMode::Standalone,
            2 => ReplicationMode::Asynchronous,
            3 => ReplicationMode::Synchronous,
            _ => ReplicationMode::Unknown,
        }
    }
}

/// The replication of a ledger's database, for readiness and metrics.
#[derive(Debug, Default)]
pub struct Replication {
    mode: std::sync::atomic::AtomicU8,
    /// Standbys streaming from the primary, and those synchronous.
    pub standbys: AtomicU64,
    pub synchronous: AtomicU64,
}

impl Replication {
    pub fn mode(&self) -> ReplicationMode {
        ReplicationMode::from_u8(self.mode.load(std::sync::atomic::Ordering::Relaxed))
    }
    pub fn set(&self, mode: ReplicationMode, standbys: u64, synchronous: u64) -> ReplicationMode {
        use std::sync::atomic::Ordering::Relaxed;
        self.standbys.store(standbys, Relaxed);
        self.synchronous.store(synchronous, Relaxed);
        ReplicationMode::from_u8(self.mode.swap(mode as u8, Relaxed))
    }
}

/// Why a ledger's settings cannot work.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ConfigFault {
    #[error("invalid database URL (not shown)")]
    InvalidUrl,
    #[error("invalid sslmode (disable, prefer, require, verify-ca or verify-full)")]
    InvalidSslMode,
    #[error("sslmode={} needs sslrootcert (the CA that signed the server's certificate)", .0.as_str())]
    NeedsRootCert(pgtls::SslMode),
    #[error("TLS to PostgreSQL: no usable protocol version")]
    NoProtocolVersion,
    #[error("sslrootcert holds no usable CA certificate")]
    NoUsableCa,
    #[error("sslrootcert holds an unusable certificate")]
    UnusableCertificate,
    #[error("sslcert and sslkey do not form a usable client certificate")]
    UnusableClientCertificate,
    #[error("sslcert and sslkey go together")]
    CertWithoutKey,
    #[error("{what}: cannot read PEM certificates from {}", .path.display())]
    UnreadableCertificates {
        what: &'static str,
        path: std::path::PathBuf,
    },
    #[error("{what}: no certificate in {}", .path.display())]
    NoCertificate {
        what: &'static str,
        path: std::path::PathBuf,
    },
    #[error("sslkey: cannot read a PEM private key from {}", .0.display())]
    UnreadableKey(std::path::PathBuf),
    #[error(
        "PostgreSQL sessions run with synchronous_commit = {0}; stateseal needs on (or \
         remote_apply) so that a consumption is durable before its answer. Connect without \
         a pooler that drops startup options, or allow the role to set synchronous_commit"
    )]
    SynchronousCommitOff(String),
    #[error(
        "PostgreSQL sessions ignore the statement_timeout stateseal sets (a pooler that drops \
         startup options, such as PgBouncer with ignore_startup_parameters = options); connect \
         stateseal to PostgreSQL directly"
    )]
    StatementTimeoutIgnored,
    #[error(
        "the database endpoint refused stateseal's session options (unsupported startup \
         parameter), as PgBouncer does: stateseal does not run through PgBouncer in transaction \
         pooling mode; connect it to PostgreSQL directly"
    )]
    StartupOptionsRefused,
}

impl LedgerError {
    /// A failed step of the local store.
    pub fn storage(step: &'static str, e: impl std::fmt::Display) -> Self {
        LedgerError::Storage {
            step,
            detail: e.to_string(),
        }
    }
}

impl From<LedgerError> for ReferenceError {
    fn from(e: LedgerError) -> Self {
        ReferenceError(Box::new(e))
    }
}

/// Figures of a ledger that writes in rounds of its own (sled): batch sizes
/// show group commit at work; the record count against its bound. The
/// metrics read them.
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
    /// The bound on one tenant's records (`u64::MAX`: none).
    pub max_tenant_records: AtomicU64,
    /// The most records any one tenant holds (as of the last round).
    pub top_tenant_records: AtomicU64,
    /// Consumptions and reservations refused because their tenant held its
    /// share (counted in `refused_full` too).
    pub refused_tenant_full: AtomicU64,
    /// Reservations whose lease ended and that nobody took over, removed
    /// early by garbage collection.
    pub collected_leases: AtomicU64,
    /// sled: seconds added to the end of every lease an earlier process
    /// granted (0 until set).
    pub inherited_lease_grace: AtomicU64,
    /// sled: seconds a reservation's lease must have ended, by the
    /// ledger's own clock, before collection removes it (the clock skew;
    /// 0 until set).
    pub lease_collection_margin: AtomicU64,
    /// sled: leases are judged for collection by the ledger's own clock
    /// (set with the margin; otherwise by the horizon given).
    pub lease_collection_by_own_clock: AtomicBool,
    /// sled: the per-tenant share follows the tenants in force (the bound
    /// divided among them) rather than a configured number.
    pub share_by_tenants: AtomicBool,
}

/// The default share of one tenant: the record bound `max` divided among
/// `tenants` (at least one record each; none without a bound), so that no
/// set of tenants can take the room the others are given.
pub fn default_share(max: u64, tenants: u64) -> u64 {
    if max == u64::MAX {
        u64::MAX
    } else {
        (max / tenants.max(1)).max(1)
    }
}

/// A ledger is also the clock guard's [`Reference`]: the database's clock
/// (PostgreSQL) or the high-water mark it keeps (sled).
#[async_trait::async_trait]
pub trait Ledger: Reference + Send + Sync + 'static {
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
    /// Reserves `key` under the lease `ask` describes: absent, or reserved
    /// under a lease that ended, becomes reserved (taken over); consumed is
    /// `Before`; reserved under a live lease is `InUse` (`Again` for the
    /// same attempt). Lease ends are judged by the ledger's own clock: the
    /// database's for PostgreSQL, a monotonic clock for sled (no replica's
    /// wall-clock step moves either). Durable before the answer, like
    /// `consume`.
    async fn reserve(&self, key: &LedgerKey, ask: LeaseAsk) -> Result<Reserved, LedgerError>;
    /// Extends the reservation `rid` of `key` to `seconds` from the
    /// ledger's clock (capped at `cap`), while it still holds the token.
    async fn renew(
        &self,
        key: &LedgerKey,
        rid: [u8; 16],
        seconds: u32,
        cap: u64,
    ) -> Result<Held, LedgerError>;
    /// Turns the reservation `rid` of `key` into a consumption while it
    /// still holds the token (whether or not its lease ended); durable
    /// before the answer.
    async fn commit(&self, key: &LedgerKey, rid: [u8; 16]) -> Result<Held, LedgerError>;
    /// Removes the reservation `rid` of `key`, if it still holds it.
    async fn release(&self, key: &LedgerKey, rid: [u8; 16]) -> Result<(), LedgerError>;
    /// Whether the ledger can take consumptions now (readiness).
    async fn ready(&self) -> bool;
    /// Raises the horizon to `before_unix` (capped, where the ledger has a
    /// clock of its own, at that clock minus the skew), durably, then
    /// removes up to `limit` records that expired before the horizon, and
    /// up to `limit` reservations whose lease ended before `before_unix`
    /// (nobody took them over: the token is as if never opened, and its
    /// retry may reserve it afresh); returns how many it removed.
    async fn remove_expired(&self, before_unix: u64, limit: usize) -> Result<usize, LedgerError>;
    /// Makes everything recorded so far durable (at shutdown).
    async fn close(&self) -> Result<(), LedgerError>;
    /// A short backend name for logs and metrics.
    fn backend(&self) -> &'static str;
    /// Group-commit figures, where the backend keeps them.
    fn flush_stats(&self) -> Option<Arc<FlushStats>> {
        None
    }
    /// How the database replicates, where the backend checks it.
    fn replication(&self) -> Option<Arc<Replication>> {
        None
    }
    /// The tenants in force changed (a reload of the tenants file): a
    /// backend whose per-tenant share is the default (the record bound
    /// divided among the tenants) divides it anew.
    fn share_among(&self, _tenants: u64) {}
    /// Whether the ledger failed in a way it cannot recover from in this
    /// process (sled after a failed flush or fdatasync): the process must
    /// exit and be restarted.
    fn failed_for_good(&self) -> bool {
        false
    }
}

/// Garbage collection: every `every`, removes records that expired more than
/// `skew` seconds ago, in batches of `batch` — only while the clock guard
/// says the local clock agrees with the reference. `collected` is told how
/// many records each round that removed any removed.
pub async fn run_gc(
    ledger: Arc<dyn Ledger>,
    clock: Arc<dyn Clock>,
    guard: Arc<TimeGuard>,
    skew: u64,
    every: Duration,
    batch: usize,
    collected: impl Fn(u64) + Send + 'static,
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
            collected(removed as u64);
        }
    }
}

/// One round of a ledger's writer: `first`, then whatever `queued` holds
/// already, `max` in all at most (`first` always: a bound of 0 is taken as
/// 1); the rest stay queued for the next round.
/// Both backends batch this way (sled per journal record, PostgreSQL per
/// statement), so that a round's size is bounded however many callers wait.
pub(crate) fn gather<T>(first: T, queued: impl Iterator<Item = T>, max: usize) -> Vec<T> {
    let mut round = vec![first];
    round.extend(queued.take(max.saturating_sub(1)));
    round
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_takes_what_is_queued_up_to_its_bound_and_leaves_the_rest() {
        let mut queued = 1..10;
        assert_eq!(gather(0, queued.by_ref(), 4), [0, 1, 2, 3]);
        assert_eq!(queued.next(), Some(4), "the rest stay queued, in order");
        let mut queued = 1..3;
        assert_eq!(gather(0, queued.by_ref(), 4), [0, 1, 2]);
        assert_eq!(queued.next(), None);
        assert_eq!(
            gather(0, 1..3, 1),
            [0],
            "a bound of one takes the first only"
        );
    }

    #[test]
    fn debug_shows_expiries_and_leases_never_ids() {
        let key = LedgerKey {
            expires_at: 1_700_000_000,
            id: [0xab; 32],
            tenant: TenantTag::of("acme"),
        };
        assert_eq!(
            format!("{key:?}"),
            "LedgerKey { expires_at: 1700000000, .. }"
        );
        let ask = LeaseAsk {
            rid: [0xab; 16],
            attempt: Some([0xcd; 16]),
            seconds: 30,
            cap: 1_700_000_100,
        };
        assert_eq!(
            format!("{ask:?}"),
            "LeaseAsk { seconds: 30, cap: 1700000100, .. }"
        );
        let lease = Lease {
            rid: [0xab; 16],
            end: LeaseEnd::from(1_700_000_000, 30, u64::MAX),
            attempt: Some([0xcd; 16]),
        };
        assert_eq!(
            format!("{lease:?}"),
            "Lease { end: LeaseEnd { until: 1700000030, seconds: 30 }, .. }"
        );
    }
}
