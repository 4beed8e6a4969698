//! One contract, every backend: sled always; PostgreSQL when
//! STATESEAL_TEST_DATABASE_URL is set (CI sets it). Without it the PostgreSQL
//! cases say loudly that they were skipped.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use crate::common::pg::{pg_client, OwnSchema};
use rand::RngCore;
use stateseal::internals::ledger::postgres::{PgLedger, PgOptions};
use stateseal::internals::ledger::sled::SledLedger;
use stateseal::internals::ledger::{
    Consumed, Held, Lease, LeaseAsk, Ledger, LedgerKey, Reserved, TenantTag,
};

fn key(expires_at: u64) -> LedgerKey {
    let mut id = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut id);
    LedgerKey {
        expires_at,
        id,
        tenant: TenantTag::default(),
    }
}

const FAR: u64 = 4_000_000_000;

/// The test database's host:port, user and database name, for a relay
/// in front of it (its URL must name a TCP host).
fn reached_at(url: &str) -> (String, String, String) {
    let cfg = stateseal::internals::ledger::postgres::parse_url(url).unwrap();
    let host = match &cfg.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        other => panic!("the test database is reached over TCP, not {other:?}"),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    (
        format!("{host}:{port}"),
        cfg.get_user().unwrap_or("postgres").to_string(),
        cfg.get_dbname().unwrap_or("postgres").to_string(),
    )
}

/// Whether some session's statement holding `text` waits for a lock.
async fn waits_for_a_lock(watch: &tokio_postgres::Client, text: &str) -> bool {
    let waiting: i64 = watch
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE wait_event_type = 'Lock' AND strpos(query, $1) > 0",
            &[&text],
        )
        .await
        .unwrap()
        .get(0);
    waiting > 0
}

/// Collects in batches of `batch` with the horizon `before()` until `want`
/// records went, or nothing more goes and the horizon is past `until` by
/// PostgreSQL's trail ([`PG_COLLECT_TRAIL`]: its own horizon trails its
/// clock by the skew and the statement timeout), or 30 s passed; how many
/// went.
async fn collect_past(
    l: &Arc<dyn Ledger>,
    before: impl Fn() -> u64,
    batch: usize,
    want: usize,
    until: u64,
) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut removed = 0;
    while removed < want && std::time::Instant::now() < deadline {
        let horizon = before();
        let n = l.remove_expired(horizon, batch).await.unwrap();
        removed += n;
        if n == 0 {
            if horizon > until + PG_COLLECT_TRAIL.as_secs() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    removed
}

/// How far PostgreSQL's collection horizon trails its clock with the
/// contract's settings (no skew, the default 2 s bound: a 1.5 s statement
/// timeout, rounded up to whole seconds), and a second for the rounding of
/// the clock.
const PG_COLLECT_TRAIL: std::time::Duration = std::time::Duration::from_secs(3);

/// sled's horizon is exclusive and moves only when collection raises it: a
/// record expiring exactly on it is kept and answers `Before`, a key below it
/// `PastHorizon`. (PostgreSQL's is below, in
/// `postgres_record_expiring_on_the_horizon_stays`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_record_expiring_on_the_horizon_stays() {
    let (l, _dir) = sled().await;
    let on = key(1_000_000);
    assert_eq!(l.consume(&on).await.unwrap(), Consumed::Now);
    l.remove_expired(1_000_000, 100).await.unwrap();
    assert_eq!(
        l.consume(&key(999_999)).await.unwrap(),
        Consumed::PastHorizon
    );
    assert_eq!(
        l.reserve(&key(999_999), ask(1, 10)).await.unwrap(),
        Reserved::PastHorizon
    );
    assert_eq!(l.consume(&on).await.unwrap(), Consumed::Before);
}

/// PostgreSQL's horizon is the database's clock minus the skew at each
/// statement: a record expiring exactly on it is kept and answers `Before`,
/// a key one second below it `PastHorizon`. The second is pinned by reading
/// the database's clock before and after the three statements; an attempt
/// whose second moved is not judged, and a new one is made with new keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_record_expiring_on_the_horizon_stays() {
    // Alone: a shared user collecting with a skew under this one's would
    // remove the record on the horizon.
    let Some(pg) = crate::common::pg::alone("postgresql-horizon-edge").await else {
        return;
    };
    use stateseal::internals::clock::guard::Reference;
    const SKEW: u64 = 60;
    let l = PgLedger::connect(
        &pg.url,
        PgOptions {
            skew: SKEW,
            ..PgOptions::default()
        },
    )
    .await
    .unwrap();
    let mut judged = 0;
    for _ in 0..50 {
        // The database's clock in whole seconds, as the ledger's statements
        // round it.
        let second = l.reference_now().await.unwrap().unwrap();
        let on = key(second - SKEW);
        let below = key(second - SKEW - 1);
        let first = l.consume(&on).await.unwrap();
        let again = l.consume(&on).await.unwrap();
        let under = l.consume(&below).await.unwrap();
        if l.reference_now().await.unwrap().unwrap() != second {
            continue;
        }
        assert_eq!(first, Consumed::Now, "a key on the horizon is accepted");
        assert_eq!(again, Consumed::Before, "and kept: it is not below it");
        assert_eq!(under, Consumed::PastHorizon);
        judged += 1;
        if judged == 3 {
            break;
        }
    }
    assert!(
        judged > 0,
        "no attempt stayed within one second of the database's clock"
    );
    l.close().await.unwrap();
}

/// Issue 58, P1: an insert judges the horizon by its statement's start, so
/// collection deletes only below the database's clock minus the skew *and*
/// the statement timeout: a consumption that started before a collection
/// and stalled up to the timeout cannot land after it deleted the record
/// the consumption would have found (and be taken for a first use).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_collection_leaves_room_for_a_stalled_insert() {
    let Some(pg) = crate::common::pg::alone("postgresql-collect-margin").await else {
        return;
    };
    use stateseal::internals::clock::guard::Reference;
    const SKEW: u64 = 10;
    // A 4 s client bound: statements time out on the server after 3 s.
    let l = PgLedger::connect(
        &pg.url,
        PgOptions {
            skew: SKEW,
            timeout: std::time::Duration::from_secs(4),
            ..PgOptions::default()
        },
    )
    .await
    .unwrap();
    let second = l.reference_now().await.unwrap().unwrap();
    // A second above the horizon: both clocks round to whole seconds, so
    // the insert's statement may already count the next one.
    let k = key(second - SKEW + 1);
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::Now);
    // Two seconds later the record is below clock - skew, but not below
    // clock - skew - 3 s: an insert that began near the horizon may still
    // be running. It stays.
    while l.reference_now().await.unwrap().unwrap() < second + 2 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let client = pg_client(&pg.url).await;
    let held = || async {
        let row = client
            .query_one(
                "SELECT count(*) FROM stateseal_consumed_v1 WHERE id = $1",
                &[&&k.id[..]],
            )
            .await
            .unwrap();
        row.get::<_, i64>(0) == 1
    };
    l.remove_expired(u64::MAX, 1000).await.unwrap();
    assert!(
        held().await,
        "collected while a consumption judged against it could still land"
    );
    // Past the statement timeout too: collected.
    while l.reference_now().await.unwrap().unwrap() < second + 5 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    l.remove_expired(u64::MAX, 1000).await.unwrap();
    assert!(!held().await, "never collected");
    l.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_collection_counts_records_and_leases() {
    let (l, _dir) = sled().await;
    gc_counts_records_and_leases_it_removes(l).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_collection_counts_records_and_leases() {
    // Alone: collection takes one advisory lock for every schema, and a
    // collection that finds it held by another replica removes nothing.
    let Some(pg) = crate::common::pg::alone("postgresql-collection-count").await else {
        return;
    };
    let schema = OwnSchema::create(&pg.url, "count").await;
    let l = PgLedger::connect(
        &schema.url,
        PgOptions {
            skew: 0,
            ..PgOptions::default()
        },
    )
    .await
    .unwrap();
    let l: Arc<dyn Ledger> = Arc::new(l);
    gc_counts_records_and_leases_it_removes(l.clone()).await;
    l.close().await.unwrap();
    schema.remove().await;
}

/// sled counts a record once however often it is rewritten (renewed,
/// committed), not at all once released, for the total and for its tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_counts_each_record_once() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let l = SledLedger::open(dir.path()).unwrap();
    let k = key(FAR);
    let rid = reserved_now(l.reserve(&k, ask(1, 10)).await.unwrap()).rid;
    assert!(matches!(
        l.renew(&k, rid, 10, u64::MAX).await.unwrap(),
        Held::Yes(_)
    ));
    assert_eq!(l.commit(&k, rid).await.unwrap(), Held::Yes(None));
    let released = key(FAR);
    let rid = reserved_now(l.reserve(&released, ask(2, 10)).await.unwrap()).rid;
    l.release(&released, rid).await.unwrap();
    assert_eq!(l.consume(&key(FAR)).await.unwrap(), Consumed::Now);
    assert_eq!(l.records(), 2);
    assert_eq!(l.stats().top_tenant_records.load(Ordering::Relaxed), 2);
}

/// The ledger's bound and a tenant's hold within one round of the writer
/// too: of many consumptions at once (most decided together, group
/// commit), exactly the bound's worth is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_a_round_never_passes_a_bound() {
    for tenant_bound in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let l = SledLedger::open(dir.path()).unwrap();
        let l = Arc::new(if tenant_bound {
            l.with_max_tenant_records(4)
        } else {
            l.with_max_records(4)
        });
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let l = l.clone();
                tokio::spawn(async move { l.consume(&key(FAR)).await.unwrap() })
            })
            .collect();
        let mut now = 0;
        for t in tasks {
            match t.await.unwrap() {
                Consumed::Now => now += 1,
                other => assert_eq!(other, Consumed::Full),
            }
        }
        assert_eq!((now, l.records()), (4, 4), "tenant bound: {tenant_bound}");
    }
}

/// The clock's high-water mark (the clock guard's floor at the next start)
/// survives a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_keeps_the_clock_high_water_mark() {
    use stateseal::internals::clock::guard::Reference;
    let dir = tempfile::tempdir().unwrap();
    {
        let l = SledLedger::open(dir.path()).unwrap();
        assert_eq!(l.stored_high_water(), None);
        l.record_high_water(1_900_000_123).await.unwrap();
        l.close().await.unwrap();
    }
    let l = crate::common::open_sled_again(dir.path());
    assert_eq!(l.stored_high_water(), Some(1_900_000_123));
}

/// sled names itself (the backend in logs and metrics), and its Debug
/// form shows nothing it holds.
#[test]
fn sled_debug_shows_only_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let l = SledLedger::open(dir.path()).unwrap();
    assert_eq!(l.backend(), "sled");
    assert_eq!(format!("{l:?}"), "SledLedger { .. }");
}

async fn consume_once(l: Arc<dyn Ledger>) {
    let k = key(FAR);
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::Now);
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::Before);
    // Same id, other expiry: a distinct record only in sled's key layout is
    // impossible in practice (the expiry is authenticated with the id), so
    // only the same (expiry, id) pair is checked here.
    assert!(l.ready().await);
}

async fn concurrent_same_key(l: Arc<dyn Ledger>) {
    for _ in 0..10 {
        let k = key(FAR);
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let l = l.clone();
                tokio::spawn(async move { l.consume(&k).await.unwrap() })
            })
            .collect();
        let mut now = 0;
        for t in tasks {
            if t.await.unwrap() == Consumed::Now {
                now += 1;
            }
        }
        assert_eq!(now, 1);
    }
}

async fn concurrent_distinct_keys(l: Arc<dyn Ledger>) {
    let keys: Vec<_> = (0..500).map(|_| key(FAR)).collect();
    let tasks: Vec<_> = keys
        .iter()
        .map(|k| {
            let (l, k) = (l.clone(), *k);
            tokio::spawn(async move { l.consume(&k).await.unwrap() })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), Consumed::Now);
    }
    for k in &keys {
        assert_eq!(l.consume(k).await.unwrap(), Consumed::Before);
    }
}

async fn gc_removes_expired_and_only_those(l: Arc<dyn Ledger>) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let old: Vec<_> = (0..30).map(|_| key(now + 1)).collect();
    let live: Vec<_> = (0..30).map(|_| key(now + 1000)).collect();
    for k in old.iter().chain(&live) {
        assert_eq!(l.consume(k).await.unwrap(), Consumed::Now);
    }
    // Past the old keys' expiry by every clock (the database's too).
    tokio::time::sleep(std::time::Duration::from_millis(2200)).await;
    let removed = collect_past(&l, || now + 2, 7, 30, now + 1).await;
    assert!(removed >= 30, "removed {removed}");
    for k in &live {
        assert_eq!(
            l.consume(k).await.unwrap(),
            Consumed::Before,
            "a live record was removed"
        );
    }
    for k in &old {
        assert_eq!(
            l.consume(k).await.unwrap(),
            Consumed::PastHorizon,
            "a key below the horizon must never be consumed afresh"
        );
    }
}

/// The horizon survives a restart (sled keeps it in its meta tree).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_horizon_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let k = key(1_000_000);
    {
        let l = SledLedger::open(dir.path()).unwrap();
        assert_eq!(l.consume(&k).await.unwrap(), Consumed::Now);
        l.remove_expired(2_000_000, 100).await.unwrap();
        l.close().await.unwrap();
    }
    let l = crate::common::open_sled_again(dir.path());
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::PastHorizon);
    assert_eq!(
        l.consume(&key(2_000_001)).await.unwrap(),
        Consumed::Now,
        "above the horizon"
    );
}

/// A lease an earlier process granted ends the grace later, by this
/// process's clock, for reservations, consumptions and collection (which
/// frees it only once the grace is over too), while its holder is told its
/// recorded end; a lease this process granted, or took over, gets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_leases_an_earlier_process_granted_end_the_grace_later() {
    use stateseal::internals::clock::ManualClock;
    const T: u64 = 1_900_000_000;
    let dir = tempfile::tempdir().unwrap();
    let (old, attempt) = (key(FAR), Some([7u8; 16]));
    {
        let l = SledLedger::open(dir.path())
            .unwrap()
            .with_clock(Arc::new(ManualClock::new(T)));
        let held = LeaseAsk {
            attempt,
            ..ask(1, 10)
        };
        assert_eq!(
            reserved_now(l.reserve(&old, held).await.unwrap()).end.until,
            T + 10
        );
        l.close().await.unwrap();
    }
    let clock = Arc::new(ManualClock::new(T + 20));
    let l = crate::common::open_sled_again(dir.path())
        .with_clock(clock.clone())
        .with_inherited_lease_grace(30);
    // Ended at T + 10 by its own numbers; held until T + 40.
    assert_eq!(l.reserve(&old, ask(2, 60)).await.unwrap(), Reserved::InUse);
    assert_eq!(l.consume(&old).await.unwrap(), Consumed::InUse);
    let again = LeaseAsk {
        attempt,
        ..ask(3, 60)
    };
    match l.reserve(&old, again).await.unwrap() {
        // Told the recorded end: no more than a later process may keep.
        Reserved::Again(lease) => assert_eq!((lease.end.until, lease.end.seconds), (T + 10, 0)),
        other => panic!("{other:?}"),
    }
    // Granted here: no grace.
    let new = key(FAR);
    reserved_now(l.reserve(&new, ask(4, 5)).await.unwrap());
    clock.set(T + 26);
    reserved_now(l.reserve(&new, ask(5, 5)).await.unwrap());
    // Collection: the new lease (ended at T + 31) goes at T + 32, the
    // inherited one stays until the grace is over too.
    assert_eq!(l.remove_expired(T + 32, 100).await.unwrap(), 1);
    assert_eq!(l.remove_expired(T + 40, 100).await.unwrap(), 0);
    assert_eq!(l.consume(&new).await.unwrap(), Consumed::Now);
    // Held through its last second.
    clock.set(T + 40);
    assert_eq!(l.reserve(&old, ask(6, 60)).await.unwrap(), Reserved::InUse);
    assert_eq!(l.consume(&old).await.unwrap(), Consumed::InUse);
    assert_eq!(l.remove_expired(T + 41, 100).await.unwrap(), 1);
    // Collected: as if never opened. Taken over here, it gets no grace.
    clock.set(T + 41);
    let taken = reserved_now(l.reserve(&old, ask(7, 5)).await.unwrap());
    assert_eq!(taken.end.until, T + 46);
    clock.set(T + 47);
    reserved_now(l.reserve(&old, ask(8, 5)).await.unwrap());
}

async fn sled() -> (Arc<dyn Ledger>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    (Arc::new(SledLedger::open(dir.path()).unwrap()), dir)
}

/// The PostgreSQL ledger, with the database held alone: garbage collection
/// (with no clock skew here) removes any expired record and any ended lease
/// in the one shared table, whichever test made it, and these cases count
/// what it removes.
async fn postgres() -> Option<(Arc<dyn Ledger>, crate::common::pg::Alone)> {
    let pg = crate::common::pg::alone("postgresql-ledger-contract").await?;
    let l = PgLedger::connect(
        &pg.url,
        PgOptions {
            skew: 0,
            ..PgOptions::default()
        },
    )
    .await
    .unwrap();
    Some((Arc::new(l), pg))
}

macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod sled_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let (l, _dir) = super::sled().await;
                    super::$name(l).await;
                }
            )*
        }
        mod postgres_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    if let Some((l, _alone)) = super::postgres().await {
                        super::$name(l).await;
                    }
                }
            )*
        }
    };
}

fn wall_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A lease of `seconds` for reservation `rid`.
fn ask(rid: u8, seconds: u32) -> LeaseAsk {
    LeaseAsk {
        rid: [rid; 16],
        attempt: None,
        seconds,
        cap: u64::MAX,
    }
}

/// Long enough for a 1-second lease granted now to have ended by any clock
/// that counts whole seconds (the database's too): until = t + 1, ended once
/// the clock reads t + 2.
const PAST_A_ONE_SECOND_LEASE: std::time::Duration = std::time::Duration::from_millis(2100);

fn reserved_now(r: Reserved) -> Lease {
    match r {
        Reserved::Now(l) => l,
        other => panic!("expected Now, got {other:?}"),
    }
}

async fn attempts_are_idempotent(l: Arc<dyn Ledger>) {
    let now = wall_now();
    let (x, y) = (Some([7u8; 16]), Some([8u8; 16]));
    // Consume: the same attempt gets the same success; another, REPLAYED.
    let k = key(FAR);
    assert_eq!(l.consume_as(&k, x).await.unwrap(), Consumed::Now);
    assert_eq!(l.consume_as(&k, x).await.unwrap(), Consumed::Again);
    assert_eq!(l.consume_as(&k, y).await.unwrap(), Consumed::Before);
    assert_eq!(l.consume_as(&k, None).await.unwrap(), Consumed::Before);
    // Concurrent: one attempt wins; its own retries agree, others do not.
    let k = key(FAR);
    let tasks: Vec<_> = (0..16u8)
        .map(|i| {
            let l = l.clone();
            tokio::spawn(async move { (i, l.consume_as(&k, Some([i; 16])).await.unwrap()) })
        })
        .collect();
    let mut winner = None;
    for t in tasks {
        let (i, c) = t.await.unwrap();
        if c == Consumed::Now {
            assert!(winner.replace(i).is_none(), "two winners");
        } else {
            assert_eq!(c, Consumed::Before);
        }
    }
    let w = winner.unwrap();
    assert_eq!(
        l.consume_as(&k, Some([w; 16])).await.unwrap(),
        Consumed::Again
    );
    // Reserve: the same attempt gets the lease it holds.
    let k = key(FAR);
    let held = reserved_now(
        l.reserve(
            &k,
            LeaseAsk {
                attempt: x,
                ..ask(1, 60)
            },
        )
        .await
        .unwrap(),
    );
    assert!(
        held.end.until >= now + 59 && held.end.seconds >= 59,
        "{held:?}"
    );
    let again = LeaseAsk {
        attempt: x,
        ..ask(2, 90)
    };
    match l.reserve(&k, again).await.unwrap() {
        Reserved::Again(h) => {
            assert_eq!(h.rid, held.rid);
            assert_eq!(h.end.until, held.end.until);
        }
        other => panic!("{other:?}"),
    }
    let other = LeaseAsk {
        attempt: y,
        ..ask(3, 90)
    };
    assert_eq!(l.reserve(&k, other).await.unwrap(), Reserved::InUse);
    // A consume by the holding attempt's id is IN_USE too: only a Commit
    // turns a reservation into a consumption.
    assert_eq!(l.consume_as(&k, x).await.unwrap(), Consumed::InUse);
    assert_eq!(l.commit(&k, held.rid).await.unwrap(), Held::Yes(None));
    // An attempt ends with its Commit: its id is REPLAYED like any other.
    assert_eq!(l.reserve(&k, again).await.unwrap(), Reserved::Before);
    assert_eq!(l.consume_as(&k, x).await.unwrap(), Consumed::Before);
}

async fn reserve_commit_release(l: Arc<dyn Ledger>) {
    let k = key(FAR);
    let (a, b) = (ask(1, 60), ask(2, 60));
    reserved_now(l.reserve(&k, a).await.unwrap());
    // Held: another attempt, and a plain consumption, are IN_USE.
    assert_eq!(l.reserve(&k, b).await.unwrap(), Reserved::InUse);
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::InUse);
    // Releasing what one does not hold changes nothing.
    l.release(&k, b.rid).await.unwrap();
    assert_eq!(l.reserve(&k, b).await.unwrap(), Reserved::InUse);
    // Released by its holder: available again.
    l.release(&k, a.rid).await.unwrap();
    reserved_now(l.reserve(&k, b).await.unwrap());
    assert_eq!(l.commit(&k, a.rid).await.unwrap(), Held::Lost);
    assert_eq!(l.renew(&k, a.rid, 60, u64::MAX).await.unwrap(), Held::Lost);
    assert_eq!(l.commit(&k, b.rid).await.unwrap(), Held::Yes(None));
    assert_eq!(
        l.commit(&k, b.rid).await.unwrap(),
        Held::Yes(None),
        "idempotent"
    );
    // Committed: consumed for everyone; nothing left to renew.
    assert_eq!(l.reserve(&k, a).await.unwrap(), Reserved::Before);
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::Before);
    assert_eq!(l.renew(&k, b.rid, 60, u64::MAX).await.unwrap(), Held::Lost);
    l.release(&k, b.rid).await.unwrap();
    assert_eq!(
        l.consume(&k).await.unwrap(),
        Consumed::Before,
        "release after commit"
    );
}

/// Leases judged by the ledger's reference clock (the wall clock here, the
/// database's for PostgreSQL): a lease that ended and that nobody took over
/// still commits; one taken over does not; a renewed lease is not taken
/// over; the lease never outlives its cap.
async fn lease_expiry(l: Arc<dyn Ledger>) {
    // Ended, not taken over: still commits.
    let k = key(FAR);
    let a = reserved_now(l.reserve(&k, ask(1, 1)).await.unwrap());
    assert_eq!(a.end.seconds, 1);
    tokio::time::sleep(PAST_A_ONE_SECOND_LEASE).await;
    assert_eq!(l.commit(&k, a.rid).await.unwrap(), Held::Yes(None));
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::Before);

    // Ended, then taken over by another attempt: the holder has lost it.
    let k = key(FAR);
    let a = reserved_now(l.reserve(&k, ask(1, 1)).await.unwrap());
    tokio::time::sleep(PAST_A_ONE_SECOND_LEASE).await;
    let b = reserved_now(l.reserve(&k, ask(2, 60)).await.unwrap());
    assert_eq!(l.commit(&k, a.rid).await.unwrap(), Held::Lost);
    assert_eq!(l.renew(&k, a.rid, 60, u64::MAX).await.unwrap(), Held::Lost);
    assert_eq!(l.commit(&k, b.rid).await.unwrap(), Held::Yes(None));

    // Renewed before it ended: a later attempt finds it IN_USE.
    let k = key(FAR);
    let a = reserved_now(l.reserve(&k, ask(1, 1)).await.unwrap());
    match l.renew(&k, a.rid, 30, u64::MAX).await.unwrap() {
        Held::Yes(Some(end)) => assert!(end.seconds >= 29, "{end:?}"),
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(PAST_A_ONE_SECOND_LEASE).await;
    assert_eq!(l.reserve(&k, ask(2, 60)).await.unwrap(), Reserved::InUse);
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::InUse);
    assert_eq!(l.commit(&k, a.rid).await.unwrap(), Held::Yes(None));

    // A plain consumption takes over a lease that ended.
    let k = key(FAR);
    let a = reserved_now(l.reserve(&k, ask(3, 1)).await.unwrap());
    tokio::time::sleep(PAST_A_ONE_SECOND_LEASE).await;
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::Now);
    assert_eq!(l.commit(&k, a.rid).await.unwrap(), Held::Lost);

    // The cap bounds a lease and its renewals.
    let k = key(FAR);
    let now = wall_now();
    let capped = LeaseAsk {
        cap: now + 5,
        ..ask(4, 300)
    };
    let a = reserved_now(l.reserve(&k, capped).await.unwrap());
    assert!(a.end.until <= now + 5 && a.end.seconds <= 5, "{a:?}");
    match l.renew(&k, a.rid, 300, now + 5).await.unwrap() {
        Held::Yes(Some(end)) => assert!(end.until <= now + 5, "{end:?}"),
        other => panic!("{other:?}"),
    }

    // A renewal never ends before the lease it extends (issue 58: after a
    // backward step of the clock that judges leases, or a shorter ask, an
    // acknowledged renewal must not already be over): the holder keeps the
    // end it was told.
    let k = key(FAR);
    let a = reserved_now(l.reserve(&k, ask(5, 60)).await.unwrap());
    match l.renew(&k, a.rid, 1, u64::MAX).await.unwrap() {
        Held::Yes(Some(end)) => assert!(end.until >= a.end.until, "{end:?} shortened {a:?}"),
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(PAST_A_ONE_SECOND_LEASE).await;
    assert_eq!(l.reserve(&k, ask(6, 60)).await.unwrap(), Reserved::InUse);
    assert_eq!(l.commit(&k, a.rid).await.unwrap(), Held::Yes(None));
}

/// Garbage collection frees a reservation whose lease ended (and that
/// nobody took over) well before its token expires; a live one stays.
async fn gc_frees_ended_leases(l: Arc<dyn Ledger>) {
    let (ended, live) = (key(FAR), key(FAR));
    let e = reserved_now(l.reserve(&ended, ask(1, 1)).await.unwrap());
    let v = reserved_now(l.reserve(&live, ask(2, 120)).await.unwrap());
    tokio::time::sleep(PAST_A_ONE_SECOND_LEASE).await;
    // The contract's backends run with no clock skew: `before` is now.
    // Earlier cases leave ended leases of their own in PostgreSQL's table,
    // so a count of one could be theirs (it was, once, in CI): the
    // collection goes on until the horizon is past this lease's end.
    let removed = collect_past(&l, wall_now, 1000, usize::MAX, e.end.until).await;
    assert!(removed >= 1, "removed {removed}");
    // Freed: the holder's late commit finds nothing; the token reserves afresh.
    assert_eq!(l.commit(&ended, e.rid).await.unwrap(), Held::Lost);
    reserved_now(l.reserve(&ended, ask(3, 60)).await.unwrap());
    assert_eq!(l.commit(&live, v.rid).await.unwrap(), Held::Yes(None));
}

/// A collection counts what it removed: expired records and ended leases
/// together. On an empty ledger (PostgreSQL's in a schema of its own, as
/// records other tests leave in the shared table come due at any time),
/// exactly one of each ends and one collection must count two.
async fn gc_counts_records_and_leases_it_removes(l: Arc<dyn Ledger>) {
    let expiring = key(wall_now() + 1);
    assert_eq!(l.consume(&expiring).await.unwrap(), Consumed::Now);
    let e = reserved_now(l.reserve(&key(FAR), ask(1, 1)).await.unwrap());
    // Past the record's expiry and the lease's end, by whole seconds, and
    // past PostgreSQL's trailing horizon.
    tokio::time::sleep(
        PAST_A_ONE_SECOND_LEASE + std::time::Duration::from_secs(1) + PG_COLLECT_TRAIL,
    )
    .await;
    let horizon = wall_now();
    assert!(horizon > expiring.expires_at && horizon > e.end.until);
    assert_eq!(l.remove_expired(horizon, 1000).await.unwrap(), 2);
}

async fn concurrent_reserves_one_winner(l: Arc<dyn Ledger>) {
    for _ in 0..5 {
        let k = key(FAR);
        let tasks: Vec<_> = (0..32u8)
            .map(|i| {
                let l = l.clone();
                tokio::spawn(async move { (i, l.reserve(&k, ask(i, 60)).await.unwrap()) })
            })
            .collect();
        let mut winners = Vec::new();
        for t in tasks {
            let (i, c) = t.await.unwrap();
            match c {
                Reserved::Now(_) => winners.push(i),
                Reserved::InUse => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(winners.len(), 1);
        let commits: Vec<_> = (0..32u8)
            .map(|i| {
                let l = l.clone();
                tokio::spawn(async move { l.commit(&k, [i; 16]).await.unwrap() })
            })
            .collect();
        let mut done = 0;
        for t in commits {
            if t.await.unwrap() == Held::Yes(None) {
                done += 1;
            }
        }
        assert_eq!(done, 1, "exactly one commit per token");
    }
}

contract!(
    attempts_are_idempotent,
    reserve_commit_release,
    lease_expiry,
    gc_frees_ended_leases,
    concurrent_reserves_one_winner,
    consume_once,
    concurrent_same_key,
    concurrent_distinct_keys,
    gc_removes_expired_and_only_those
);

#[tokio::test]
async fn postgres_schema_creation_is_idempotent_under_concurrent_starts() {
    let Some(pg) = crate::common::pg::shared("postgresql-concurrent-migration").await else {
        return;
    };
    let url = pg.url.clone();
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                PgLedger::connect(&url, PgOptions::default())
                    .await
                    .map(|_| ())
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn a_bad_database_url_never_shows_its_password() {
    let err = PgLedger::connect(
        "postgres://u:hunter2-secret@127.0.0.1:1/x?sslmode=bogus",
        PgOptions::default(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(!err.contains("hunter2"), "{err}");
    let err = PgLedger::connect(
        "postgres://u:hunter2-secret@127.0.0.1:1/x",
        PgOptions {
            pool_size: 1,
            timeout: std::time::Duration::from_millis(300),
            skew: 60,
            ..PgOptions::default()
        },
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(!err.contains("hunter2"), "{err}");
}

/// With autovacuum off (as on this machine's PostgreSQL), the collector
/// vacuums the table itself, so deleted rows give their space back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_collector_vacuums_when_autovacuum_is_off() {
    let Some(pg) = crate::common::pg::alone("postgresql-vacuum").await else {
        return;
    };
    let url = pg.url.clone();
    let client = pg_client(&url).await;
    let autovacuum: String = client
        .query_one("SHOW autovacuum", &[])
        .await
        .unwrap()
        .get(0);
    if autovacuum == "on" {
        crate::common::skip::skipped(
            "postgresql-autovacuum-on",
            "autovacuum is on; the self-vacuum path is not taken",
        );
        return;
    }
    let l = PgLedger::connect(
        &url,
        PgOptions {
            skew: 0,
            ..PgOptions::default()
        },
    )
    .await
    .unwrap();
    let before = manual_vacuums(&client).await;
    // This ledger must delete rows itself (its first deletion vacuums):
    // another test's collector on the same database may take them first,
    // or hold the collection lock, so insert and collect until it does.
    let mut deleted = 0;
    for _ in 0..10 {
        deleted += consume_twenty_then_collect(&l).await;
        if deleted > 0 {
            break;
        }
    }
    assert!(deleted > 0, "this ledger never got to collect");
    // The statistics collector reports with a delay.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while manual_vacuums(&client).await <= before {
        assert!(
            std::time::Instant::now() < deadline,
            "no VACUUM after collecting"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Consumes 20 keys, waits until they expired, and collects: how many of
/// them (or others) this ledger removed. They expire 3 s ahead: the database
/// rounds its clock to whole seconds, and a slow machine may take a while
/// over 20 consumptions.
async fn consume_twenty_then_collect(l: &PgLedger) -> usize {
    let now = wall_now();
    for _ in 0..20 {
        assert_eq!(l.consume(&key(now + 3)).await.unwrap(), Consumed::Now);
    }
    tokio::time::sleep(std::time::Duration::from_millis(4200) + PG_COLLECT_TRAIL).await;
    l.remove_expired(now + 4, 1000).await.unwrap()
}

/// The statement count of manual VACUUMs of the ledger table.
async fn manual_vacuums(c: &tokio_postgres::Client) -> i64 {
    c.query_one(
        "SELECT coalesce((SELECT vacuum_count FROM pg_stat_user_tables
                           WHERE relname = 'stateseal_consumed_v1'
                             AND schemaname = current_schema()), 0)",
        &[],
    )
    .await
    .unwrap()
    .get::<_, i64>(0)
}

/// Against private instances with autovacuum off and on (the shared
/// database has one setting only): the collector vacuums the table itself
/// exactly when autovacuum does not cover it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_collector_vacuums_itself_only_without_autovacuum() {
    let bin = match crate::common::private_pg::available() {
        Ok(b) => b,
        Err(why) => return crate::common::skip::skipped("postgresql-private-vacuum", why),
    };
    for autovacuum in ["off", "on"] {
        let pg = crate::common::private_pg::PrivatePg::start(
            &bin,
            None,
            &format!("autovacuum = {autovacuum}\n"),
        );
        let url = format!("postgres://postgres@127.0.0.1:{}/postgres", pg.port);
        let l = PgLedger::connect(
            &url,
            PgOptions {
                skew: 0,
                ..PgOptions::default()
            },
        )
        .await
        .unwrap();
        let client = pg_client(&url).await;
        // A collection that removes nothing does not vacuum (nor take the
        // minute's turn from the one below that does).
        assert_eq!(l.remove_expired(0, 100).await.unwrap(), 0);
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
        let before = manual_vacuums(&client).await;
        // Nobody else collects on a private instance: all 20 go now.
        assert_eq!(consume_twenty_then_collect(&l).await, 20);
        // A vacuum runs inside the collection; its statistics arrive within
        // a second or so of the session going idle.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        if autovacuum == "off" {
            while manual_vacuums(&client).await <= before {
                assert!(
                    std::time::Instant::now() < deadline,
                    "autovacuum off: no VACUUM after collecting"
                );
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            // At most once a minute: a second collection right after it
            // does not vacuum again.
            let once = manual_vacuums(&client).await;
            assert_eq!(consume_twenty_then_collect(&l).await, 20);
            tokio::time::sleep(std::time::Duration::from_secs(3)).await;
            assert_eq!(
                manual_vacuums(&client).await,
                once,
                "autovacuum off: vacuumed again within the minute"
            );
        } else {
            tokio::time::sleep(std::time::Duration::from_secs(3)).await;
            assert_eq!(
                manual_vacuums(&client).await,
                before,
                "autovacuum on: the collector vacuumed the table itself"
            );
        }
    }
}

/// Collection picks ended leases in a subquery, then deletes by id. A
/// takeover whose Commit lands while that DELETE waits for the row must
/// survive it: PostgreSQL re-checks only the DELETE's own conditions on the
/// new row version. Found by the nemesis (two acknowledged Commits lost,
/// their tokens consumed again by the final replay); here a transaction
/// holds the row with a Commit's update while collection runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_collection_never_deletes_a_commit_that_raced_it() {
    let Some((l, pg)) = postgres().await else {
        return;
    };
    let k = key(FAR);
    reserved_now(l.reserve(&k, ask(1, 1)).await.unwrap());
    // Abandoned: the lease ends (no skew here; whole seconds).
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let client = pg_client(&pg.url).await;
    client.batch_execute("BEGIN").await.unwrap();
    let updated = client
        .execute(
            "UPDATE stateseal_consumed_v1 SET state = 2, lease_until = NULL, rid = NULL, attempt = NULL
              WHERE id = $1",
            &[&&k.id[..]],
        )
        .await
        .unwrap();
    assert_eq!(updated, 1);
    // pg_stat_activity is read once per transaction: watched from another
    // connection.
    let watch = pg_client(&pg.url).await;
    let start_gc = || {
        let l = l.clone();
        tokio::spawn(async move { l.remove_expired(wall_now(), 1000).await })
    };
    let mut gc = start_gc();
    // Until collection's DELETE waits for the row. Another ledger on the
    // shared database may hold collection's lock: then this one returns at
    // once, and is started again.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if waits_for_a_lock(&watch, "DELETE FROM stateseal_consumed_v1").await {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "collection never waited for the row"
        );
        if gc.is_finished() {
            // Lock held elsewhere, or our row lock outlasted its timeout.
            let _ = gc.await.unwrap();
            gc = start_gc();
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    client.batch_execute("COMMIT").await.unwrap();
    gc.await.unwrap().unwrap();
    assert_eq!(
        l.consume(&k).await.unwrap(),
        Consumed::Before,
        "collection deleted a committed consumption"
    );
}

/// Options in the URL (`options=-c …`) reach every session beside the
/// ledger's own: with `search_path` set there, the table is created and
/// written in that schema. `Debug` of the ledger shows nothing of the URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_keeps_the_url_options_and_debug_shows_no_url() {
    use stateseal::internals::ledger::postgres::TABLE;
    let Some(pg) = crate::common::pg::shared("postgresql-url-options").await else {
        return;
    };
    let schema = OwnSchema::create(&pg.url, "options").await;
    let ledger = PgLedger::connect(&schema.url, PgOptions::default())
        .await
        .unwrap();
    assert_eq!(format!("{ledger:?}"), "PgLedger { .. }");
    assert_eq!(ledger.backend(), "postgres");
    // The clock guard's reference is the database's clock (the same host's
    // here: within a few seconds of this one).
    use stateseal::internals::clock::guard::Reference;
    let db_now = ledger.reference_now().await.unwrap().unwrap();
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(db_now.abs_diff(wall) <= 5, "database {db_now}, here {wall}");
    let key = LedgerKey {
        expires_at: u64::from(u32::MAX),
        id: [0x5c; 32],
        tenant: TenantTag::of("t"),
    };
    assert_eq!(ledger.consume(&key).await.unwrap(), Consumed::Now);
    let rows: i64 = schema
        .client
        .query_one(
            &format!("SELECT count(*) FROM {}.{TABLE}", schema.name),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        rows, 1,
        "the record went to the schema the URL's options named"
    );
    ledger.close().await.unwrap();
    // Closed: its connections are gone, and it records nothing more.
    let after = LedgerKey {
        id: [0x5d; 32],
        ..key
    };
    assert!(
        ledger.consume(&after).await.is_err(),
        "a closed ledger consumed"
    );
    drop(ledger);
    schema.remove().await;
}

/// A start waits out another replica's migration for up to five times the
/// statement timeout (the migration lock and the DDL get that long, on the
/// server too): here a session holds the migration lock for 1.5 s against a
/// 1 s timeout. Before, the session's lock_timeout (half the timeout) cut
/// the wait at 0.5 s: "migration lock: db error".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_start_waits_out_a_concurrent_migration() {
    let Some(pg) = crate::common::pg::alone("postgresql-migration-lock").await else {
        return;
    };
    let holder = pg_client(&pg.url).await;
    // LOCK_MIGRATE in src/ledger/postgres.rs: "states" in ASCII, then 1.
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&0x7374_6174_6573_0001_i64])
        .await
        .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        holder
            .execute(
                "SELECT pg_advisory_unlock($1)",
                &[&0x7374_6174_6573_0001_i64],
            )
            .await
            .unwrap();
    });
    let ledger = PgLedger::connect(
        &pg.url,
        PgOptions {
            timeout: std::time::Duration::from_secs(1),
            ..PgOptions::default()
        },
    )
    .await
    .expect("the start waits for the migration lock");
    release.await.unwrap();
    ledger.close().await.unwrap();
}

/// The warnings an operator gets for a connection that is not encrypted
/// (sslmode=disable) or whose server certificate is not verified
/// (sslmode=prefer), captured from this thread's log.
#[tokio::test(flavor = "current_thread")]
async fn postgres_warns_of_plaintext_and_unverified_connections() {
    let Some(pg) = crate::common::pg::shared("postgresql-tls-warnings").await else {
        return;
    };
    let sep = if pg.url.contains('?') { '&' } else { '?' };
    for (mode, want, not) in [
        ("disable", "is not encrypted", "is not verified"),
        ("prefer", "is not verified", "is not encrypted"),
    ] {
        let url = format!("{}{sep}sslmode={mode}", pg.url);
        let (ledger, log) =
            crate::common::logs::captured(PgLedger::connect(&url, PgOptions::default())).await;
        ledger.unwrap().close().await.unwrap();
        assert!(log.contains(want), "sslmode={mode}: {log}");
        assert!(!log.contains(not), "sslmode={mode}: {log}");
    }
}

/// Waiters of one key in one batch are answered as if each came a batch
/// later than the one before: the first is `Now`; the same attempt again is
/// `Again` (a retry of that consumption), another attempt or none `Before`.
/// The same attempt then gets `Again` from the table too.
#[tokio::test(flavor = "current_thread")]
async fn postgres_the_same_attempt_twice_in_one_batch_gets_again() {
    let Some(pg) = crate::common::pg::shared("postgresql-one-batch-attempts").await else {
        return;
    };
    let ledger = PgLedger::connect(&pg.url, PgOptions::default())
        .await
        .unwrap();
    let k = key(FAR);
    let (mine, other) = (Some([7u8; 16]), Some([8u8; 16]));
    // All sent before the batcher runs (one thread): one batch.
    let mut waiters = [
        Box::pin(ledger.consume_as(&k, mine)),
        Box::pin(ledger.consume_as(&k, mine)),
        Box::pin(ledger.consume_as(&k, other)),
        Box::pin(ledger.consume_as(&k, None)),
    ];
    std::future::poll_fn(|cx| {
        for w in waiters.iter_mut() {
            let _ = std::future::Future::poll(w.as_mut(), cx);
        }
        std::task::Poll::Ready(())
    })
    .await;
    let mut got = Vec::new();
    for w in waiters {
        got.push(w.await.unwrap());
    }
    assert_eq!(
        got,
        [
            Consumed::Now,
            Consumed::Again,
            Consumed::Before,
            Consumed::Before
        ]
    );
    assert_eq!(ledger.consume_as(&k, mine).await.unwrap(), Consumed::Again);
    assert_eq!(
        ledger.consume_as(&k, other).await.unwrap(),
        Consumed::Before
    );
    ledger.close().await.unwrap();
}

/// A batch that loses a deadlock is rolled back whole by PostgreSQL and
/// retried: its consumptions succeed, once. Another transaction holds key b;
/// the batch [a, b] inserts a and waits for b; that transaction then inserts
/// a, and the batch, which waited first, finds the deadlock and is rolled
/// back (so the other's insert of a goes through); after the other rolls
/// back, the retry records both.
#[tokio::test(flavor = "current_thread")]
async fn postgres_retries_a_batch_that_lost_a_deadlock() {
    use stateseal::internals::ledger::postgres::TABLE;
    let Some(pg) = crate::common::pg::alone("postgresql-deadlock-retry").await else {
        return;
    };
    let (other, watch) = (pg_client(&pg.url).await, pg_client(&pg.url).await);
    let ledger = PgLedger::connect(
        &pg.url,
        PgOptions {
            timeout: std::time::Duration::from_secs(10),
            ..PgOptions::default()
        },
    )
    .await
    .unwrap();
    let tag = TenantTag::default();
    let mut ids = [[0u8; 32]; 2];
    rand::thread_rng().fill_bytes(&mut ids[0]);
    ids[1] = ids[0];
    ids[0][0] = 0x10; // a sorts before b: the batch inserts a first
    ids[1][0] = 0x20;
    let (a, b) = (
        LedgerKey {
            expires_at: FAR,
            id: ids[0],
            tenant: tag,
        },
        LedgerKey {
            expires_at: FAR,
            id: ids[1],
            tenant: tag,
        },
    );
    let insert = format!("INSERT INTO {TABLE} (id, expires_at) VALUES ($1, $2)");
    let far = FAR as i64;
    other.batch_execute("BEGIN").await.unwrap();
    other.execute(&insert, &[&&ids[1][..], &far]).await.unwrap();

    // Both sent before the batcher runs (one thread): one batch [a, b].
    let mut fa = Box::pin(ledger.consume(&a));
    let mut fb = Box::pin(ledger.consume(&b));
    std::future::poll_fn(|cx| {
        let _ = std::future::Future::poll(fa.as_mut(), cx);
        let _ = std::future::Future::poll(fb.as_mut(), cx);
        std::task::Poll::Ready(())
    })
    .await;
    // Until the batch waits for b's lock (a liveness bound).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if waits_for_a_lock(&watch, "WITH h AS").await {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the batch never waited for b"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The batch's deadlock timer runs from its wait: it fires first.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    other
        .execute(&insert, &[&&ids[0][..], &far])
        .await
        .expect("the batch, not this transaction, lost the deadlock");
    other.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(fa.await.unwrap(), Consumed::Now);
    assert_eq!(fb.await.unwrap(), Consumed::Now);
    assert_eq!(ledger.consume(&a).await.unwrap(), Consumed::Before);
    ledger.close().await.unwrap();
}

/// Counts the collection rounds asked of the ledger behind it.
#[derive(Default)]
struct CountCollections(std::sync::atomic::AtomicUsize);

impl crate::common::hooked::Hooks for CountCollections {
    fn collect(&self) -> Result<(), stateseal::internals::ledger::LedgerError> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

/// The collector (`run_gc`) removes every expired record in one round, in
/// batches, and ends the round at the first short batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collection_removes_every_expired_record_in_one_round_of_batches() {
    use stateseal::internals::clock::guard::TimeGuard;
    use stateseal::internals::clock::{Clock, WallClock};
    use stateseal::internals::ledger::run_gc;
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let ledger = Arc::new(crate::common::hooked::Hooked {
        inner: Arc::new(SledLedger::open(dir.path()).unwrap()),
        hooks: CountCollections::default(),
    });
    // A ledger keeps no figures and never fails for good unless it says so.
    assert!(ledger.flush_stats().is_none());
    assert!(!ledger.failed_for_good());
    let records = ledger.inner.flush_stats().unwrap();
    let clock = Arc::new(WallClock::new());
    let now = clock.now_unix();
    let expired: Vec<_> = (0..5).map(|_| key(now - 3600)).collect();
    for k in &expired {
        assert_eq!(ledger.consume(k).await.unwrap(), Consumed::Now);
    }
    let live = key(now + 3600);
    assert_eq!(ledger.consume(&live).await.unwrap(), Consumed::Now);
    assert_eq!(records.records.load(Ordering::SeqCst), 6);

    // The first tick comes at once, the next in an hour: one round, in
    // batches of 2 (2, 2, then 1: the short batch ends the round).
    let collected = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let told = collected.clone();
    let gc = tokio::spawn(run_gc(
        ledger.clone(),
        clock,
        TimeGuard::always_synced(),
        60,
        std::time::Duration::from_secs(3600),
        2,
        move |n| {
            told.fetch_add(n, Ordering::SeqCst);
        },
    ));
    // A liveness bound, not a speed: the round takes milliseconds.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while records.records.load(Ordering::SeqCst) > 1 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // Were the round to go on, it would ask again meanwhile.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    gc.abort();
    assert_eq!(
        records.records.load(Ordering::SeqCst),
        1,
        "the expired five removed"
    );
    assert_eq!(
        ledger.hooks.0.load(Ordering::SeqCst),
        3,
        "batches 2, 2, 1, then stop"
    );
    assert_eq!(
        collected.load(Ordering::SeqCst),
        5,
        "the round's removals, told once"
    );
    assert_eq!(ledger.consume(&live).await.unwrap(), Consumed::Before);
    assert_eq!(
        ledger.consume(&expired[0]).await.unwrap(),
        Consumed::PastHorizon
    );
    ledger.close().await.unwrap();
}

/// The retry policy of a batch, counted: a trigger on the ledger table fails
/// the inserts of this test's ids with a given SQLSTATE and counts each
/// attempt in a sequence (which a rollback does not undo). A deadlock or a
/// serialization failure is retried twice (three attempts, then the error);
/// any other error is not retried, and its SQLSTATE and message reach the
/// error's detail. The trigger fires only for ids that start with this run's
/// marker, so nothing else in the table is touched even if it is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_retries_only_deadlocks_and_serialization_failures_twice() {
    use stateseal::internals::ledger::postgres::TABLE;
    let Some(pg) = crate::common::pg::alone("postgresql-retry-policy").await else {
        return;
    };
    let admin = pg_client(&pg.url).await;
    let ledger = PgLedger::connect(&pg.url, PgOptions::default())
        .await
        .unwrap();
    let mut marker = [0u8; 8];
    rand::thread_rng().fill_bytes(&mut marker);
    let hex: String = marker.iter().map(|b| format!("{b:02x}")).collect();
    let (seq, func, trig) = (
        format!("stateseal_test_attempts_{hex}"),
        format!("stateseal_test_fail_{hex}"),
        format!("stateseal_test_fail_{hex}"),
    );
    for (code, attempts) in [("P0001", 1), ("23514", 1), ("40P01", 3), ("40001", 3)] {
        admin
            .batch_execute(&format!(
                "DROP TRIGGER IF EXISTS {trig} ON {TABLE};
                 DROP SEQUENCE IF EXISTS {seq};
                 CREATE SEQUENCE {seq};
                 CREATE OR REPLACE FUNCTION {func}() RETURNS trigger LANGUAGE plpgsql AS $f$
                 BEGIN
                   PERFORM nextval('{seq}');
                   RAISE EXCEPTION '%', 'refused by the test trigger' || E'\\n' || repeat('x', 300)
                     USING ERRCODE = '{code}';
                 END $f$;
                 CREATE TRIGGER {trig} BEFORE INSERT ON {TABLE} FOR EACH ROW
                   WHEN (substring(NEW.id FROM 1 FOR 8) = '\\x{hex}'::bytea)
                   EXECUTE FUNCTION {func}();"
            ))
            .await
            .unwrap();
        let mut k = key(FAR);
        k.id[..8].copy_from_slice(&marker);
        // A liveness bound: a policy that retries for ever never answers.
        let got = tokio::time::timeout(std::time::Duration::from_secs(30), ledger.consume(&k))
            .await
            .unwrap_or_else(|_| panic!("{code}: the consume never answered (retried for ever?)"));
        let e = got.expect_err("the trigger refuses every insert of this id");
        let text = e.to_string();
        // The server's message on one line and cut at 256 characters.
        assert!(
            text.contains(&format!(
                "refused by the test trigger {} ({code})",
                "x".repeat(256 - 28)
            )),
            "{code}: the error names the database's message and SQLSTATE: {text}"
        );
        assert!(!text.contains('\n'), "{code}: {text}");
        let n: i64 = admin
            .query_one(&format!("SELECT last_value FROM {seq}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, attempts, "{code}: attempts");
    }
    admin
        .batch_execute(&format!(
            "DROP TRIGGER {trig} ON {TABLE}; DROP FUNCTION {func}(); DROP SEQUENCE {seq};"
        ))
        .await
        .unwrap();
    ledger.close().await.unwrap();
}

/// A proxy on 127.0.0.1 in front of the test database that rewrites the
/// `options` of each connection's startup message, as a pooler may: `None`
/// drops them, `Some(o)` puts `o` in their place. Plain connections only
/// (`sslmode=disable`). Its address; it stops with the test's runtime.
async fn options_rewriting_proxy(upstream: String, options: Option<&'static str>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let mut len = [0u8; 4];
                client.read_exact(&mut len).await?;
                let mut body = vec![0u8; (u32::from_be_bytes(len) as usize).saturating_sub(4)];
                client.read_exact(&mut body).await?;
                // Protocol version, then key\0value\0 pairs, then \0.
                let mut out = body[..4].to_vec();
                let mut fields = body[4..].split(|&b| b == 0);
                while let (Some(k), Some(v)) = (fields.next(), fields.next()) {
                    if k.is_empty() {
                        break;
                    }
                    let v = if k == b"options" {
                        match options {
                            None => continue,
                            Some(o) => o.as_bytes(),
                        }
                    } else {
                        v
                    };
                    for part in [k, v] {
                        out.extend_from_slice(part);
                        out.push(0);
                    }
                }
                out.push(0);
                let mut server = tokio::net::TcpStream::connect(upstream).await?;
                server
                    .write_all(&((out.len() + 4) as u32).to_be_bytes())
                    .await?;
                server.write_all(&out).await?;
                tokio::io::copy_bidirectional(&mut client, &mut server).await?;
                Ok::<_, std::io::Error>(())
            });
        }
    });
    addr
}

/// Whether a read from a client holds a Bind message (`B`) at a message
/// boundary: a write's statement, alone or pipelined after its `BEGIN`.
/// Reads start at a boundary here (the client writes whole messages).
fn has_bind(mut b: &[u8]) -> bool {
    while b.len() >= 5 {
        if b[0] == b'B' {
            return true;
        }
        let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        if len < 4 || 1 + len > b.len() {
            return false;
        }
        b = &b[1 + len..];
    }
    false
}

/// A relay on 127.0.0.1 in front of the test database. While it is armed,
/// a connection that runs a prepared statement (a write that starts with a
/// Bind message, `B`: the ledger's insert once prepared on it) goes silent
/// for good: the statement is never forwarded, nothing more is read from
/// it, and it stays open (a peer gone silent, as behind a broken network
/// path). Every other message (a simple query such as the pool's check of
/// a connection), and everything once it is disarmed, is relayed.
struct StallingRelay {
    addr: String,
    stalled: Arc<std::sync::atomic::AtomicBool>,
}

impl StallingRelay {
    async fn start(upstream: String) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stalled = Arc::new(AtomicBool::new(false));
        let flag = stalled.clone();
        async fn pump(
            mut from: OwnedReadHalf,
            mut to: OwnedWriteHalf,
            stalled: Arc<AtomicBool>,
        ) -> std::io::Result<()> {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = from.read(&mut buf).await?;
                if stalled.load(Ordering::SeqCst) && has_bind(&buf[..n]) {
                    std::future::pending::<()>().await;
                }
                if n == 0 {
                    return Ok(());
                }
                to.write_all(&buf[..n]).await?;
            }
        }
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (flag, upstream) = (flag.clone(), upstream.clone());
                tokio::spawn(async move {
                    let server = tokio::net::TcpStream::connect(upstream).await?;
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let _ = tokio::join!(pump(cr, sw, flag.clone()), pump(sr, cw, flag));
                    Ok::<_, std::io::Error>(())
                });
            }
        });
        StallingRelay { addr, stalled }
    }

    fn stall(&self, on: bool) {
        self.stalled.store(on, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A statement that passes the timeout on a connection gone silent fails
/// (`Timeout`), and that connection is never handed out again: the next
/// consumption gets a fresh connection and succeeds. Without it, the pool
/// would hand the silent connection back (its check then waits out the
/// timeout) and fail the next consumption too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_connection_gone_silent_is_not_handed_out_again() {
    let Some(pg) = crate::common::pg::shared("postgresql-silent-connection").await else {
        return;
    };
    let (upstream, user, db) = reached_at(&pg.url);
    let relay = StallingRelay::start(upstream).await;
    let url = format!("postgres://{user}@{}/{db}?sslmode=disable", relay.addr);
    let ledger = PgLedger::connect(
        &url,
        PgOptions {
            pool_size: 1,
            // Waited out once, by the statement that goes silent.
            timeout: std::time::Duration::from_secs(5),
            ..PgOptions::default()
        },
    )
    .await
    .unwrap();
    // The pool's one connection: it goes silent with the next insert (its
    // check before it is handed out passes).
    assert_eq!(ledger.consume(&key(FAR)).await.unwrap(), Consumed::Now);
    relay.stall(true);
    let e = ledger.consume(&key(FAR)).await.unwrap_err();
    assert!(
        matches!(
            e,
            stateseal::internals::ledger::LedgerError::Timeout { step: "insert", .. }
        ),
        "{e}"
    );
    // The database is reachable again, through new connections.
    relay.stall(false);
    assert_eq!(ledger.consume(&key(FAR)).await.unwrap(), Consumed::Now);
    ledger.close().await.unwrap();
}

/// The session check refuses sessions that would not make a consumption
/// durable before its answer, or that ignore the statement timeout: behind
/// a pooler that drops the startup options, or imposes its own, the ledger
/// does not start; one that keeps `synchronous_commit` on (or
/// `remote_apply`) and a timeout starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_sessions_that_drop_its_durability_or_timeout() {
    let Some(pg) = crate::common::pg::shared("postgresql-session-check").await else {
        return;
    };
    let (upstream, user, db) = reached_at(&pg.url);
    let cases: [(Option<&'static str>, Option<&str>); 5] = [
        (None, Some("ignore the statement_timeout")),
        (
            Some("-c statement_timeout=5000 -c synchronous_commit=off"),
            Some("synchronous_commit"),
        ),
        (
            Some("-c statement_timeout=5000 -c synchronous_commit=local"),
            Some("synchronous_commit"),
        ),
        (
            Some("-c statement_timeout=5000 -c synchronous_commit=remote_apply"),
            None,
        ),
        (Some("-c statement_timeout=5000"), None),
    ];
    for (options, refusal) in cases {
        let addr = options_rewriting_proxy(upstream.clone(), options).await;
        let url = format!("postgres://{user}@{addr}/{db}?sslmode=disable");
        let got = PgLedger::connect(&url, PgOptions::default()).await;
        match (refusal, got) {
            (Some(words), Err(e)) => assert!(
                e.to_string().contains(words),
                "{options:?}: refused for another reason: {e}"
            ),
            (Some(_), Ok(_)) => panic!("{options:?}: the ledger started on such sessions"),
            (None, Err(e)) => panic!("{options:?}: refused: {e}"),
            (None, Ok(l)) => l.close().await.unwrap(),
        }
    }
}

/// Issue 57: a consumption whose COMMIT waits for a synchronous standby
/// that is gone (a primary cut from its standbys) passes the client's bound
/// and is answered `LEDGER_UNAVAILABLE`; its connection is dropped without
/// a cancel request. A cancel would make PostgreSQL commit it on the
/// primary alone ("canceling wait for synchronous replication … committed
/// locally"): visible at once, so a retry of the same attempt would be told
/// it consumed the token, and the consumption would be lost at the
/// failover. Here the row stays invisible and the retry is never a success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_commit_waiting_for_a_standby_is_never_cancelled() {
    use stateseal::internals::ledger::Ledger as _;
    let bin = match crate::common::private_pg::available() {
        Ok(b) => b,
        Err(why) => {
            crate::common::skip::skipped("postgresql-sync-wait", why);
            return;
        }
    };
    let pg = crate::common::private_pg::PrivatePg::start(&bin, None, "");
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
        pg.port
    );
    let l = PgLedger::connect(
        &url,
        PgOptions {
            timeout: std::time::Duration::from_millis(1000),
            ..PgOptions::default()
        },
    )
    .await
    .unwrap();
    // From now on every commit waits for a standby that never comes.
    let admin = pg_client(&url).await;
    admin
        .batch_execute("ALTER SYSTEM SET synchronous_standby_names = 'gone'")
        .await
        .unwrap();
    admin
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let k = key(FAR);
    let attempt = Some([7u8; 16]);
    let first = l.consume_as(&k, attempt).await;
    assert!(
        first.is_err(),
        "answered while its commit waited: {first:?}"
    );
    // Time for a cancel request to arrive, were one sent.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let visible: i64 = admin
        .query_one(
            "SELECT count(*) FROM stateseal_consumed_v1 WHERE id = $1",
            &[&&k.id[..]],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(visible, 0, "committed on the primary alone");
    let again = l.consume_as(&k, attempt).await;
    assert!(
        again.is_err(),
        "the same attempt was told it consumed: {again:?}"
    );
    drop(l);
    drop(pg);
}
