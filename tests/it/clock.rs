//! Clock steps, stalls and restarts never reopen a consumed token. The real
//! binary runs under an `LD_PRELOAD` shim (compiled here with the system C
//! compiler) that adds an offset, read from a file the test rewrites, to
//! `clock_gettime(CLOCK_REALTIME)`.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::process::{http_get, metrics_addr, spawn};
use crate::common::skew::Skewed;
use crate::common::*;
use stateseal::proto::SealRequest;
use tonic_health::pb::health_check_response::ServingStatus;

async fn readiness(addr: std::net::SocketAddr) -> i32 {
    health_status(addr, "stateseal.v1.RequestState").await
}

async fn wait_for(addr: std::net::SocketAddr, want: ServingStatus, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while readiness(addr).await != want as i32 {
        assert!(
            Instant::now() < deadline,
            "{what}: readiness never became {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn seal_ttl(ttl: u32) -> SealRequest {
    SealRequest {
        ttl_seconds: ttl,
        ..seal_req(b"once", true)
    }
}

const FAST_GC: [&str; 4] = ["--gc-interval-ms", "200", "--reload-interval-ms", "200"];

/// PostgreSQL, two replicas: a +2 h step on R2 for a few seconds deletes no
/// row, R2 refuses to seal and reports NOT_SERVING meanwhile, and R1 still
/// answers REPLAYED afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_step_on_one_postgres_replica_reopens_nothing() {
    let Some(pg) = crate::common::pg::shared("postgresql-clock-step-test").await else {
        return;
    };
    let url = pg.url.clone();
    let tmp = tempfile::tempdir().unwrap();
    let Some(clock) = Skewed::new(tmp.path()) else {
        return;
    };
    let ks = tmp.path().join("keyset.json");
    stateseal::internals::keyring::KeysetFile::generate(1)
        .write(&ks, true)
        .unwrap();
    let mut args = vec!["--ledger", "postgres", "--keyset", ks.to_str().unwrap()];
    args.extend_from_slice(&FAST_GC);
    args.extend_from_slice(&["--expected-replicas", "2"]);
    let env = [("STATESEAL_DATABASE_URL", url.as_str())];
    let r1 = spawn(&tmp.path().join("r1"), &args, &env);
    let r2 = clock.spawn(&tmp.path().join("r2"), &args, &env);
    let mut c1 = connect(r1.addr).await;
    let mut c2 = connect(r2.addr).await;
    let t = c1
        .seal(seal_ttl(600))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert!(c1.open(open_req(&t)).await.unwrap().into_inner().consumed);

    clock.set(7200);
    wait_for(r2.addr, ServingStatus::NotServing, "R2 during the step").await;
    let err = c2.seal(seal_ttl(600)).await.unwrap_err();
    assert_eq!(reason(&err), "CLOCK_UNSYNCED");
    // Several GC rounds of R2 under the wrong clock.
    tokio::time::sleep(Duration::from_secs(2)).await;
    clock.set(0);
    wait_for(r2.addr, ServingStatus::Serving, "R2 after the step").await;

    assert_eq!(
        reason(&c1.open(open_req(&t)).await.unwrap_err()),
        "REPLAYED"
    );
    assert_eq!(
        reason(&c2.open(open_req(&t)).await.unwrap_err()),
        "REPLAYED"
    );
    r1.terminate();
    r2.terminate();
}

/// sled: a +2 h step, then a restart, reopens nothing; a restart *during* a
/// step (the process anchors on the wrong time) costs availability, never
/// single use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_step_then_restart_on_sled_reopens_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(clock) = Skewed::new(tmp.path()) else {
        return;
    };
    let data = tmp.path().join("data");
    let mut args = FAST_GC.to_vec();
    args.extend_from_slice(&["--metrics-listen", "127.0.0.1:0"]);
    let s = clock.spawn(&data, &args, &[]);
    let mut c = connect(s.addr).await;
    let t1 = c
        .seal(seal_ttl(600))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert!(c.open(open_req(&t1)).await.unwrap().into_inner().consumed);
    // The guard logs transitions only: nothing while the clocks agree.
    const DISAGREES: &str = "the wall clock disagrees with the reference clock";
    const AGREES: &str = "the wall clock agrees with the reference again";
    let logged = |what: &str| {
        s.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(what))
            .count()
    };
    // The log is read from the child's stderr on a thread of its own: a
    // line may land a moment after the state it reports.
    let logged_once = |what: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while logged(what) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        logged(what)
    };
    assert_eq!((logged(DISAGREES), logged(AGREES)), (0, 0));
    clock.set(7200);
    wait_for(s.addr, ServingStatus::NotServing, "during the step").await;
    // One line each way. (Two tasks judge the clock, so a verdict read just
    // before the step and stored just after another's can flip it once
    // more: up to 3 lines; a guard that logged on every check would log
    // several a second.)
    let few = 1..=3;
    assert!(
        few.contains(&logged_once(DISAGREES)),
        "an error when the clocks part"
    );
    // The metrics say so, and by how much: 2 h ahead of the reference.
    let metrics = http_get(metrics_addr(&s), "/metrics");
    assert!(metrics.contains("stateseal_clock_synced 0"), "{metrics}");
    let offset: i64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("stateseal_clock_offset_seconds "))
        .expect("the offset gauge")
        .trim()
        .parse()
        .unwrap();
    assert!((7100..=7300).contains(&offset), "offset {offset}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    clock.set(0);
    wait_for(s.addr, ServingStatus::Serving, "after the step").await;
    assert!(
        few.contains(&logged_once(AGREES)),
        "a line when they agree again"
    );
    // Time for a guard that logs on every check to show it (GC judges the
    // clock every 200 ms here).
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        few.contains(&logged(DISAGREES)),
        "no repeat while they stayed apart"
    );
    assert!(few.contains(&logged(AGREES)), "no repeat while they agree");
    s.terminate();

    let s = clock.spawn(&data, &FAST_GC, &[]);
    let mut c = connect(s.addr).await;
    assert_eq!(
        reason(&c.open(open_req(&t1)).await.unwrap_err()),
        "REPLAYED"
    );
    let t2 = c
        .seal(seal_ttl(600))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert!(c.open(open_req(&t2)).await.unwrap().into_inner().consumed);
    s.terminate();

    // Restarted while the clock is 2 h ahead: it cannot tell, collects, and
    // records the wrong time.
    clock.set(7200);
    let s = clock.spawn(&data, &FAST_GC, &[]);
    let mut c = connect(s.addr).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    for t in [&t1, &t2] {
        let err = c.open(open_req(t)).await.unwrap_err();
        assert_ne!(err.code(), tonic::Code::Ok);
    }
    s.terminate();
    // The clock is corrected, the process restarted: still nothing reopens.
    clock.set(0);
    let s = clock.spawn(&data, &FAST_GC, &[]);
    let mut c = connect(s.addr).await;
    for t in [&t1, &t2] {
        let r = reason(&c.open(open_req(t)).await.unwrap_err());
        assert!(
            ["REPLAYED", "EXPIRED", "CLOCK_UNSYNCED"].contains(&r.as_str()),
            "{r}"
        );
    }
    s.terminate();
}

/// sled: a token consumed, expired and collected; then the clock steps back
/// an hour and the process restarts: the token does not open again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backward_step_then_restart_reopens_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(clock) = Skewed::new(tmp.path()) else {
        return;
    };
    let data = tmp.path().join("data");
    let mut args = vec!["--clock-skew", "1"];
    args.extend_from_slice(&FAST_GC);
    let s = clock.spawn(&data, &args, &[]);
    let mut c = connect(s.addr).await;
    let t = c
        .seal(seal_ttl(2))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert!(c.open(open_req(&t)).await.unwrap().into_inner().consumed);
    // Past expiry + skew, and several GC rounds: the record is collected.
    tokio::time::sleep(Duration::from_secs(5)).await;
    s.terminate();

    clock.set(-3600);
    let s = clock.spawn(&data, &args, &[]);
    let mut c = connect(s.addr).await;
    let err = c.open(open_req(&t)).await.unwrap_err();
    let r = reason(&err);
    assert!(["EXPIRED", "CLOCK_UNSYNCED"].contains(&r.as_str()), "{r}");
    assert_eq!(readiness(s.addr).await, ServingStatus::NotServing as i32);
    s.terminate();
}

/// The race between the expiry check and the ledger decision: a second Open
/// passes the expiry check, stalls before the ledger (a stalled disk), the
/// record is collected meanwhile, then the ledger decides. Refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumption_is_not_accepted_after_collection() {
    use stateseal::internals::ledger::sled::SledLedger;
    use stateseal::internals::ledger::{Ledger, LedgerError};
    use stateseal::internals::sealer::Limits;
    use stateseal::internals::server::ServeOptions;

    /// Holds every consume after the first until released.
    #[derive(Default)]
    struct Stall {
        calls: std::sync::atomic::AtomicUsize,
        release: tokio::sync::Notify,
    }
    #[async_trait::async_trait]
    impl crate::common::hooked::Hooks for Stall {
        async fn consume(&self) -> Result<(), LedgerError> {
            if self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
                self.release.notified().await;
            }
            Ok(())
        }
    }

    let dir = tempfile::tempdir().unwrap();
    let sled = Arc::new(SledLedger::open(&dir.path().join("ledger")).unwrap());
    let stalling = Arc::new(crate::common::hooked::Hooked {
        inner: sled.clone(),
        hooks: Stall::default(),
    });
    let manual = Arc::new(stateseal::internals::clock::ManualClock::new(T0));
    let limits = Limits {
        clock_skew: 0,
        ..Limits::default()
    };
    let opts = ServeOptions {
        // The test collects by hand.
        gc_every: Duration::from_secs(3600),
        ..ServeOptions::default()
    };
    let s = TestServer::builder()
        .dir(dir)
        .limits(limits)
        .options(opts)
        .sled(sled.clone())
        .ledger(stalling.clone())
        .clock(manual.clone())
        .start()
        .await;
    let mut c = s.client.clone();
    let t = c
        .seal(seal_ttl(10))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert!(c.open(open_req(&t)).await.unwrap().into_inner().consumed);
    // The second open passes the expiry check, then stalls.
    let second = {
        let mut c = c.clone();
        let t = t.clone();
        tokio::spawn(async move { c.open(open_req(&t)).await })
    };
    while stalling
        .hooks
        .calls
        .load(std::sync::atomic::Ordering::SeqCst)
        < 2
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Meanwhile the token expires and its record is collected.
    manual.advance(20);
    let removed = sled.remove_expired(manual_now(&manual), 100).await.unwrap();
    assert_eq!(removed, 1);
    stalling.hooks.release.notify_one();
    let err = second.await.unwrap().unwrap_err();
    assert_eq!(reason(&err), "EXPIRED");
    s.stop().await;
}

fn manual_now(c: &stateseal::internals::clock::ManualClock) -> u64 {
    use stateseal::internals::clock::Clock;
    c.now_unix()
}
