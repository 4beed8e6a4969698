//! Failure: a ledger that fails (fault injection) fails closed and recovers;
//! clocks near expiry and going backwards; kill -9 at random moments under
//! concurrent single-use consumption never lets an acknowledged consumption
//! open again.
//!
//! The crash loop runs STATESEAL_CRASH_CYCLES cycles (3 by default; the
//! documented long run uses 25).
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::process::spawn;
use crate::common::*;
use rand::Rng;
use stateseal::internals::clock::{Clock, ManualClock};
use stateseal::internals::ledger::sled::SledLedger;
use stateseal::internals::ledger::LedgerError;
use stateseal::internals::sealer::Limits;
use stateseal::internals::server::ServeOptions;
use stateseal::proto::SealRequest;
use tonic_health::pb::health_check_response::ServingStatus;

/// While `broken`, every call to the ledger behind fails as a full or
/// read-only disk would.
#[derive(Default)]
struct Broken(AtomicBool);

#[async_trait::async_trait]
impl hooked::Hooks for Broken {
    async fn consume(&self) -> Result<(), LedgerError> {
        self.write()
    }
    fn write(&self) -> Result<(), LedgerError> {
        if self.0.load(Ordering::SeqCst) {
            return Err(LedgerError::Storage {
                step: "injected write",
                detail: "no space left on device".into(),
            });
        }
        Ok(())
    }
    fn collect(&self) -> Result<(), LedgerError> {
        if self.0.load(Ordering::SeqCst) {
            return Err(LedgerError::Storage {
                step: "injected collect",
                detail: "failure".into(),
            });
        }
        Ok(())
    }
    fn ready(&self) -> bool {
        !self.0.load(Ordering::SeqCst)
    }
}

async fn health(addr: std::net::SocketAddr) -> i32 {
    health_status(addr, "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_ledger_fails_closed_then_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let sled = Arc::new(SledLedger::open(&dir.path().join("ledger")).unwrap());
    let faulty = Arc::new(hooked::Hooked {
        inner: sled.clone(),
        hooks: Broken::default(),
    });
    let clock = Arc::new(ManualClock::new(T0));
    let opts = ServeOptions {
        health_every: Duration::from_millis(50),
        ..ServeOptions::default()
    };
    let mut s = TestServer::builder()
        .dir(dir)
        .options(opts)
        .sled(sled)
        .ledger(faulty.clone())
        .clock(clock)
        .start()
        .await;
    let tokens = seal_tokens(&mut s.client, 10, true).await;
    let reusable = s
        .client
        .seal(seal_req(b"r", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;

    faulty.hooks.0.store(true, Ordering::SeqCst);
    for t in &tokens {
        for _ in 0..3 {
            let err = s.client.open(open_req(t)).await.unwrap_err();
            assert_eq!(reason(&err), "LEDGER_UNAVAILABLE");
            assert_eq!(err.code(), tonic::Code::Unavailable);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while health(s.addr).await != ServingStatus::NotServing as i32 {
        assert!(Instant::now() < deadline, "readiness did not drop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Reusable tokens never touch the ledger.
    s.client.open(open_req(&reusable)).await.unwrap();

    faulty.hooks.0.store(false, Ordering::SeqCst);
    while health(s.addr).await != ServingStatus::Serving as i32 {
        assert!(
            Instant::now() < deadline + Duration::from_secs(5),
            "readiness did not recover"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for t in &tokens {
        assert!(
            s.client
                .open(open_req(t))
                .await
                .unwrap()
                .into_inner()
                .consumed
        );
        assert_eq!(
            reason(&s.client.open(open_req(t)).await.unwrap_err()),
            "REPLAYED"
        );
    }
    s.stop().await;
}

#[tokio::test]
async fn a_clock_going_backwards_neither_reopens_expired_tokens_nor_drops_live_records() {
    let dir = tempfile::tempdir().unwrap();
    let sled = Arc::new(SledLedger::open(&dir.path().join("ledger")).unwrap());
    let manual = Arc::new(ManualClock::new(T0));
    // The plain manual clock: no high-water mark; the ledger's horizon is
    // what keeps a collected record from being consumed afresh.
    let clock: Arc<dyn Clock> = manual.clone();
    let limits = Limits {
        clock_skew: 60,
        ..Limits::default()
    };
    let opts = ServeOptions {
        gc_every: Duration::from_millis(50),
        ..ServeOptions::default()
    };
    let mut s = TestServer::builder()
        .dir(dir)
        .limits(limits)
        .options(opts)
        .sled(sled.clone())
        .clock(manual.clone())
        .sealer_clock(clock)
        .start()
        .await;

    let short = s
        .client
        .seal(SealRequest {
            ttl_seconds: 30,
            ..seal_req(b"x", true)
        })
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let long = s
        .client
        .seal(SealRequest {
            ttl_seconds: 3600,
            ..seal_req(b"y", true)
        })
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert!(
        s.client
            .open(open_req(&short))
            .await
            .unwrap()
            .into_inner()
            .consumed
    );
    assert!(
        s.client
            .open(open_req(&long))
            .await
            .unwrap()
            .into_inner()
            .consumed
    );

    // Near expiry: 29 s in, a fresh token still opens; at 30 s it is expired.
    let edge = s
        .client
        .seal(SealRequest {
            ttl_seconds: 30,
            ..seal_req(b"e", false)
        })
        .await
        .unwrap()
        .into_inner()
        .request_state;
    manual.advance(29);
    s.client.open(open_req(&edge)).await.unwrap();
    manual.advance(1);
    assert_eq!(
        reason(&s.client.open(open_req(&edge)).await.unwrap_err()),
        "EXPIRED"
    );

    // Far past the short token's expiry + skew: GC removes its record.
    manual.set(T0 + 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The wall clock now steps back before the short token's expiry.
    manual.set(T0 + 5);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Its record is gone, but it does not reopen: time never goes back.
    assert_eq!(
        reason(&s.client.open(open_req(&short)).await.unwrap_err()),
        "EXPIRED"
    );
    // The long token's record was not collected early, even with GC running
    // while the clock was stepped back and forth.
    assert_eq!(
        reason(&s.client.open(open_req(&long)).await.unwrap_err()),
        "REPLAYED"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_random_moments_never_reopens_an_acknowledged_consumption() {
    let cycles: usize = std::env::var("STATESEAL_CRASH_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir().unwrap();
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut rng = rand::thread_rng();
    for cycle in 0..cycles {
        let p = spawn(dir.path(), &[], &[]);
        let client = connect(p.addr).await;
        // Everything acknowledged before this start must stay consumed.
        {
            let mut c = client.clone();
            let before: Vec<String> = acked.lock().unwrap().clone();
            for t in &before {
                let err = c
                    .open(open_req(t))
                    .await
                    .expect_err("an acknowledged consumption opened again");
                assert_eq!(reason(&err), "REPLAYED", "cycle {cycle}");
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..16)
            .map(|_| {
                let (mut c, stop, acked) = (client.clone(), stop.clone(), acked.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let Ok(r) = c.seal(seal_req(b"crash", true)).await else {
                            break;
                        };
                        let t = r.into_inner().request_state;
                        match c.open(open_req(&t)).await {
                            Ok(r) if r.get_ref().consumed => acked.lock().unwrap().push(t),
                            Ok(_) => panic!("a single-use open did not consume"),
                            Err(_) => break, // the server is gone
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(rng.gen_range(100..500))).await;
        p.kill9(); // mid-flight: requests are being answered right now
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            w.await.unwrap();
        }
    }
    // A final start checks the last cycle's acknowledgements too.
    let p = spawn(dir.path(), &[], &[]);
    let mut c = connect(p.addr).await;
    let all = acked.lock().unwrap().clone();
    for t in &all {
        assert_eq!(reason(&c.open(open_req(t)).await.unwrap_err()), "REPLAYED");
    }
    assert!(!all.is_empty());
    eprintln!(
        "crash loop: {cycles} kill -9 cycles, {} acknowledged consumptions re-checked, 0 reopened",
        all.len()
    );
    p.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_huge_requests_do_not_starve_small_ones() {
    let mut s = start().await;
    let call = |args: String| format!("{{\"name\":\"t\",\"arguments\":{args}}}");
    let big_ok = call(format!("{{\"blob\":\"{}\"}}", "x".repeat(1024 * 1024 - 96)));
    let big_bad = call(format!("{{\"blob\":\"{}\"}}", "x".repeat(1024 * 1024 + 64)));
    let deep = call(format!(
        "{{\"a\":{}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    ));
    let mut tasks = Vec::new();
    for i in 0..24 {
        let mut c = s.client.clone();
        let json = [&big_ok, &big_bad, &deep][i % 3].clone();
        tasks.push(tokio::spawn(async move {
            let req = SealRequest {
                binding: Some(binding("alice", "tools/call", &json)),
                ..seal_req(b"s", false)
            };
            c.seal(req).await.map(|_| ()).map_err(|e| reason(&e))
        }));
    }
    // Meanwhile small requests keep being served.
    for _ in 0..50 {
        let t = s
            .client
            .seal(seal_req(b"small", false))
            .await
            .unwrap()
            .into_inner()
            .request_state;
        s.client.open(open_req(&t)).await.unwrap();
    }
    // Each gets its own answer — or OVERLOADED at once when the request-byte
    // budget (16 MiB) is full; at least one at the limit is served.
    let mut outcomes = std::collections::BTreeMap::new();
    let overloaded = Err("OVERLOADED".to_string());
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await.unwrap();
        if r != overloaded {
            match i % 3 {
                0 => assert!(r.is_ok(), "a params_json at the limit was refused: {r:?}"),
                1 => assert_eq!(r, Err("TOO_LARGE".to_string())),
                _ => assert_eq!(r, Err("MALFORMED".to_string())),
            }
        }
        *outcomes.entry(format!("{r:?}")).or_insert(0) += 1;
    }
    assert_eq!(outcomes.values().sum::<i32>(), 24);
    assert!(outcomes.contains_key("Ok(())"), "{outcomes:?}");
    s.stop().await;
}
