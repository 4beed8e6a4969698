//! One contract, every backend: sled always; PostgreSQL when
//! STATESEAL_TEST_DATABASE_URL is set (CI sets it). Without it the PostgreSQL
//! cases say loudly that they were skipped.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use rand::RngCore;
use stateseal::ledger::postgres::{PgLedger, PgOptions};
use stateseal::ledger::sled::SledLedger;
use stateseal::ledger::{Committed, Consumed, Lease, Ledger, LedgerKey};

pub fn database_url() -> Option<String> {
    std::env::var("STATESEAL_TEST_DATABASE_URL")
        .ok()
        .filter(|s| !s.is_empty())
}

fn key(expires_at: u64) -> LedgerKey {
    let mut id = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut id);
    LedgerKey { expires_at, id }
}

const FAR: u64 = 4_000_000_000;

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
    let mut removed = 0;
    loop {
        let n = l.remove_expired(now + 2, 7).await.unwrap();
        removed += n;
        if n == 0 {
            break;
        }
    }
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
    let l = SledLedger::open(dir.path()).unwrap();
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::PastHorizon);
    assert_eq!(
        l.consume(&key(2_000_001)).await.unwrap(),
        Consumed::Now,
        "above the horizon"
    );
}

async fn sled() -> (Arc<dyn Ledger>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    (Arc::new(SledLedger::open(dir.path()).unwrap()), dir)
}

async fn postgres() -> Option<Arc<dyn Ledger>> {
    let Some(url) = database_url() else {
        eprintln!(
            "\n*** SKIPPED: PostgreSQL ledger contract (set STATESEAL_TEST_DATABASE_URL) ***\n"
        );
        return None;
    };
    Some(Arc::new(
        PgLedger::connect(
            &url,
            PgOptions {
                skew: 0,
                ..PgOptions::default()
            },
        )
        .await
        .unwrap(),
    ))
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
                    if let Some(l) = super::postgres().await {
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

fn lease(rid: u8, until: u64) -> Lease {
    Lease {
        rid: [rid; 16],
        until,
        attempt: None,
    }
}

async fn attempts_are_idempotent(l: Arc<dyn Ledger>) {
    let now = wall_now();
    let (x, y) = (Some([7u8; 16]), Some([8u8; 16]));
    // Consume: the same attempt gets the same success; another, REPLAYED.
    let k = key(FAR);
    assert_eq!(l.consume_as(&k, x).await.unwrap(), Consumed::Now);
    assert_eq!(l.consume_as(&k, x).await.unwrap(), Consumed::Again(None));
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
        Consumed::Again(None)
    );
    // Reserve: the same attempt gets the lease it holds.
    let k = key(FAR);
    let held = Lease {
        attempt: x,
        ..lease(1, now + 60)
    };
    assert_eq!(l.reserve(&k, held, now).await.unwrap(), Consumed::Now);
    let again = Lease {
        attempt: x,
        ..lease(2, now + 90)
    };
    assert_eq!(
        l.reserve(&k, again, now + 1).await.unwrap(),
        Consumed::Again(Some(held))
    );
    let other = Lease {
        attempt: y,
        ..lease(3, now + 90)
    };
    assert_eq!(
        l.reserve(&k, other, now + 1).await.unwrap(),
        Consumed::InUse
    );
    assert_eq!(
        l.commit(&k, held.rid, now + 2).await.unwrap(),
        Committed::Done
    );
    assert_eq!(
        l.reserve(&k, again, now + 3).await.unwrap(),
        Consumed::Before
    );
}

async fn reserve_commit_release(l: Arc<dyn Ledger>) {
    let now = wall_now();
    let k = key(FAR);
    let (a, b) = (lease(1, now + 60), lease(2, now + 60));
    assert_eq!(l.reserve(&k, a, now).await.unwrap(), Consumed::Now);
    // Held: another attempt, and a plain consumption, are IN_USE.
    assert_eq!(l.reserve(&k, b, now + 1).await.unwrap(), Consumed::InUse);
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::InUse);
    // Releasing what one does not hold changes nothing.
    l.release(&k, b.rid).await.unwrap();
    assert_eq!(l.reserve(&k, b, now + 1).await.unwrap(), Consumed::InUse);
    // Released by its holder: available again.
    l.release(&k, a.rid).await.unwrap();
    assert_eq!(l.reserve(&k, b, now + 2).await.unwrap(), Consumed::Now);
    assert_eq!(
        l.commit(&k, a.rid, now + 2).await.unwrap(),
        Committed::LeaseLost
    );
    assert_eq!(l.commit(&k, b.rid, now + 2).await.unwrap(), Committed::Done);
    assert_eq!(
        l.commit(&k, b.rid, now + 3).await.unwrap(),
        Committed::Done,
        "idempotent"
    );
    // Committed: consumed for everyone.
    assert_eq!(l.reserve(&k, a, now + 3).await.unwrap(), Consumed::Before);
    assert_eq!(l.consume(&k).await.unwrap(), Consumed::Before);
    l.release(&k, b.rid).await.unwrap();
    assert_eq!(
        l.consume(&k).await.unwrap(),
        Consumed::Before,
        "release after commit"
    );
}

async fn lease_expiry(l: Arc<dyn Ledger>) {
    let now = wall_now();
    let k = key(FAR);
    let a = lease(1, now + 5);
    assert_eq!(l.reserve(&k, a, now).await.unwrap(), Consumed::Now);
    assert_eq!(
        l.commit(&k, a.rid, now + 6).await.unwrap(),
        Committed::LeaseLost
    );
    // An expired lease is taken over by the next attempt.
    let b = lease(2, now + 100);
    assert_eq!(l.reserve(&k, b, now + 6).await.unwrap(), Consumed::Now);
    assert_eq!(
        l.commit(&k, a.rid, now + 6).await.unwrap(),
        Committed::LeaseLost
    );
    assert_eq!(l.commit(&k, b.rid, now + 7).await.unwrap(), Committed::Done);
    // A plain consumption takes over a lease that already ended.
    let k2 = key(FAR);
    let stale = lease(3, now - 10);
    assert_eq!(
        l.reserve(&k2, stale, now - 20).await.unwrap(),
        Consumed::Now
    );
    assert_eq!(l.consume(&k2).await.unwrap(), Consumed::Now);
    assert_eq!(
        l.commit(&k2, stale.rid, now - 15).await.unwrap(),
        Committed::LeaseLost
    );
}

async fn concurrent_reserves_one_winner(l: Arc<dyn Ledger>) {
    let now = wall_now();
    for _ in 0..5 {
        let k = key(FAR);
        let tasks: Vec<_> = (0..32u8)
            .map(|i| {
                let l = l.clone();
                tokio::spawn(
                    async move { (i, l.reserve(&k, lease(i, now + 60), now).await.unwrap()) },
                )
            })
            .collect();
        let mut winners = Vec::new();
        for t in tasks {
            let (i, c) = t.await.unwrap();
            match c {
                Consumed::Now => winners.push(i),
                Consumed::InUse => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(winners.len(), 1);
        let commits: Vec<_> = (0..32u8)
            .map(|i| {
                let l = l.clone();
                tokio::spawn(async move { l.commit(&k, [i; 16], now + 1).await.unwrap() })
            })
            .collect();
        let mut done = 0;
        for t in commits {
            if t.await.unwrap() == Committed::Done {
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
    concurrent_reserves_one_winner,
    consume_once,
    concurrent_same_key,
    concurrent_distinct_keys,
    gc_removes_expired_and_only_those
);

#[tokio::test]
async fn postgres_schema_creation_is_idempotent_under_concurrent_starts() {
    let Some(url) = database_url() else {
        eprintln!("\n*** SKIPPED: PostgreSQL concurrent migration (set STATESEAL_TEST_DATABASE_URL) ***\n");
        return;
    };
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
    let Some(url) = database_url() else {
        eprintln!("\n*** SKIPPED: PostgreSQL vacuum (set STATESEAL_TEST_DATABASE_URL) ***\n");
        return;
    };
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let autovacuum: String = client
        .query_one("SHOW autovacuum", &[])
        .await
        .unwrap()
        .get(0);
    if autovacuum == "on" {
        eprintln!("\n*** SKIPPED: autovacuum is on; the self-vacuum path is not taken ***\n");
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
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    for _ in 0..20 {
        assert_eq!(l.consume(&key(now + 1)).await.unwrap(), Consumed::Now);
    }
    async fn vacuums(c: &tokio_postgres::Client) -> i64 {
        c.query_one(
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'stateseal_consumed_v1'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
    }
    let before = vacuums(&client).await;
    tokio::time::sleep(std::time::Duration::from_millis(2200)).await;
    // (Another test's collector may take some of these rows first; whoever
    // deletes rows vacuums afterwards.)
    while l.remove_expired(now + 2, 1000).await.unwrap() > 0 {}
    // The statistics collector reports with a delay.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while vacuums(&client).await <= before {
        assert!(
            std::time::Instant::now() < deadline,
            "no VACUUM after collecting"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
