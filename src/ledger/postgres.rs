//! The PostgreSQL ledger, for several replicas sharing one database.
//!
//! - Consumption is `INSERT … ON CONFLICT DO UPDATE … WHERE` (taking over
//!   only a reservation whose lease ended) `RETURNING id`, in autocommit: a
//!   row returned is a row committed (synchronous commit), and the primary
//!   key makes exactly one inserter see it.
//! - Concurrent consumptions are batched: one batcher task collects what
//!   arrived while earlier statements ran and sends it as one multi-row
//!   statement (`unnest` of two arrays), with several batches in flight on
//!   the pool's connections. Within a batch, a key that appears twice gets
//!   `Now` for its first waiter only; a later waiter with the same attempt
//!   gets `Again`, as it would a batch later.
//! - If a statement fails or passes the timeout, every waiter in its batch
//!   gets an error (`LEDGER_UNAVAILABLE`): an unknown outcome is never
//!   reported as a consumption.
//! - Expiry is stored as Unix seconds (UTC) from the token's authenticated
//!   header. The horizon — below which a record may be deleted, and so below
//!   which no new record is accepted — is judged by the *database's* clock
//!   (`statement_timestamp()` minus the skew), the one reference every
//!   replica shares: a replica whose own clock runs ahead can neither delete
//!   live rows nor have its late inserts accepted after a deletion.
//! - Expired rows are deleted in small batches by one replica at a time,
//!   under a transaction-scoped advisory lock.
//! - Every session runs with `statement_timeout` and `lock_timeout` below the
//!   client-side timeout and with `synchronous_commit = on` (checked at
//!   start: the service refuses to start when a pooler or the server
//!   overrides it). A statement that passes the client timeout is given up
//!   on the server by its statement timeout, and its connection is
//!   discarded, never reused (no cancel request: see [`abandon`]).
//! - A write's COMMIT that waits for a synchronous standby is never
//!   cancelled: PostgreSQL answers a cancel there by committing on the
//!   primary alone (a WARNING), visible to the next statement and lost at a
//!   failover (a retry of the same attempt would be told it consumed).
//! - Records are bounded as on sled (`--max-ledger-records` and each
//!   tenant's share): counted in [`COUNTS`], `(tenant, shard) -> n`,
//!   [`SHARDS`] rows per tenant (each statement counts in one, drawn at
//!   random), so that one tenant's writes do not all wait for one row and
//!   no row is shared by tenants.
//!   Every statement that inserts or deletes records updates its tenants'
//!   counts itself (a data-modifying CTE, in the same autocommit statement:
//!   no transaction, no COMMIT to cancel), and an insert checks its
//!   tenant's share in its own `WHERE`, against the counts its snapshot
//!   sees. The bound on all records is checked against each replica's own
//!   reading of the sum of the counts, taken every second
//!   ([`COUNT_EVERY`]) and moved by what that replica inserts and deletes
//!   meanwhile. Counting is exact; the checks are not serialized. A
//!   tenant's share can be passed by what its other statements in flight
//!   add (one per Reserve, up to a batch, [`MAX_BATCH`], per consume
//!   statement); the bound by that, plus what the other replicas inserted
//!   since their last reading: in practice a second's inserts. Counter rows
//!   are locked after the records (their update reads the records'
//!   statement to its end), one per tenant in tenant order, by one
//!   statement at a time, so two statements never wait for each other in a
//!   cycle there.
//!   Records of no tenant (written by a version before tenant tags) are
//!   counted under one tag of their own at the upgrade; those an older
//!   replica writes during a rolling upgrade are never counted (they age
//!   out). Each start, and the collector every [`RECOUNT_EVERY`], rebuild
//!   the counts from the table ([`rebuild_counts`]): what an older replica
//!   deleted without counting down does not stay counted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::pgtls::{self, PgTls, PgTlsFlags};

use super::{
    ConfigFault, Consumed, Held, Lease, LeaseAsk, LeaseEnd, Ledger, LedgerError, LedgerKey,
    Reserved,
};
use crate::clock::guard::{Reference, ReferenceError};

/// The table; the suffix is the schema version.
pub const TABLE: &str = "stateseal_consumed_v1";
/// The record counts: `(tenant, shard) -> n`; records written before
/// tenant tags under [`LEGACY_TENANT`].
pub const COUNTS: &str = "stateseal_counts_v1";
/// Counter rows per tenant: each statement counts in one of them, drawn at
/// random.
pub const SHARDS: u8 = 32;
/// The tag the upgrade gives records written before tenant tags (a real
/// tag has 8 bytes).
pub const LEGACY_TENANT: &[u8] = b"legacy";
/// Sums of counts are read within [0, this] (a count a hostile or broken
/// table drives past it cannot overflow a statement).
const CLAMP: i64 = 1 << 62;
/// How often each replica reads the sum of the counts (the bound on all
/// records is checked against it).
pub const COUNT_EVERY: Duration = Duration::from_secs(1);
/// Advisory lock ids ("stateseal" in ASCII, then a purpose).
const LOCK_MIGRATE: i64 = 0x7374_6174_6573_0001;
const LOCK_GC: i64 = 0x7374_6174_6573_0002;
/// Largest batch in one statement.
const MAX_BATCH: usize = 512;

/// Settings of the PostgreSQL ledger.
#[derive(Clone, Debug)]
pub struct PgOptions {
    /// Connections in the pool (and batches in flight at once).
    pub pool_size: usize,
    /// Bound on connecting, waiting for a connection, and each statement.
    pub timeout: Duration,
    /// Seconds records outlive their token (the service's clock skew).
    pub skew: u64,
    /// TLS settings given as flags; they override the URL's.
    pub tls: PgTlsFlags,
    /// Refuse writes (and readiness) unless the primary has a synchronous
    /// standby (`--require-synchronous-replication`).
    pub require_synchronous: bool,
    /// How often the primary's replication is checked.
    pub replication_every: Duration,
    /// How often the collector rebuilds the record counts from the table
    /// (and each start does): see [`rebuild_counts`].
    pub recount_every: Duration,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            pool_size: 8,
            timeout: Duration::from_secs(2),
            skew: 60,
            tls: PgTlsFlags::default(),
            require_synchronous: false,
            replication_every: Duration::from_secs(60),
            recount_every: RECOUNT_EVERY,
        }
    }
}

/// The default [`PgOptions::recount_every`].
pub const RECOUNT_EVERY: Duration = Duration::from_secs(600);

/// A consumption to decide: the key, the keyed hash of the caller's attempt
/// id (if any), and where the answer goes.
type Waiter = (
    LedgerKey,
    Option<[u8; 16]>,
    oneshot::Sender<Result<Consumed, LedgerError>>,
);

/// What the database holds for a key that was not inserted: its state, whether
/// a reservation's lease is live, and the attempt that made it.
type Existing = HashMap<[u8; 32], (i16, bool, Option<Vec<u8>>)>;

/// The record bounds, read by every statement that inserts a record.
#[derive(Debug)]
struct Bounds {
    /// Records in all (`u64::MAX`: no bound).
    max_records: AtomicU64,
    /// Records of one tenant (`u64::MAX`: no bound).
    max_tenant_records: AtomicU64,
    /// The tenant bound follows the tenants in force (the record bound
    /// divided among them).
    share_by_tenants: AtomicBool,
    /// The records counted in all, as this replica last read them and
    /// moved since by its own inserts and deletes.
    counted: std::sync::atomic::AtomicI64,
}

impl Bounds {
    /// (room left under the bound on all records, per-tenant bound) as
    /// statement parameters.
    fn params(&self) -> (i64, i64) {
        let p = |a: &AtomicU64| i64::try_from(a.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
        let max = p(&self.max_records);
        let room = if max == i64::MAX {
            i64::MAX
        } else {
            max.saturating_sub(self.counted.load(Ordering::Relaxed).max(0))
                .max(0)
        };
        (room, p(&self.max_tenant_records))
    }

    /// Records counted (+) or no longer counted (-) by this replica.
    fn moved(&self, by: i64) {
        self.counted.fetch_add(by, Ordering::Relaxed);
    }
}

/// The sum of the counts.
async fn read_counted(pool: &Pool, limit: Duration) -> Result<i64, LedgerError> {
    let client = timed("connect", limit, pool.get()).await?;
    let row = timed(
        "count",
        limit,
        client.query_one(
            &format!(
                "SELECT least(greatest(coalesce(sum(n), 0), 0), {CLAMP})::bigint FROM {COUNTS}"
            ),
            &[],
        ),
    )
    .await?;
    Ok(row.get(0))
}

/// Rebuilds the record counts from the table: one row per tenant, its
/// records counted by a scan, with the counts locked meanwhile (writes
/// wait at their count, which then follows the rebuild); under the
/// collector's lock, so one replica at a time (false when another held
/// it). Heals counts that changed behind this version's back: records an
/// older replica deleted during a rolling upgrade (it deletes without
/// counting down), or anything else that wrote the table. Each start runs
/// it, and the collector every [`PgOptions::recount_every`].
async fn rebuild_counts(pool: &Pool, limit: Duration) -> Result<bool, LedgerError> {
    let mut client = timed("connect", limit, pool.get()).await?;
    let tx = timed("begin", limit, client.transaction()).await?;
    let locked: bool = timed(
        "gc lock",
        limit,
        tx.query_one("SELECT pg_try_advisory_xact_lock($1)", &[&LOCK_GC]),
    )
    .await?
    .get(0);
    if !locked {
        return Ok(false);
    }
    timed(
        "recount",
        limit,
        tx.batch_execute(&format!(
            "LOCK TABLE {COUNTS} IN EXCLUSIVE MODE;
             DELETE FROM {COUNTS};
             INSERT INTO {COUNTS} (tenant, shard, n)
             SELECT tenant, 0, count(*) FROM {TABLE} WHERE tenant IS NOT NULL GROUP BY tenant"
        )),
    )
    .await?;
    timed("recount commit", limit, tx.commit()).await?;
    Ok(true)
}

/// Reads the sum of the counts every [`COUNT_EVERY`] while the ledger
/// lives (it holds the only strong reference to `bounds` beside the
/// batcher's); a failed reading keeps the last.
async fn read_total_every_second(pool: Pool, bounds: std::sync::Weak<Bounds>, limit: Duration) {
    loop {
        tokio::time::sleep(COUNT_EVERY).await;
        let Some(b) = bounds.upgrade() else { return };
        if b.max_records.load(Ordering::Relaxed) == u64::MAX {
            continue;
        }
        drop(b);
        let n = read_counted(&pool, limit).await;
        let Some(b) = bounds.upgrade() else { return };
        if let Ok(n) = n {
            b.counted.store(n, Ordering::Relaxed);
        }
    }
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            max_records: AtomicU64::new(u64::MAX),
            max_tenant_records: AtomicU64::new(u64::MAX),
            share_by_tenants: AtomicBool::new(false),
            counted: std::sync::atomic::AtomicI64::new(0),
        }
    }
}

pub struct PgLedger {
    pool: Pool,
    tx: mpsc::UnboundedSender<Waiter>,
    bounds: Arc<Bounds>,
    healthy: Arc<AtomicBool>,
    timeout: Duration,
    skew: i64,
    /// How far below the database's clock collection deletes: the skew plus
    /// the statement timeout, because an insert judges the horizon by its
    /// statement's start, and one that stalled (up to the timeout) must not
    /// land after collection deleted a record it would have found.
    collect_margin: i64,
    /// What the primary said of its standbys at the last check, when it
    /// was, and whether a synchronous one is required.
    replication: Arc<super::Replication>,
    replication_checked: std::sync::Mutex<Option<std::time::Instant>>,
    replication_every: Duration,
    require_synchronous: bool,
    /// Autovacuum does not cover the table: the collector vacuums it itself.
    self_vacuum: bool,
    last_vacuum: std::sync::Mutex<Option<std::time::Instant>>,
    recount_every: Duration,
    last_recount: std::sync::Mutex<std::time::Instant>,
}

impl std::fmt::Debug for PgLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URL: it may hold a password.
        f.debug_struct("PgLedger").finish_non_exhaustive()
    }
}

/// Parses a connection URL or key=value string with a fixed error message, so
/// that a password in it never reaches a log.
pub fn parse_url(url: &str) -> Result<tokio_postgres::Config, LedgerError> {
    url.parse::<tokio_postgres::Config>()
        .map_err(|_| LedgerError::Config(ConfigFault::InvalidUrl))
}

impl PgLedger {
    /// Connects, creates or migrates the schema (safe with several replicas
    /// starting at once), and starts the batcher.
    pub async fn connect(url: &str, opts: PgOptions) -> Result<Self, LedgerError> {
        let (url, tls) = PgTls::split(url)?;
        let tls = tls.override_with(&opts.tls);
        let mut cfg = parse_url(&url)?;
        cfg.ssl_mode(tls.wire_mode());
        let connector = tls.connector()?;
        cfg.connect_timeout(opts.timeout);
        if cfg.get_application_name().is_none() {
            cfg.application_name("stateseal");
        }
        // Server-side bounds below the client's, so a statement the client
        // gives up on is also given up on by the server; and durability of
        // every commit, whatever the database default says.
        let ms = opts.timeout.as_millis().max(10) as u64;
        let statement_ms = (ms * 3 / 4).max(5);
        let session = format!(
            "-c statement_timeout={} -c lock_timeout={} -c synchronous_commit=on",
            statement_ms,
            (ms / 2).max(5)
        );
        let options = match cfg.get_options() {
            Some(o) if !o.is_empty() => format!("{o} {session}"),
            _ => session,
        };
        cfg.options(&options);
        let cfg_probe = cfg.clone();
        let mgr = Manager::from_config(
            cfg,
            connector,
            ManagerConfig {
                // A connection is checked before it is handed out again.
                recycling_method: RecyclingMethod::Verified,
            },
        );
        let pool = Pool::builder(mgr)
            .max_size(opts.pool_size.max(1))
            .wait_timeout(Some(opts.timeout))
            .create_timeout(Some(opts.timeout))
            .recycle_timeout(Some(opts.timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| LedgerError::Database {
                step: "build the connection pool",
                detail: e.to_string(),
            })?;
        // The first connection tells TLS failures apart, in fixed words.
        match tokio::time::timeout(opts.timeout, pool.get()).await {
            Ok(Ok(client)) => drop(client),
            Ok(Err(e)) => {
                if let deadpool_postgres::PoolError::Backend(be) = &e {
                    if let Some(failure) = pgtls::tls_failure(be, tls.mode) {
                        return Err(LedgerError::Tls(failure));
                    }
                    // PgBouncer refuses the `options` startup parameter.
                    if be.as_db_error().is_some_and(|d| {
                        *d.code() == tokio_postgres::error::SqlState::PROTOCOL_VIOLATION
                            && d.message().starts_with("unsupported startup parameter")
                    }) {
                        return Err(LedgerError::Config(ConfigFault::StartupOptionsRefused));
                    }
                    // A server that answers the TLS request with `N` fails
                    // the connection before any TLS runs: ask it the same
                    // question (one short connection, at most a second).
                    let requires_tls =
                        !matches!(tls.mode, pgtls::SslMode::Disable | pgtls::SslMode::Prefer);
                    let limit = opts.timeout.min(Duration::from_secs(1));
                    if requires_tls
                        && pgtls::server_offers_tls(&cfg_probe, limit).await == Some(false)
                    {
                        return Err(LedgerError::Tls(pgtls::TlsFailure::NotOffered(tls.mode)));
                    }
                }
                return Err(db_err("connect", e.operator_text()));
            }
            Err(_) => {
                return Err(LedgerError::Timeout {
                    step: "connect",
                    limit: opts.timeout,
                })
            }
        }
        if tls.mode == pgtls::SslMode::Disable {
            tracing::warn!(
                sslmode = tls.mode.as_str(),
                "the connection to PostgreSQL is not encrypted: ledger ids and the database \
                 password cross the network in the clear; use sslmode=verify-full with sslrootcert"
            );
        } else if tls.mode == pgtls::SslMode::Prefer
            || tls.mode == pgtls::SslMode::Require && tls.root_cert.is_none()
        {
            tracing::warn!(
                sslmode = tls.mode.as_str(),
                "the PostgreSQL server's certificate is not verified; use sslmode=verify-full with sslrootcert"
            );
        }
        migrate(&pool, opts.timeout).await?;
        check_session(&pool, opts.timeout).await?;
        let self_vacuum = !autovacuum_covers_table(&pool, opts.timeout).await?;
        if self_vacuum {
            tracing::warn!(
                table = TABLE,
                "autovacuum is off for the ledger table: the garbage collector will VACUUM it \
                 itself after collecting (at most once a minute), so that deleted rows give \
                 their space back"
            );
        }
        let healthy = Arc::new(AtomicBool::new(true));
        let bounds = Arc::new(Bounds::default());
        if let Err(e) = rebuild_counts(&pool, opts.timeout).await {
            tracing::warn!(error = %e, "the record counts were not rebuilt at start; the collector tries again");
        }
        bounds
            .counted
            .store(read_counted(&pool, opts.timeout).await?, Ordering::Relaxed);
        tokio::spawn(read_total_every_second(
            pool.clone(),
            Arc::downgrade(&bounds),
            opts.timeout,
        ));
        let (tx, rx) = mpsc::unbounded_channel();
        let skew = i64::try_from(opts.skew).unwrap_or(i64::MAX);
        // The batcher ends when the ledger, its only sender, is dropped (after
        // sending what was queued: waiters whose callers were cancelled, as
        // while it runs). close() closes the pool first, so nothing is
        // written after it.
        tokio::spawn(run_batcher(
            pool.clone(),
            rx,
            healthy.clone(),
            opts.timeout,
            opts.pool_size.max(1),
            skew,
            bounds.clone(),
        ));
        let ledger = PgLedger {
            pool,
            tx,
            bounds,
            healthy,
            timeout: opts.timeout,
            skew,
            collect_margin: skew
                .saturating_add(i64::try_from(statement_ms.div_ceil(1000)).unwrap_or(i64::MAX)),
            replication: Arc::default(),
            replication_checked: std::sync::Mutex::new(None),
            replication_every: opts.replication_every,
            require_synchronous: opts.require_synchronous,
            self_vacuum,
            last_vacuum: std::sync::Mutex::new(None),
            recount_every: opts.recount_every,
            last_recount: std::sync::Mutex::new(std::time::Instant::now()),
        };
        // The first check, before the server starts: logged (a warning for
        // asynchronous standbys); with `require_synchronous`, anything but
        // synchronous keeps the replica NOT_SERVING until a check finds it.
        ledger.check_replication().await;
        Ok(ledger)
    }

    /// Bounds the records the ledger may hold (`u64::MAX`: none): past it,
    /// a consumption or reservation of a key it does not hold is answered
    /// [`Consumed::Full`], nothing recorded, until collection makes room.
    /// Concurrent statements can pass it by what they add at once (see the
    /// module's notes).
    pub fn with_max_records(self, max: u64) -> Self {
        self.bounds.max_records.store(max, Ordering::Relaxed);
        self
    }

    /// Bounds the records of any one tenant (`u64::MAX`: none), as
    /// [`Self::with_max_records`] does all of them.
    pub fn with_max_tenant_records(self, max: u64) -> Self {
        self.bounds.max_tenant_records.store(max, Ordering::Relaxed);
        self
    }

    /// Divides the record bound among `tenants` (the default share, set
    /// again at each reload of the tenants file).
    pub fn with_share_among(self, tenants: u64) -> Self {
        self.bounds.share_by_tenants.store(true, Ordering::Relaxed);
        self.share_among(tenants);
        self
    }

    /// Asks the primary how it replicates, records it, and says so in the
    /// log when it changed. A check that fails (the database unreachable)
    /// changes nothing: the probe reports that.
    async fn check_replication(&self) {
        *self
            .replication_checked
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
        let Ok((mode, standbys, synchronous)) = replication_of(&self.pool, self.timeout).await
        else {
            return;
        };
        let before = self.replication.set(mode, standbys, synchronous);
        if before == mode {
            return;
        }
        match mode {
            super::ReplicationMode::Asynchronous => tracing::warn!(
                standbys,
                required = self.require_synchronous,
                "PostgreSQL replicates asynchronously: a failover can lose consumptions already \
                 answered (and repeat handlers); run synchronous replication (Patroni: \
                 synchronous_mode: true; see docs/operations.md)"
            ),
            super::ReplicationMode::Unknown => tracing::warn!(
                required = self.require_synchronous,
                "PostgreSQL replication cannot be checked (grant the ledger's role pg_monitor, \
                 or the database answered as a standby)"
            ),
            super::ReplicationMode::Standalone if self.require_synchronous => {
                tracing::warn!("PostgreSQL has no standby, and synchronous replication is required")
            }
            _ => tracing::info!(
                standbys,
                synchronous,
                mode = mode.as_str(),
                "PostgreSQL replication"
            ),
        }
    }

    fn replication_due(&self) -> bool {
        self.replication_checked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none_or(|t| t.elapsed() >= self.replication_every)
    }

    /// With `--require-synchronous-replication`: nothing is written while
    /// the last check found no synchronous standby.
    fn admit_write(&self) -> Result<(), LedgerError> {
        let mode = self.replication.mode();
        if self.require_synchronous && mode != super::ReplicationMode::Synchronous {
            return Err(LedgerError::NotSynchronous(mode.as_str()));
        }
        Ok(())
    }
}

/// How the primary replicates: its streaming standbys, the synchronous
/// ones, and whether commits wait for them (`synchronous_commit` as this
/// session has it, and `synchronous_standby_names`). The standbys' states
/// are visible to superusers and members of `pg_read_all_stats` (or
/// `pg_monitor`) only: without, they read as NULL and the mode is unknown.
async fn replication_of(
    pool: &Pool,
    limit: Duration,
) -> Result<(super::ReplicationMode, u64, u64), LedgerError> {
    use super::ReplicationMode as M;
    let client = timed("connect", limit, pool.get()).await?;
    let row = timed(
        "replication check",
        limit,
        client.query_one(
            // Schema-qualified: a view of the same name earlier on the
            // role's search_path cannot answer for them.
            "SELECT pg_catalog.pg_is_in_recovery(),
                    pg_catalog.current_setting('synchronous_commit'),
                    pg_catalog.current_setting('synchronous_standby_names'),
                    count(r.pid),
                    count(r.pid) FILTER (WHERE r.state = 'streaming'
                                           AND r.sync_state IN ('sync', 'quorum')),
                    count(r.pid) FILTER (WHERE r.state IS NULL OR r.sync_state IS NULL)
               FROM (SELECT 1) AS one LEFT JOIN pg_catalog.pg_stat_replication r ON true",
            &[],
        ),
    )
    .await?;
    let (recovery, commit, names): (bool, String, String) = (row.get(0), row.get(1), row.get(2));
    let (standbys, sync, hidden): (i64, i64, i64) = (row.get(3), row.get(4), row.get(5));
    let (standbys, sync) = (standbys.max(0) as u64, sync.max(0) as u64);
    let waits = matches!(commit.as_str(), "on" | "remote_apply" | "remote_write");
    let mode = if recovery || hidden > 0 {
        M::Unknown
    } else if standbys == 0 {
        M::Standalone
    } else if sync > 0 && waits && !names.trim().is_empty() {
        M::Synchronous
    } else {
        M::Asynchronous
    };
    Ok((mode, standbys, sync))
}

fn is_retryable(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    matches!(e.code(), Some(c) if *c == SqlState::T_R_DEADLOCK_DETECTED
        || *c == SqlState::T_R_SERIALIZATION_FAILURE
        || *c == SqlState::LOCK_NOT_AVAILABLE)
}

/// The most characters of the database's message an error keeps.
const MESSAGE_CHARS: usize = 256;

/// An error with its SQLSTATE and the server's primary message: never its
/// DETAIL, where PostgreSQL puts row values (PostgreSQL's own primary
/// messages for these statements hold no bound parameter values). The
/// message is the server's text, so it is bounded and kept to one line.
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let message: String = db
                .message()
                .chars()
                .take(MESSAGE_CHARS)
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect();
            format!("{message} ({})", db.code().code())
        }
        None => e.to_string(),
    }
}

/// What an error tells the operator: the database's own words where it
/// answered (tokio-postgres and deadpool display those as a bare "db
/// error").
trait OperatorText {
    fn operator_text(&self) -> String;
}

impl OperatorText for tokio_postgres::Error {
    fn operator_text(&self) -> String {
        describe(self)
    }
}

impl OperatorText for deadpool_postgres::PoolError {
    fn operator_text(&self) -> String {
        match self {
            deadpool_postgres::PoolError::Backend(e) => describe(e),
            other => other.to_string(),
        }
    }
}

fn db_err(step: &'static str, e: impl std::fmt::Display) -> LedgerError {
    // tokio-postgres and deadpool errors name the failure, not the URL.
    LedgerError::Database {
        step,
        detail: e.to_string(),
    }
}

async fn timed<T, E: OperatorText>(
    what: &'static str,
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, LedgerError> {
    match tokio::time::timeout(limit, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(db_err(what, e.operator_text())),
        Err(_) => Err(LedgerError::Timeout { step: what, limit }),
    }
}

async fn migrate(pool: &Pool, limit: Duration) -> Result<(), LedgerError> {
    let mut client = timed("connect", limit, pool.get()).await?;
    let tx = timed("begin", limit, client.transaction()).await?;
    // The migration lock and the DDL get five times the statement timeout,
    // on the server too: the session's own statement_timeout and
    // lock_timeout (below the client's bound) would otherwise cut a start
    // that waits for another replica's migration, or for the table lock an
    // ALTER TABLE needs while old replicas still write.
    let slow = limit * 5;
    let ms = slow.as_millis().max(50);
    timed(
        "migration timeouts",
        limit,
        tx.batch_execute(&format!(
            "SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}"
        )),
    )
    .await?;
    // Serializes concurrent starts: CREATE … IF NOT EXISTS alone can race.
    timed(
        "migration lock",
        slow,
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_MIGRATE]),
    )
    .await?;
    // The counts are new in this version: made from the records once, when
    // the table of counts is created (under the lock, so once).
    let uncounted: bool = timed(
        "migration check",
        slow,
        tx.query_one(&format!("SELECT to_regclass('{COUNTS}') IS NULL"), &[]),
    )
    .await?
    .get(0);
    let ddl = format!(
        "CREATE TABLE IF NOT EXISTS {TABLE} (
             id bytea PRIMARY KEY CHECK (octet_length(id) = 32),
             expires_at bigint NOT NULL
         );
         CREATE INDEX IF NOT EXISTS {TABLE}_expires_at ON {TABLE} (expires_at);
         -- Reservations (two-phase consumption): state 1 = reserved under
         -- (rid, lease_until), 2 = consumed.
         ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS state smallint NOT NULL DEFAULT 2;
         ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS lease_until bigint;
         ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS rid bytea;
         -- Keyed hash of the caller's attempt id (idempotent retries).
         ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS attempt bytea;
         -- Reservations by the end of their lease: collected once it ended
         -- (by the database's clock) and nobody took them over.
         CREATE INDEX IF NOT EXISTS {TABLE}_lease_until ON {TABLE} (lease_until)
          WHERE state = 1;
         -- The owner's tenant tag (NULL: written before tags), for the
         -- per-tenant record bound.
         ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS tenant bytea;
         CREATE TABLE IF NOT EXISTS {COUNTS} (
             tenant bytea NOT NULL,
             shard smallint NOT NULL,
             n bigint NOT NULL,
             PRIMARY KEY (tenant, shard)
         );"
    );
    timed("migrate", slow, tx.batch_execute(&ddl)).await?;
    if uncounted {
        let count = format!(
            "WITH r AS (UPDATE {TABLE} SET tenant = $1 WHERE tenant IS NULL
                        RETURNING id, tenant, true AS fresh),
                  o AS (SELECT id, tenant, true AS fresh FROM {TABLE} WHERE tenant IS NOT NULL
                        UNION ALL SELECT * FROM r) {}",
            count_cte("o", '+')
        );
        timed("count records", slow, tx.execute(&count, &[&LEGACY_TENANT])).await?;
    }
    timed("commit", limit, tx.commit()).await?;
    Ok(())
}

/// Whether autovacuum runs on the ledger table (globally on, and not
/// switched off for the table).
async fn autovacuum_covers_table(pool: &Pool, limit: Duration) -> Result<bool, LedgerError> {
    let client = timed("connect", limit, pool.get()).await?;
    let row = timed(
        "autovacuum check",
        limit,
        client.query_one(
            &format!(
                "SELECT current_setting('autovacuum') = 'on'
                    AND NOT coalesce((SELECT 'autovacuum_enabled=false' = ANY(reloptions)
                                        FROM pg_class WHERE oid = '{TABLE}'::regclass), false)"
            ),
            &[],
        ),
    )
    .await?;
    Ok(row.get(0))
}

/// Refuses to run on sessions that would not make each consumption durable
/// before its answer (e.g. a pooler that drops startup options, or a role
/// that forces `synchronous_commit = off`).
async fn check_session(pool: &Pool, limit: Duration) -> Result<(), LedgerError> {
    let client = timed("connect", limit, pool.get()).await?;
    let row = timed(
        "session check",
        limit,
        client.query_one(
            "SELECT current_setting('synchronous_commit'), current_setting('statement_timeout')",
            &[],
        ),
    )
    .await?;
    let sync: String = row.get(0);
    let stmt: String = row.get(1);
    if !matches!(sync.as_str(), "on" | "remote_apply") {
        return Err(LedgerError::Config(ConfigFault::SynchronousCommitOff(sync)));
    }
    if stmt == "0" {
        return Err(LedgerError::Config(ConfigFault::StatementTimeoutIgnored));
    }
    Ok(())
}

async fn run_batcher(
    pool: Pool,
    mut rx: mpsc::UnboundedReceiver<Waiter>,
    healthy: Arc<AtomicBool>,
    limit: Duration,
    in_flight: usize,
    skew: i64,
    bounds: Arc<Bounds>,
) {
    let slots = Arc::new(Semaphore::new(in_flight));
    while let Some(first) = rx.recv().await {
        // Wait for a free connection slot first: whatever queues up
        // meanwhile joins this batch.
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let batch = super::gather(first, std::iter::from_fn(|| rx.try_recv().ok()), MAX_BATCH);
        let pool = pool.clone();
        let healthy = healthy.clone();
        let bounds = bounds.clone();
        tokio::spawn(async move {
            let result = insert_batch(&pool, &batch, limit, skew, &bounds).await;
            healthy.store(result.is_ok(), Ordering::Relaxed);
            drop(permit);
            match result {
                Ok((inserted, horizon, existing)) => {
                    // Each inserted id, with the attempt it was inserted
                    // with once its first waiter (in arrival order, as the
                    // insert's stable sort kept it) has taken it.
                    let mut fresh: HashMap<[u8; 32], Option<Option<[u8; 16]>>> =
                        inserted.into_iter().map(|id| (id, None)).collect();
                    for (key, attempt, reply) in batch {
                        // The first waiter of an inserted id gets Now; a later
                        // waiter of the same id, Again if it is the same
                        // attempt and Before if not, as if it had come a
                        // batch later; a key found in the table is judged by
                        // what is there; a key below the database's horizon,
                        // PastHorizon; one neither inserted nor there, Full
                        // (no room for it, or its tenant's share is held).
                        let c = match fresh.get_mut(&key.id) {
                            Some(first @ None) => {
                                *first = Some(attempt);
                                Consumed::Now
                            }
                            Some(Some(first)) => {
                                if attempt.is_some() && attempt == *first {
                                    Consumed::Again
                                } else {
                                    Consumed::Before
                                }
                            }
                            None if i64::try_from(key.expires_at).unwrap_or(i64::MAX) < horizon => {
                                Consumed::PastHorizon
                            }
                            None => match existing.get(&key.id) {
                                Some((1, _, _)) => Consumed::InUse,
                                Some((_, _, Some(a)))
                                    if attempt.is_some_and(|x| x[..] == a[..]) =>
                                {
                                    Consumed::Again
                                }
                                Some(_) => Consumed::Before,
                                None => Consumed::Full,
                            },
                        };
                        let _ = reply.send(Ok(c));
                    }
                }
                Err(e) => {
                    for (_, _, reply) in batch {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
            }
        });
    }
}

/// Inserts the batch, within `room` (the record bound, and each tenant's,
/// as statement parameters); returns the ids inserted now (or taken over
/// from an expired reservation), the database's horizon for this statement
/// (keys that expired before it are not inserted), and what the table holds
/// of the others.
async fn insert_batch(
    pool: &Pool,
    batch: &[Waiter],
    limit: Duration,
    skew: i64,
    bounds: &Bounds,
) -> Result<(Vec<[u8; 32]>, i64, Existing), LedgerError> {
    // Rows go in sorted by id (ORDER BY below), so that concurrent batches on
    // other replicas take their row locks in the same order and cannot
    // deadlock on overlapping keys. A stable sort keeps the first waiter of
    // an id first: its attempt is the one recorded.
    /// (id, expiry, attempt hash, tenant tag) of one row to insert.
    type Row<'a> = (&'a [u8], i64, Option<&'a [u8]>, &'a [u8]);
    let mut keys: Vec<Row<'_>> = batch
        .iter()
        .map(|(k, a, _)| {
            (
                &k.id[..],
                i64::try_from(k.expires_at).unwrap_or(i64::MAX),
                a.as_ref().map(|a| &a[..]),
                &k.tenant.0[..],
            )
        })
        .collect();
    keys.sort_by(|a, b| a.0.cmp(b.0));
    keys.dedup_by(|a, b| a.0 == b.0);
    let ids: Vec<&[u8]> = keys.iter().map(|k| k.0).collect();
    let expiries: Vec<i64> = keys.iter().map(|k| k.1).collect();
    let attempts: Vec<Option<&[u8]>> = keys.iter().map(|k| k.2).collect();
    let tenants: Vec<&[u8]> = keys.iter().map(|k| k.3).collect();
    let (room_all, max_tenant) = bounds.params();
    let client = timed("connect", limit, pool.get()).await?;
    // One statement: the horizon by the database's clock; the room, as the
    // counts in this statement's snapshot have it: each tenant's new keys
    // (not in the table: a replay or takeover needs no room), in id order,
    // up to its share, then all of them up to the bound; the insert of
    // every key at or above the horizon and within the room; the counts of
    // the rows inserted (not those taken over); and the horizon itself as
    // the last row.
    let sql = format!(
        "WITH h AS (SELECT extract(epoch FROM statement_timestamp())::bigint - $3 AS horizon),
              t AS (
                SELECT u.id, u.expires_at, u.attempt, u.tenant,
                       EXISTS (SELECT 1 FROM {TABLE} x WHERE x.id = u.id) AS present
                  FROM unnest($1::bytea[], $2::bigint[], $4::bytea[], $5::bytea[])
                       AS u(id, expires_at, attempt, tenant), h
                 WHERE u.expires_at >= h.horizon),
              held AS (
                SELECT c.tenant, least(greatest(sum(c.n), 0), {CLAMP})::bigint AS n FROM {COUNTS} c
                 WHERE c.tenant = ANY($5::bytea[])
                 GROUP BY c.tenant),
              by_tenant AS (
                SELECT t.*, count(*) FILTER (WHERE NOT t.present)
                              OVER (PARTITION BY t.tenant ORDER BY t.id) AS nth
                  FROM t),
              in_share AS (
                SELECT b.* FROM by_tenant b LEFT JOIN held ON held.tenant = b.tenant
                 WHERE b.present OR b.nth <= $7 - coalesce(held.n, 0)),
              in_all AS (
                SELECT i.*, count(*) FILTER (WHERE NOT i.present) OVER (ORDER BY i.id) AS nth_all
                  FROM in_share i),
              ins AS (
                INSERT INTO {TABLE} (id, expires_at, attempt, tenant)
                SELECT a.id, a.expires_at, a.attempt, a.tenant FROM in_all a
                 WHERE a.present OR a.nth_all <= $6
                 ORDER BY a.id
                ON CONFLICT (id) DO UPDATE
                   SET state = 2, lease_until = NULL, rid = NULL, attempt = EXCLUDED.attempt
                 WHERE {TABLE}.state = 1
                   AND {TABLE}.lease_until < extract(epoch FROM statement_timestamp())::bigint
                RETURNING id, tenant, xmax = 0 AS fresh),
              counted AS ({count})
         SELECT id, NULL::bigint, fresh AND tenant IS NOT NULL FROM ins
         UNION ALL SELECT NULL::bytea, horizon, NULL FROM h",
        count = count_cte("ins", '+')
    );
    let mut attempt = 0;
    let rows = loop {
        attempt += 1;
        match durable_write(
            "insert",
            limit,
            &client,
            &sql,
            &[
                &ids,
                &expiries,
                &skew,
                &attempts,
                &tenants,
                &room_all,
                &max_tenant,
            ],
        )
        .await
        {
            Ok(rows) => break rows,
            // A deadlock or serialization failure rolled the statement back
            // whole: nothing was committed, so one retry is safe.
            Err(WriteFailure::Database(e)) if attempt < 3 && is_retryable(&e) => continue,
            Err(f) => return Err(f.settle("insert", client)),
        }
    };
    let mut inserted = Vec::with_capacity(rows.len());
    let mut horizon = None;
    let mut counted = 0;
    for r in &rows {
        match r.get::<_, Option<&[u8]>>(0) {
            Some(id) => {
                inserted.push(
                    <[u8; 32]>::try_from(id)
                        .map_err(|_| LedgerError::Corrupt("unexpected id length"))?,
                );
                counted += i64::from(r.get::<_, Option<bool>>(2).unwrap_or(false));
            }
            None => horizon = r.get::<_, Option<i64>>(1),
        }
    }
    bounds.moved(counted);
    let horizon = horizon.ok_or(LedgerError::Corrupt("no horizon row"))?;
    // Keys that were not inserted: consumed before (by this attempt or
    // another), reserved under a live lease (IN_USE), or not there (no
    // room). Asked only when there are any; a reservation's state is 1 only
    // while its lease lives (an ended one was taken over by the insert).
    let mut existing = Existing::new();
    if inserted.len() < ids.len() {
        let rows = timed(
            "existing check",
            limit,
            client.query(
                &format!(
                    "SELECT id, state, coalesce(lease_until >=
                              extract(epoch FROM statement_timestamp())::bigint, false),
                            CASE WHEN rid IS NULL THEN attempt END
                       FROM {TABLE} WHERE id = ANY($1)"
                ),
                &[&ids],
            ),
        )
        .await?;
        for r in &rows {
            let id: &[u8] = r.get(0);
            if let Ok(id) = <[u8; 32]>::try_from(id) {
                existing.insert(id, (r.get(1), r.get(2), r.get(3)));
            }
        }
    }
    Ok((inserted, horizon, existing))
}

/// A statement's CTE that counts the records the CTE `rows` returned
/// (columns `id`, `tenant`, and `fresh`: only those with it set count) into
/// [`COUNTS`], added with `sign` `+` or subtracted with `-`, into one row
/// per tenant: the shard drawn for this statement (a tenant's count is the
/// sum of its rows, whichever shard a record went in or out by, so a
/// statement locks one row per tenant and statements rarely meet on one);
/// a record of no tenant (an older replica's, during a rolling upgrade) is
/// not counted either way. In tenant order, after every row of `rows` (the
/// grouping reads them all first): see the module's notes on locks.
fn count_cte(rows: &str, sign: char) -> String {
    let shard = rand::random::<u8>() % SHARDS;
    format!(
        "INSERT INTO {COUNTS} AS c (tenant, shard, n)
         SELECT r.tenant, {shard}::smallint, {sign}count(*)
           FROM {rows} r
          WHERE r.fresh AND r.tenant IS NOT NULL
          GROUP BY 1 ORDER BY 1
         ON CONFLICT (tenant, shard) DO UPDATE SET n = c.n + EXCLUDED.n"
    )
}

/// A lease ending at `until`, read at the database's `now`.
fn lease_end(until: i64, now: i64) -> LeaseEnd {
    LeaseEnd {
        until: u64::try_from(until).unwrap_or(0),
        seconds: u32::try_from(until.saturating_sub(now).max(0)).unwrap_or(u32::MAX),
    }
}

/// A connection whose statement passed the client timeout is taken out of
/// the pool (it closes when the last handle drops), never handed to the
/// next caller. No cancel request is sent: a write's statement is bounded by
/// the server's statement timeout already, and a cancel that reached its
/// COMMIT while it waited for a synchronous standby would make PostgreSQL
/// commit locally and answer with a mere WARNING: the row visible on a
/// primary whose standbys never got it, and lost at the failover.
fn abandon(client: deadpool_postgres::Object) {
    drop(deadpool_postgres::Object::take(client));
}

/// One write (a consumption, reservation, renewal, commit or release) on a
/// pooled connection, in autocommit, bounded by `limit`: a connection that
/// passes it is abandoned (no cancel request, see [`abandon`]); the outcome
/// is then unknown (`LEDGER_UNAVAILABLE`), never reported as done. The
/// statement is bounded on the server by its statement timeout, which
/// PostgreSQL lifts before the commit: a COMMIT that waits for a
/// synchronous standby waits as long as it takes, and becomes visible only
/// once the standby has it.
async fn durable_write(
    what: &'static str,
    limit: Duration,
    client: &deadpool_postgres::Object,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>, WriteFailure> {
    let stmt = timed("prepare", limit, client.prepare_cached(sql))
        .await
        .map_err(WriteFailure::Ledger)?;
    match tokio::time::timeout(limit, client.query(&stmt, params)).await {
        Ok(Ok(rows)) => Ok(rows),
        Ok(Err(e)) => Err(WriteFailure::Database(e)),
        Err(_) => Err(WriteFailure::TimedOut(LedgerError::Timeout {
            step: what,
            limit,
        })),
    }
}

/// Why a durable write failed: the database refused it (the connection is
/// fine), or it passed the bound (the connection must be abandoned).
enum WriteFailure {
    Database(tokio_postgres::Error),
    TimedOut(LedgerError),
    Ledger(LedgerError),
}

impl WriteFailure {
    /// As the caller reports it, abandoning `client` after a timeout.
    fn settle(self, what: &'static str, client: deadpool_postgres::Object) -> LedgerError {
        match self {
            WriteFailure::Database(e) => db_err(what, e.operator_text()),
            WriteFailure::TimedOut(e) => {
                abandon(client);
                e
            }
            WriteFailure::Ledger(e) => e,
        }
    }
}

impl PgLedger {
    fn vacuum_due(&self) -> bool {
        let mut last = self.last_vacuum.lock().unwrap_or_else(|e| e.into_inner());
        vacuum_due(&mut last, std::time::Instant::now())
    }
}

/// The bounds of the ledger's own VACUUM: the server's statement timeout
/// for it (eight statement timeouts: it scans the whole table), and the
/// client's (two more, for the SET and RESET around it).
fn vacuum_limits(timeout: Duration) -> (Duration, Duration) {
    (timeout * 8, timeout * 10)
}

/// The ledger's own VACUUM runs at most once a minute: due at `now` when
/// none ran yet or the last began a minute or more before; a due one is
/// recorded as begun at `now`.
fn vacuum_due(last: &mut Option<std::time::Instant>, now: std::time::Instant) -> bool {
    let due = last.is_none_or(|t| now.saturating_duration_since(t) >= VACUUM_EVERY);
    if due {
        *last = Some(now);
    }
    due
}

const VACUUM_EVERY: Duration = Duration::from_secs(60);

#[async_trait::async_trait]
impl Reference for PgLedger {
    /// The database's clock: every replica judges its own by it.
    async fn reference_now(&self) -> Result<Option<u64>, ReferenceError> {
        Ok(self.database_now().await?)
    }
}

impl PgLedger {
    async fn database_now(&self) -> Result<Option<u64>, LedgerError> {
        let client = timed("connect", self.timeout, self.pool.get()).await?;
        let row = timed(
            "clock",
            self.timeout,
            client.query_one("SELECT extract(epoch FROM clock_timestamp())::bigint", &[]),
        )
        .await?;
        let t: i64 = row.get(0);
        Ok(u64::try_from(t).ok())
    }
}

#[async_trait::async_trait]
impl Ledger for PgLedger {
    async fn consume_as(
        &self,
        key: &LedgerKey,
        attempt: Option<[u8; 16]>,
    ) -> Result<Consumed, LedgerError> {
        self.admit_write()?;
        let (tx, rx) = oneshot::channel();
        self.tx
            .send((*key, attempt, tx))
            .map_err(|_| LedgerError::Stopped("batcher"))?;
        rx.await.map_err(|_| LedgerError::Stopped("batcher"))?
    }

    async fn ready(&self) -> bool {
        let probe = async {
            let client = timed("connect", self.timeout, self.pool.get()).await?;
            timed("probe", self.timeout, client.simple_query("SELECT 1")).await?;
            Ok::<_, LedgerError>(())
        };
        let ok = probe.await.is_ok();
        self.healthy.store(ok, Ordering::Relaxed);
        if ok && self.replication_due() {
            self.check_replication().await;
        }
        ok && self.admit_write().is_ok()
    }

    fn replication(&self) -> Option<Arc<super::Replication>> {
        Some(self.replication.clone())
    }

    async fn reserve(&self, key: &LedgerKey, ask: LeaseAsk) -> Result<Reserved, LedgerError> {
        self.admit_write()?;
        let id = &key.id[..];
        let exp = i64::try_from(key.expires_at).unwrap_or(i64::MAX);
        let secs = i64::from(ask.seconds);
        let cap = i64::try_from(ask.cap).unwrap_or(i64::MAX);
        let rid = &ask.rid[..];
        let attempt = ask.attempt.as_ref().map(|a| &a[..]);
        let tenant = &key.tenant.0[..];
        let (room_all, max_tenant) = self.bounds.params();
        let client = timed("connect", self.timeout, self.pool.get()).await?;
        // Every time here is the database's: the lease's end, whether a
        // held lease ended (a takeover), and the horizon. A key not in the
        // table needs room (its tenant's share, and the bound), as the
        // counts in this statement's snapshot have it; a row inserted is
        // counted in the same statement.
        let sql = format!(
            "WITH h AS (SELECT extract(epoch FROM statement_timestamp())::bigint AS now),
                  held AS (
                    SELECT least(greatest(coalesce(sum(n), 0), 0), {CLAMP})::bigint AS mine
                      FROM {COUNTS} WHERE tenant = $8),
                  ins AS (
                    INSERT INTO {TABLE} (id, expires_at, state, lease_until, rid, attempt, tenant)
                    SELECT $1, $2, 1, LEAST(h.now + $3, $4), $5, $6, $8 FROM h, held
                     WHERE $2 >= h.now - $7
                       AND (EXISTS (SELECT 1 FROM {TABLE} WHERE id = $1)
                            OR (held.mine < $9 AND $10::bigint > 0))
                    ON CONFLICT (id) DO UPDATE
                       SET state = 1, lease_until = EXCLUDED.lease_until, rid = EXCLUDED.rid,
                           attempt = EXCLUDED.attempt
                     WHERE {TABLE}.state = 1
                       AND {TABLE}.lease_until < extract(epoch FROM statement_timestamp())::bigint
                    RETURNING id, tenant, lease_until, xmax = 0 AS fresh),
                  counted AS ({count})
             SELECT lease_until, extract(epoch FROM statement_timestamp())::bigint,
                    fresh AND tenant IS NOT NULL
               FROM ins",
            count = count_cte("ins", '+')
        );
        let rows = match durable_write(
            "reserve",
            self.timeout,
            &client,
            &sql,
            &[
                &id,
                &exp,
                &secs,
                &cap,
                &rid,
                &attempt,
                &self.skew,
                &tenant,
                &max_tenant,
                &room_all,
            ],
        )
        .await
        {
            Ok(rows) => rows,
            Err(f) => return Err(f.settle("reserve", client)),
        };
        if let Some(r) = rows.first() {
            self.bounds.moved(i64::from(r.get::<_, bool>(2)));
            return Ok(Reserved::Now(Lease {
                rid: ask.rid,
                end: lease_end(r.get(0), r.get(1)),
                attempt: ask.attempt,
            }));
        }
        let row = timed(
            "reserve check",
            self.timeout,
            client.query_one(
                &format!(
                    "SELECT t.state, t.lease_until, t.rid, t.attempt, h.now, $2 >= h.now - $3
                       FROM (SELECT extract(epoch FROM statement_timestamp())::bigint AS now) h
                       LEFT JOIN {TABLE} t ON t.id = $1"
                ),
                &[&id, &exp, &self.skew],
            ),
        )
        .await?;
        let (state, held_until, held_rid, held_attempt, now, above_horizon): (
            Option<i16>,
            Option<i64>,
            Option<&[u8]>,
            Option<&[u8]>,
            i64,
            bool,
        ) = (
            row.get(0),
            row.get(1),
            row.get(2),
            row.get(3),
            row.get(4),
            row.get(5),
        );
        let Some(state) = state else {
            // Not inserted and not there: no room for it, or below the
            // database's horizon.
            return Ok(if above_horizon {
                Reserved::Full
            } else {
                Reserved::PastHorizon
            });
        };
        Ok(match state {
            1 if attempt.is_some() && held_attempt == attempt => {
                let rid = held_rid
                    .and_then(|r| <[u8; 16]>::try_from(r).ok())
                    .ok_or(LedgerError::Corrupt("unexpected rid length"))?;
                Reserved::Again(Lease {
                    rid,
                    end: lease_end(held_until.unwrap_or(0), now),
                    attempt: ask.attempt,
                })
            }
            1 => Reserved::InUse,
            _ => Reserved::Before,
        })
    }

    async fn renew(
        &self,
        key: &LedgerKey,
        rid: [u8; 16],
        seconds: u32,
        cap: u64,
    ) -> Result<Held, LedgerError> {
        self.admit_write()?;
        let id = &key.id[..];
        let rid = &rid[..];
        let secs = i64::from(seconds);
        let cap = i64::try_from(cap).unwrap_or(i64::MAX);
        let client = timed("connect", self.timeout, self.pool.get()).await?;
        let sql = format!(
            "UPDATE {TABLE}
                SET lease_until = GREATEST(lease_until,
                      LEAST(extract(epoch FROM statement_timestamp())::bigint + $3, $4))
              WHERE id = $1 AND state = 1 AND rid = $2
          RETURNING lease_until, extract(epoch FROM statement_timestamp())::bigint"
        );
        let row = match durable_write(
            "renew",
            self.timeout,
            &client,
            &sql,
            &[&id, &rid, &secs, &cap],
        )
        .await
        {
            Ok(rows) => rows.into_iter().next(),
            Err(f) => return Err(f.settle("renew", client)),
        };
        Ok(match row {
            Some(r) => Held::Yes(Some(lease_end(r.get(0), r.get(1)))),
            None => Held::Lost,
        })
    }

    async fn commit(&self, key: &LedgerKey, rid: [u8; 16]) -> Result<Held, LedgerError> {
        self.admit_write()?;
        let id = &key.id[..];
        let rid = &rid[..];
        let client = timed("connect", self.timeout, self.pool.get()).await?;
        // Whether or not the lease ended: nobody took the token over. The
        // attempt is over: its hash is not kept.
        let sql = format!(
            "UPDATE {TABLE} SET state = 2, lease_until = NULL, attempt = NULL
              WHERE id = $1 AND state = 1 AND rid = $2 RETURNING 1"
        );
        let n = match durable_write("commit", self.timeout, &client, &sql, &[&id, &rid]).await {
            Ok(rows) => rows.len(),
            Err(f) => return Err(f.settle("commit", client)),
        };
        if n == 1 {
            return Ok(Held::Yes(None));
        }
        // Committed before by this same reservation: idempotent.
        let again = timed(
            "commit check",
            self.timeout,
            client.query_opt(
                &format!("SELECT 1 FROM {TABLE} WHERE id = $1 AND state = 2 AND rid = $2"),
                &[&id, &rid],
            ),
        )
        .await?;
        Ok(if again.is_some() {
            Held::Yes(None)
        } else {
            Held::Lost
        })
    }

    async fn release(&self, key: &LedgerKey, rid: [u8; 16]) -> Result<(), LedgerError> {
        self.admit_write()?;
        let id = &key.id[..];
        let rid = &rid[..];
        let client = timed("connect", self.timeout, self.pool.get()).await?;
        let sql = format!(
            "WITH d AS (DELETE FROM {TABLE} WHERE id = $1 AND state = 1 AND rid = $2
                        RETURNING id, tenant, true AS fresh),
                  counted AS ({count})
             SELECT 1 FROM d WHERE tenant IS NOT NULL",
            count = count_cte("d", '-')
        );
        match durable_write("release", self.timeout, &client, &sql, &[&id, &rid]).await {
            Ok(rows) => {
                self.bounds.moved(-(rows.len() as i64));
                Ok(())
            }
            Err(f) => Err(f.settle("release", client)),
        }
    }

    async fn remove_expired(&self, before_unix: u64, limit: usize) -> Result<usize, LedgerError> {
        let due = {
            let last = self.last_recount.lock().unwrap_or_else(|e| e.into_inner());
            last.elapsed() >= self.recount_every
        };
        if due {
            match rebuild_counts(&self.pool, self.timeout).await {
                Ok(true) => {
                    *self.last_recount.lock().unwrap_or_else(|e| e.into_inner()) =
                        std::time::Instant::now();
                    if let Ok(n) = read_counted(&self.pool, self.timeout).await {
                        self.bounds.counted.store(n, Ordering::Relaxed);
                    }
                }
                Ok(false) => {} // another replica holds the collector's lock
                Err(e) => {
                    tracing::warn!(error = %e, "the record counts were not rebuilt; tried again at the next collection")
                }
            }
        }
        let before = i64::try_from(before_unix).unwrap_or(i64::MAX);
        let n = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut client = timed("connect", self.timeout, self.pool.get()).await?;
        let tx = timed("begin", self.timeout, client.transaction()).await?;
        let locked: bool = timed(
            "gc lock",
            self.timeout,
            tx.query_one("SELECT pg_try_advisory_xact_lock($1)", &[&LOCK_GC]),
        )
        .await?
        .get(0);
        if !locked {
            return Ok(0); // another replica is collecting
        }
        // The horizon is the earlier of the caller's and the database's
        // clock minus the skew and the statement timeout: a replica whose
        // clock runs ahead cannot delete live rows, nor can a collection
        // delete a row under a consumption that started before it and
        // stalled.
        // Each DELETE repeats its conditions on the row it deletes: the
        // subquery picks ids from the statement's snapshot, and when a row
        // changed meanwhile (a takeover committed while the DELETE waited
        // for it) PostgreSQL re-checks only the DELETE's own conditions on
        // the new version, never the subquery's.
        // One statement deletes both and counts down what it deleted: the
        // counter rows it locks, it locks in order, once (two statements in
        // one transaction could each lock some and wait, in a cycle, for a
        // writer that waits for the other's).
        // Reservations whose lease ended the skew ago (by both clocks) and
        // that nobody took over: the token is as if never opened.
        let sql = format!(
            "WITH h AS (SELECT LEAST($1, extract(epoch FROM statement_timestamp())::bigint - $3) AS h),
                  d AS (
               DELETE FROM {TABLE} WHERE id IN
                 (SELECT * FROM (SELECT id FROM {TABLE}, h WHERE expires_at < h.h
                                  ORDER BY expires_at LIMIT $2) e
                  UNION
                  SELECT * FROM (SELECT id FROM {TABLE}, h WHERE state = 1 AND lease_until < h.h
                                  LIMIT $2) l)
                 AND (expires_at < (SELECT h FROM h)
                      OR (state = 1 AND lease_until < (SELECT h FROM h)))
               RETURNING id, tenant, true AS fresh),
                  counted AS ({count})
             SELECT count(*), count(tenant) FROM d",
            count = count_cte("d", '-')
        );
        let row = timed(
            "gc delete",
            self.timeout,
            tx.query_one(&sql, &[&before, &n, &self.collect_margin]),
        )
        .await?;
        let removed = u64::try_from(row.get::<_, i64>(0)).unwrap_or(0);
        let counted: i64 = row.get(1);
        timed("gc commit", self.timeout, tx.commit()).await?;
        self.bounds.moved(-counted);
        if removed > 0 && self.self_vacuum && self.vacuum_due() {
            // Outside any transaction; skips rather than waits if another
            // replica holds the table's lock. Bounded by the statement timeout.
            let (server, client_limit) = vacuum_limits(self.timeout);
            let server_limit = server.as_millis();
            let vacuum = async {
                client
                    .batch_execute(&format!("SET statement_timeout = {server_limit}"))
                    .await?;
                let r = client
                    .batch_execute(&format!("VACUUM (SKIP_LOCKED) {TABLE}"))
                    .await;
                client.batch_execute("RESET statement_timeout").await?;
                r
            };
            if let Err(e) = timed("vacuum", client_limit, vacuum).await {
                tracing::warn!(error = %e, "ledger table vacuum failed");
            }
        }
        Ok(removed as usize)
    }

    async fn close(&self) -> Result<(), LedgerError> {
        // Every acknowledged consumption was committed before its answer.
        self.pool.close();
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn share_among(&self, tenants: u64) {
        if self.bounds.share_by_tenants.load(Ordering::Relaxed) {
            let max = self.bounds.max_records.load(Ordering::Relaxed);
            self.bounds
                .max_tenant_records
                .store(super::default_share(max, tenants), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vacuum_is_bounded_by_eight_and_ten_statement_timeouts() {
        assert_eq!(
            vacuum_limits(Duration::from_millis(1500)),
            (Duration::from_secs(12), Duration::from_secs(15))
        );
    }

    #[test]
    fn the_ledger_vacuums_at_most_once_a_minute() {
        let t0 = std::time::Instant::now();
        let mut last = None;
        assert!(vacuum_due(&mut last, t0), "the first is due");
        assert_eq!(last, Some(t0));
        let almost = t0 + VACUUM_EVERY - Duration::from_millis(1);
        assert!(!vacuum_due(&mut last, almost), "not within the minute");
        assert_eq!(last, Some(t0), "a refused one is not recorded");
        assert!(
            vacuum_due(&mut last, t0 + VACUUM_EVERY),
            "due a minute later"
        );
        assert_eq!(last, Some(t0 + VACUUM_EVERY));
    }
}
