//! At most once means the handler, not the token (DESIGN.md §2, guarantee
//! 13), checked against real `stateseal` processes:
//!
//! - on PostgreSQL every lease decision is the database's: two replicas
//!   whose clocks are 45 s apart (inside `--clock-skew`, so both are ready)
//!   agree that a lease lives, and its holder's Commit counts;
//! - a randomized run interleaves reserve, renew, commit, release, consume
//!   and replays from several callers on two replicas, with handlers that
//!   take about as long as their lease, and checks that no token ever has
//!   two completed executions (commits sent as Commit, or carried by an
//!   Open of another token).
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::process::{keys_init, spawn, ServerProcess};
use crate::common::skew::Skewed;
use crate::common::*;
use rand::{Rng, SeedableRng};
use stateseal::proto::request_state_client::RequestStateClient;
use stateseal::proto::{CommitRequest, OpenMode, OpenRequest, ReleaseRequest, RenewRequest};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

async fn wait_ready(addr: std::net::SocketAddr) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while health_status(addr, "stateseal.v1.RequestState").await != ServingStatus::Serving as i32 {
        assert!(
            std::time::Instant::now() < deadline,
            "replica at {addr} never became ready"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn reserve(t: &str, lease: u32, attempt: &str) -> OpenRequest {
    OpenRequest {
        mode: OpenMode::Reserve as i32,
        lease_seconds: lease,
        attempt_id: attempt.into(),
        ..open_req(t)
    }
}

/// Two replicas on one database, one clock 45 s ahead and one 45 s behind
/// (both within the 60 s skew, so both report ready): a lease granted by
/// either is IN_USE through the other, for reserve and for a plain
/// consume, and the holder's Commit succeeds. With leases judged by each
/// replica's own clock, the replica ahead took a 30 s lease over after one
/// second, and a lease granted by the replica behind had ended by the
/// database's clock before it was granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_leases_follow_the_database_clock_across_skewed_replicas() {
    let Some(pg) = crate::common::pg::shared("postgresql-lease-clock-test").await else {
        return;
    };
    let url = pg.url.clone();
    let tmp = tempfile::tempdir().unwrap();
    let ks = keys_init(tmp.path());
    let (ahead_dir, behind_dir) = (tmp.path().join("ahead"), tmp.path().join("behind"));
    std::fs::create_dir_all(&ahead_dir).unwrap();
    std::fs::create_dir_all(&behind_dir).unwrap();
    let (Some(ahead_clock), Some(behind_clock)) =
        (Skewed::new(&ahead_dir), Skewed::new(&behind_dir))
    else {
        return; // SKIPPED printed by the shim builder (no C compiler)
    };
    ahead_clock.set(45);
    behind_clock.set(-45);
    let args = [
        "--ledger",
        "postgres",
        "--database-url",
        &url,
        "--keyset",
        &ks,
        "--expected-replicas",
        "2",
    ];
    let ahead: ServerProcess = ahead_clock.spawn(&ahead_dir.join("data"), &args, &[]);
    let behind: ServerProcess = behind_clock.spawn(&behind_dir.join("data"), &args, &[]);
    wait_ready(ahead.addr).await;
    wait_ready(behind.addr).await;
    let a = connect(ahead.addr).await;
    let b = connect(behind.addr).await;

    for (name, mut holder, mut other) in [
        ("granted behind, tried ahead", b.clone(), a.clone()),
        ("granted ahead, tried behind", a.clone(), b.clone()),
    ] {
        let t = holder
            .seal(seal_req(b"once", true))
            .await
            .unwrap()
            .into_inner()
            .request_state;
        let held = holder
            .open(reserve(&t, 30, "holder"))
            .await
            .unwrap()
            .into_inner();
        assert!(
            (29..=30).contains(&held.lease_seconds),
            "{name}: lease {}",
            held.lease_seconds
        );
        // Past a whole second, so that a lease judged by a clock 45 s
        // ahead would have ended.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        for c in [&mut other, &mut holder] {
            let err = c.open(reserve(&t, 30, "intruder")).await.unwrap_err();
            assert_eq!(reason(&err), "IN_USE", "{name}: reserve");
            let err = c.open(open_req(&t)).await.unwrap_err();
            assert_eq!(reason(&err), "IN_USE", "{name}: consume");
        }
        // Renewed through the other replica: the database's clock again.
        let renewed = other
            .renew(RenewRequest {
                reservation: held.reservation.clone(),
                lease_seconds: 30,
            })
            .await
            .unwrap()
            .into_inner();
        assert!((29..=30).contains(&renewed.lease_seconds), "{name}");
        holder
            .commit(CommitRequest {
                reservation: held.reservation,
            })
            .await
            .unwrap();
        let err = other.open(open_req(&t)).await.unwrap_err();
        assert_eq!(reason(&err), "REPLAYED", "{name}");
    }
    drop((ahead, behind));
}

/// A token sealed for ten minutes and reserved by "holder" for 30 s.
async fn seal_and_hold(c: &mut RequestStateClient<Channel>) -> (String, String) {
    let t = c
        .seal(stateseal::proto::SealRequest {
            ttl_seconds: 600,
            ..seal_req(b"once", true)
        })
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let held = c
        .open(reserve(&t, 30, "holder"))
        .await
        .unwrap()
        .into_inner();
    assert!((29..=30).contains(&held.lease_seconds));
    (t, held.reservation)
}

/// Another attempt finds `t` IN_USE, to reserve and to consume; the
/// holder's Commit counts; then `t` is REPLAYED.
async fn still_held(c: &mut RequestStateClient<Channel>, t: &str, held: String, name: &str) {
    let err = c.open(reserve(t, 30, "intruder")).await.unwrap_err();
    assert_eq!(reason(&err), "IN_USE", "{name}: reserve");
    let err = c.open(open_req(t)).await.unwrap_err();
    assert_eq!(reason(&err), "IN_USE", "{name}: consume");
    c.commit(CommitRequest { reservation: held }).await.unwrap();
    let err = c.open(open_req(t)).await.unwrap_err();
    assert_eq!(reason(&err), "REPLAYED", "{name}");
}

/// sled, one replica: a wall-clock step within `--clock-skew` (60 s by
/// default, so the replica stays ready) neither ends a lease early nor
/// stretches one granted during it into the past. A 30 s lease, then the
/// clock 45 s ahead: another attempt finds the token IN_USE. A 30 s lease
/// granted while the clock was 45 s behind, then the clock put right:
/// IN_USE too. With leases judged by the wall clock both were taken over
/// at once. The holders' Commits count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_leases_hold_through_wall_clock_steps_within_the_skew() {
    let tmp = tempfile::tempdir().unwrap();
    let ks = keys_init(tmp.path());
    let Some(clock) = Skewed::new(tmp.path()) else {
        return; // SKIPPED printed by the shim builder (no C compiler)
    };
    let replica: ServerProcess = clock.spawn(
        &tmp.path().join("data"),
        &["--keyset", &ks, "--gc-interval-ms", "100"],
        &[],
    );
    wait_ready(replica.addr).await;
    let mut c = connect(replica.addr).await;
    // Past the shim's reading period, so that the replica reads the new
    // offset.
    let settle = Duration::from_millis(4 * crate::common::skew::READ_EVERY_MS);
    for (name, during, after) in [("clock ahead", 0, 45), ("clock put right", -45, 0)] {
        clock.set(during);
        tokio::time::sleep(settle).await;
        let (t, held) = seal_and_hold(&mut c).await;
        clock.set(after);
        tokio::time::sleep(settle).await;
        still_held(&mut c, &t, held, name).await;
    }
    drop(replica);
}

/// sled, a restart: a lease judged by the ledger's monotonic clock, which
/// is anchored to the wall clock when the ledger opens. A 30 s lease
/// granted while the clock was 45 s behind (within the skew), then a
/// `kill -9` and a restart on the corrected clock: another attempt still
/// finds the token IN_USE, since a lease an earlier process granted gets
/// twice the skew more. Without that grace it had ended 15 s before it
/// was granted, by the new process's clock, and was taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_leases_hold_across_a_restart_on_a_corrected_clock() {
    let tmp = tempfile::tempdir().unwrap();
    let ks = keys_init(tmp.path());
    let Some(clock) = Skewed::new(tmp.path()) else {
        return; // SKIPPED printed by the shim builder (no C compiler)
    };
    let data = tmp.path().join("data");
    let args = ["--keyset", ks.as_str(), "--gc-interval-ms", "100"];
    clock.set(-45);
    let first: ServerProcess = clock.spawn(&data, &args, &[]);
    wait_ready(first.addr).await;
    let (t, held) = seal_and_hold(&mut connect(first.addr).await).await;
    first.kill9();
    clock.set(0);
    let second: ServerProcess = clock.spawn(&data, &args, &[]);
    wait_ready(second.addr).await;
    still_held(
        &mut connect(second.addr).await,
        &t,
        held,
        "after the restart",
    )
    .await;
    drop(second);
}

/// What one caller's execution of a token came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// Reserved, ran, and its Commit was accepted: a completed execution.
    Committed,
    /// Consumed outright (OPEN_MODE_CONSUME): a completed execution.
    Consumed,
    /// Reserved and ran, but the Commit was refused (taken over).
    CommitLost,
    /// Reserved, ran, released (a failed handler).
    Released,
    /// Refused at Open (IN_USE, REPLAYED, ...).
    Refused,
}

/// Each token's runs: (caller, outcome).
type History = BTreeMap<usize, Vec<(usize, Outcome)>>;

/// The randomized interleaving: `tokens` single-use tokens; for each,
/// `callers` callers start at random moments over two replicas (sled: one)
/// and each runs one of: reserve → a handler of 0–3.5 s (around a 1–2 s
/// lease) → commit or release, renewing every third of the lease or (half
/// of them) never; a plain consume; the same attempt twice; a
/// replay after the rest. Every completed execution is recorded; no token
/// may have two.
async fn interleavings(replicas: Vec<RequestStateClient<Channel>>, seed: u64, tokens: usize) {
    let callers = 5;
    eprintln!("interleavings: seed {seed} ({tokens} tokens x {callers} callers)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut sealed = Vec::new();
    for i in 0..tokens {
        let mut c = replicas[i % replicas.len()].clone();
        sealed.push(
            c.seal(seal_req(b"run", true))
                .await
                .unwrap()
                .into_inner()
                .request_state,
        );
    }
    // A reusable token whose Opens carry commits (`OpenRequest.commit`).
    let carrier = replicas[0]
        .clone()
        .seal(seal_req(b"carrier", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let log: Arc<Mutex<History>> = Arc::default();
    let mut tasks = Vec::new();
    for (ti, t) in sealed.iter().enumerate() {
        for caller in 0..callers {
            let start = Duration::from_millis(rng.gen_range(0..3000));
            let lease = if rng.gen_bool(0.7) { 1 } else { 2 };
            let handler = Duration::from_millis(rng.gen_range(0..3500));
            let renews = rng.gen_bool(0.5);
            let kind = rng.gen_range(0..10u8);
            let mut open_via = replicas[rng.gen_range(0..replicas.len())].clone();
            let mut finish_via = replicas[rng.gen_range(0..replicas.len())].clone();
            let (t, log, carrier) = (t.clone(), log.clone(), carrier.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(start).await;
                let attempt = format!("t{ti}-c{caller}");
                let outcome = if kind == 0 {
                    // A plain consume.
                    match open_via.open(open_req(&t)).await {
                        Ok(o) if o.get_ref().consumed => Outcome::Consumed,
                        Ok(_) => panic!("a single-use open that did not consume"),
                        Err(_) => Outcome::Refused,
                    }
                } else {
                    let mut held = match open_via.open(reserve(&t, lease, &attempt)).await {
                        Ok(o) => o.into_inner(),
                        Err(_) => {
                            log.lock()
                                .unwrap()
                                .entry(ti)
                                .or_default()
                                .push((caller, Outcome::Refused));
                            return;
                        }
                    };
                    if kind == 1 {
                        // The same attempt again (a retry after a lost
                        // answer): the same reservation.
                        let again = open_via
                            .open(reserve(&t, lease, &attempt))
                            .await
                            .unwrap()
                            .into_inner();
                        // (Compared by its end: each reservation string is sealed afresh,
                        // and never printed.)
                        assert!(
                            again.lease_expires_at_unix == held.lease_expires_at_unix,
                            "the same attempt, the same lease"
                        );
                        held = again;
                    }
                    // The handler, renewing its lease every third of it.
                    let every =
                        Duration::from_millis(u64::from(held.lease_seconds.max(1)) * 1000 / 3);
                    let ran = tokio::time::sleep(handler);
                    tokio::pin!(ran);
                    loop {
                        tokio::select! {
                            _ = &mut ran => break,
                            _ = tokio::time::sleep(every), if renews => {
                                let _ = finish_via
                                    .renew(RenewRequest {
                                        reservation: held.reservation.clone(),
                                        lease_seconds: lease,
                                    })
                                    .await;
                            }
                        }
                    }
                    if kind == 2 {
                        let _ = finish_via
                            .release(ReleaseRequest {
                                reservation: held.reservation,
                            })
                            .await;
                        Outcome::Released
                    } else if kind >= 6 {
                        // Carried by an Open of another token.
                        let carried = finish_via
                            .open(OpenRequest {
                                commit: held.reservation,
                                ..open_req(&carrier)
                            })
                            .await
                            .unwrap()
                            .into_inner()
                            .commits;
                        match carried[0].reason.as_str() {
                            "" => Outcome::Committed,
                            "LEASE_EXPIRED" => Outcome::CommitLost,
                            other => panic!("a carried commit refused {other}"),
                        }
                    } else {
                        match finish_via
                            .commit(CommitRequest {
                                reservation: held.reservation,
                            })
                            .await
                        {
                            Ok(_) => Outcome::Committed,
                            Err(e) => {
                                assert_eq!(reason(&e), "LEASE_EXPIRED");
                                Outcome::CommitLost
                            }
                        }
                    }
                };
                log.lock()
                    .unwrap()
                    .entry(ti)
                    .or_default()
                    .push((caller, outcome));
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Replays of every token after the rest: never a fresh acceptance of a
    // token that completed.
    let log = log.lock().unwrap().clone();
    let mut completed_tokens = BTreeSet::new();
    let mut histogram: BTreeMap<Outcome, usize> = BTreeMap::new();
    for (ti, runs) in &log {
        let completed: Vec<_> = runs
            .iter()
            .filter(|(_, o)| matches!(o, Outcome::Committed | Outcome::Consumed))
            .collect();
        assert!(
            completed.len() <= 1,
            "seed {seed}: token {ti} completed {} times: {runs:?}",
            completed.len()
        );
        if !completed.is_empty() {
            completed_tokens.insert(*ti);
        }
        for (_, o) in runs {
            *histogram.entry(*o).or_default() += 1;
        }
    }
    for ti in &completed_tokens {
        let mut c = replicas[ti % replicas.len()].clone();
        let err = c.open(open_req(&sealed[*ti])).await.unwrap_err();
        assert_eq!(reason(&err), "REPLAYED", "seed {seed}: token {ti}");
    }
    eprintln!(
        "interleavings: outcomes {histogram:?}, {} tokens completed",
        completed_tokens.len()
    );
    // The run exercised what it claims to: completions, refusals, and
    // (handlers outliving unrenewed leases) takeovers.
    assert!(
        histogram.get(&Outcome::Refused).copied().unwrap_or(0) > 0,
        "{histogram:?}"
    );
    assert!(!completed_tokens.is_empty(), "{histogram:?}");
}

fn seed() -> u64 {
    std::env::var("STATESEAL_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::random::<u64>() % 1_000_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_interleavings_on_two_postgres_replicas_complete_each_token_at_most_once() {
    let Some(pg) = crate::common::pg::shared("postgresql-interleavings").await else {
        return;
    };
    let url = pg.url.clone();
    let tmp = tempfile::tempdir().unwrap();
    let ks = keys_init(tmp.path());
    let args = [
        "--ledger",
        "postgres",
        "--database-url",
        &url,
        "--keyset",
        &ks,
        "--expected-replicas",
        "2",
    ];
    let procs: Vec<_> = (0..2)
        .map(|i| spawn(&tmp.path().join(format!("d{i}")), &args, &[]))
        .collect();
    let mut clients = Vec::new();
    for p in &procs {
        wait_ready(p.addr).await;
        clients.push(connect(p.addr).await);
    }
    interleavings(clients, seed(), 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_interleavings_on_sled_complete_each_token_at_most_once() {
    let tmp = tempfile::tempdir().unwrap();
    let ks = keys_init(tmp.path());
    let p = spawn(&tmp.path().join("d"), &["--keyset", &ks], &[]);
    wait_ready(p.addr).await;
    let c = connect(p.addr).await;
    interleavings(vec![c.clone(), c], seed(), 40).await;
}

/// A replica whose clock guard disagrees still commits, renews and
/// releases a reservation (none of them reads the clock to decide): with
/// Commit refused, a handler that had run lost its lease and its replay
/// ran it again (found by review). Opens and Seals stay refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_renew_and_release_work_while_the_clock_guard_disagrees() {
    use stateseal::internals::binding::Tenant;
    use stateseal::internals::clock::guard::TimeGuard;
    use stateseal::internals::error::Reject;
    use stateseal::internals::keyring::{Keyring, KeyringHandle, KeysetFile};
    use stateseal::internals::ledger::sled::SledLedger;
    use stateseal::internals::sealer::{Limits, OpenMode as Mode, Sealer, Trail};

    let dir = tempfile::tempdir().unwrap();
    let keys = Arc::new(KeyringHandle::new(
        Keyring::from_file(&KeysetFile::generate(T0)).unwrap(),
    ));
    let ledger = Arc::new(SledLedger::open(&dir.path().join("ledger")).unwrap());
    let clock = Arc::new(stateseal::internals::clock::WallClock);
    let synced = Sealer::new(
        keys.clone(),
        ledger.clone(),
        clock.clone(),
        Limits::default(),
    );
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // A high-water mark far ahead: this guard says the clock went back.
    let unsynced = Sealer::new(keys, ledger, clock, Limits::default())
        .with_guard(TimeGuard::new(60, Some(wall + 10_000)));
    assert!(!unsynced.guard().synced());
    let tenant = Tenant::new("t");
    let b = bind_json(&synced, &tenant, "alice", "tools/call", r#"{"name":"t"}"#).unwrap();
    for finish in ["commit", "release"] {
        let t = synced.seal(&b, b"x", 0, true, None).unwrap().token;
        let o = synced
            .open(
                &b,
                synced.precheck(&t).unwrap(),
                Mode::Reserve { lease_seconds: 5 },
                None,
                &mut Trail::default(),
            )
            .await
            .unwrap();
        let (r, _) = o.reservation.unwrap();
        assert_eq!(
            unsynced
                .open(
                    &b,
                    unsynced.precheck(&t).unwrap(),
                    Mode::Consume,
                    None,
                    &mut Trail::default()
                )
                .await
                .unwrap_err(),
            Reject::ClockUnsynced
        );
        unsynced
            .renew(&tenant, &r, 5, &mut Trail::default())
            .await
            .unwrap();
        let mut trail = Trail::default();
        match finish {
            "commit" => unsynced.commit(&tenant, &r, &mut trail).await.unwrap(),
            _ => unsynced.release(&tenant, &r, &mut trail).await.unwrap(),
        }
        let again = synced
            .open(
                &b,
                synced.precheck(&t).unwrap(),
                Mode::Consume,
                None,
                &mut Trail::default(),
            )
            .await;
        match finish {
            // Committed: the token is spent.
            "commit" => assert_eq!(again.unwrap_err(), Reject::Replayed),
            // Released: it opens afresh.
            _ => assert!(again.unwrap().consumed),
        }
    }
}
