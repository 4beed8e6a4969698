//! The sled ledger's memory is bounded by a record count, not by sled's cache
//! (sled keeps every live record in memory, about 200 bytes each, whatever
//! its cache capacity): past `--max-ledger-records`, consuming or reserving
//! a token the ledger does not hold is refused `OVERLOADED` with nothing
//! recorded; replays are still `REPLAYED`; collection makes room again; the
//! count survives a restart.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use crate::common::*;
use stateseal::internals::keyring::KeysetFile;
use stateseal::internals::ledger::sled::SledLedger;
use stateseal::internals::ledger::Ledger;
use stateseal::internals::sealer::Limits;
use stateseal::proto::{OpenMode, OpenRequest};
use tonic::Code;

async fn server(dir: tempfile::TempDir, keyset: KeysetFile, max: u64) -> TestServer {
    let sled = SledLedger::open(&dir.path().join("ledger"))
        .unwrap()
        .with_max_records(max);
    TestServer::builder()
        .dir(dir)
        .keyset(keyset)
        .sled(Arc::new(sled))
        .start()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_ledger_refuses_new_records_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let keyset = KeysetFile::generate(T0);
    let mut s = server(dir, keyset.clone(), 3).await;
    let tokens = seal_tokens(&mut s.client, 6, true).await;
    for t in &tokens[..3] {
        let o = s.client.open(open_req(t)).await.unwrap().into_inner();
        assert!(o.consumed);
    }
    assert_eq!(s.ledger.records(), 3);

    // Full: a new consumption and a new reservation are refused, nothing recorded.
    for _ in 0..2 {
        let err = s.client.open(open_req(&tokens[3])).await.unwrap_err();
        assert_eq!(reason(&err), "OVERLOADED");
        assert_eq!(err.code(), Code::ResourceExhausted);
    }
    let reserve = OpenRequest {
        mode: OpenMode::Reserve as i32,
        ..open_req(&tokens[4])
    };
    let err = s.client.open(reserve.clone()).await.unwrap_err();
    assert_eq!(reason(&err), "OVERLOADED");
    assert_eq!(s.ledger.records(), 3);
    assert_eq!(
        s.ledger
            .stats()
            .refused_full
            .load(std::sync::atomic::Ordering::Relaxed),
        3
    );
    // A replay needs no room: still REPLAYED, never OVERLOADED.
    let err = s.client.open(open_req(&tokens[0])).await.unwrap_err();
    assert_eq!(reason(&err), "REPLAYED");
    // Reusable tokens never touch the ledger.
    let reusable = seal_tokens(&mut s.client, 1, false).await;
    s.client.open(open_req(&reusable[0])).await.unwrap();

    // The count survives a restart: the bound still holds.
    let dir = s.stop().await;
    let mut s = server(dir, keyset.clone(), 3).await;
    assert_eq!(s.ledger.records(), 3);
    let err = s.client.open(open_req(&tokens[3])).await.unwrap_err();
    assert_eq!(reason(&err), "OVERLOADED");

    // Collection of the expired records makes room; the refused tokens
    // were not burned. (Tokens sealed at T0 expire at T0 + 600; collecting
    // below T0 + 601 takes the three consumed ones.)
    let fresh = {
        s.clock.set(T0 + 700);
        seal_tokens(&mut s.client, 2, true).await
    };
    assert_eq!(s.ledger.remove_expired(T0 + 601, 1000).await.unwrap(), 3);
    assert_eq!(s.ledger.records(), 0);
    for t in &fresh {
        let o = s.client.open(open_req(t)).await.unwrap().into_inner();
        assert!(o.consumed);
    }
    let reserve = OpenRequest {
        mode: OpenMode::Reserve as i32,
        ..open_req(&seal_tokens(&mut s.client, 1, true).await[0])
    };
    let o = s.client.open(reserve).await.unwrap().into_inner();
    assert!(!o.reservation.is_empty());
    assert_eq!(s.ledger.records(), 3);
    let err = s.client.open(open_req(&fresh[0])).await.unwrap_err();
    assert_eq!(reason(&err), "REPLAYED");
}

/// Many callers at once against the bound: exactly `max` consumptions are
/// acknowledged, every other call is refused OVERLOADED, and every
/// acknowledged one is REPLAYED afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_consumptions_never_pass_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = server(dir, KeysetFile::generate(T0), 50).await;
    let tokens = seal_tokens(&mut s.client, 200, true).await;
    let mut tasks = Vec::new();
    for t in tokens.clone() {
        let mut c = s.client.clone();
        tasks.push(tokio::spawn(async move {
            match c.open(open_req(&t)).await {
                Ok(o) => {
                    assert!(o.into_inner().consumed);
                    Some(t)
                }
                Err(e) => {
                    assert_eq!(reason(&e), "OVERLOADED");
                    None
                }
            }
        }));
    }
    let mut accepted = Vec::new();
    for t in tasks {
        if let Some(t) = t.await.unwrap() {
            accepted.push(t);
        }
    }
    assert_eq!(accepted.len(), 50);
    assert_eq!(s.ledger.records(), 50);
    for t in &accepted {
        let err = s.client.open(open_req(t)).await.unwrap_err();
        assert_eq!(reason(&err), "REPLAYED");
    }
}

/// The keys, a manual clock at [`T0`] and limits with a 5 s skew: the
/// sealer side of the tests that drive a sled ledger's clock by hand.
fn manual_time() -> (
    Arc<stateseal::internals::keyring::KeyringHandle>,
    Arc<stateseal::internals::clock::ManualClock>,
    Limits,
) {
    use stateseal::internals::keyring::{Keyring, KeyringHandle};
    let keys = Arc::new(KeyringHandle::new(
        Keyring::from_file(&KeysetFile::generate(T0)).unwrap(),
    ));
    let clock = Arc::new(stateseal::internals::clock::ManualClock::new(T0));
    let limits = Limits {
        clock_skew: 5,
        ..Limits::default()
    };
    (keys, clock, limits)
}

/// Seals a fresh single-use token of `tenant` (an hour to live) and
/// reserves it for 2 s: its reservation.
async fn reserve_fresh(
    s: &stateseal::internals::sealer::Sealer,
    tenant: &stateseal::internals::binding::Tenant,
) -> Result<String, stateseal::internals::error::Reject> {
    use stateseal::internals::sealer::OpenMode;
    let b = bind_json(
        s,
        tenant,
        "alice",
        "tools/call",
        r#"{"name":"t","arguments":{}}"#,
    )
    .unwrap();
    let t = s.seal(&b, b"x", 3600, true, None).unwrap().token;
    let u = s.precheck(&t).unwrap();
    let o = s
        .open(
            &b,
            u,
            OpenMode::Reserve { lease_seconds: 2 },
            None,
            &mut Default::default(),
        )
        .await?;
    Ok(o.reservation.expect("reserved").0)
}

/// One tenant at its share of the ledger (`--max-ledger-records-per-tenant`)
/// is refused `OVERLOADED` for new tokens, and another tenant is not: here
/// the abuser reserves long-lived tokens and never commits. Its ended
/// leases are collected the clock skew after they end (long before their
/// tokens expire), which gives it room again. The per-tenant counts survive
/// a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_at_its_bound_does_not_block_another() {
    use stateseal::internals::binding::Tenant;
    use stateseal::internals::clock::Clock;
    use stateseal::internals::error::Reject;
    use stateseal::internals::sealer::Sealer;

    let dir = tempfile::tempdir().unwrap();
    let (keys, clock, limits) = manual_time();
    let sealer =
        |sled: Arc<SledLedger>| Sealer::new(keys.clone(), sled, clock.clone(), limits.clone());
    let open_sled = || {
        Arc::new(
            crate::common::open_sled_again(&dir.path().join("ledger"))
                .with_clock(clock.clone())
                .with_max_records(100)
                .with_max_tenant_records(4),
        )
    };
    let (abuser, victim) = (Tenant::new("abuser"), Tenant::new("victim"));
    async fn reserve(s: &Sealer, tenant: &Tenant) -> Result<(), Reject> {
        reserve_fresh(s, tenant).await.map(|_| ())
    }

    let sled = open_sled();
    let s = sealer(sled.clone());
    for _ in 0..4 {
        reserve(&s, &abuser).await.unwrap();
    }
    assert_eq!(
        reserve(&s, &abuser).await,
        Err(Reject::Overloaded),
        "the abuser is at its share"
    );
    for _ in 0..4 {
        reserve(&s, &victim).await.unwrap();
    }
    let stats = sled.flush_stats().unwrap();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&stats.refused_tenant_full), 1);
    assert_eq!(load(&stats.top_tenant_records), 4);
    assert_eq!(sled.records(), 8);

    // After a restart the counts are read back from the records.
    drop(s);
    sled.close().await.unwrap();
    drop(sled);
    let sled = open_sled();
    let s = sealer(sled.clone());
    assert_eq!(reserve(&s, &abuser).await, Err(Reject::Overloaded));
    assert_eq!(reserve(&s, &victim).await, Err(Reject::Overloaded));

    // The leases ended (2 s) and nobody took them over: collected the skew
    // (5 s) after, whatever the tokens' hour of life says.
    clock.advance(2 + 5 + 1);
    let removed = sled
        .remove_expired(clock.now_unix() - 5, 100)
        .await
        .unwrap();
    assert_eq!(removed, 8);
    assert_eq!(sled.records(), 0);
    reserve(&s, &abuser).await.unwrap();
    let stats = sled.flush_stats().unwrap();
    assert_eq!(load(&stats.collected_leases), 8);
}

/// A reservation whose lease ends when its token expires is both expired
/// and ended at collection: it is removed, and counted, once (it was
/// counted twice, the record count wrapped below zero and the ledger
/// refused every new token until a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_ending_with_its_token_is_collected_once() {
    use stateseal::internals::ledger::{LeaseAsk, LedgerKey, Reserved, TenantTag};
    let dir = tempfile::tempdir().unwrap();
    let sled = SledLedger::open(&dir.path().join("ledger"))
        .unwrap()
        .with_clock(Arc::new(stateseal::internals::clock::ManualClock::new(
            2_000_000_000,
        )))
        .with_max_records(10);
    let now = 2_000_000_000u64;
    let key = |i: u8| LedgerKey {
        expires_at: now + 30,
        id: [i; 32],
        tenant: TenantTag::of("t"),
    };
    for i in 0..3 {
        let ask = LeaseAsk {
            rid: [i; 16],
            attempt: None,
            seconds: 30,
            cap: now + 30,
        };
        assert!(matches!(
            sled.reserve(&key(i), ask).await.unwrap(),
            Reserved::Now(_)
        ));
    }
    let live = LedgerKey {
        expires_at: now + 600,
        id: [9; 32],
        tenant: TenantTag::of("t"),
    };
    assert_eq!(
        sled.consume(&live).await.unwrap(),
        stateseal::internals::ledger::Consumed::Now
    );
    assert_eq!(sled.records(), 4);
    assert_eq!(sled.remove_expired(now + 31, 100).await.unwrap(), 3);
    assert_eq!(sled.records(), 1, "each record counted down once");
    let stats = sled.flush_stats().unwrap();
    assert_eq!(
        stats
            .top_tenant_records
            .load(std::sync::atomic::Ordering::Relaxed),
        1,
        "and its tenant's count too"
    );
}

/// Issue 58, finding 5: collection judges a reservation's lease by the
/// ledger's clock, which granted it, not by the wall clock that sets the
/// horizon. With the wall clock far ahead, a lease that ended a moment ago
/// (less than the skew) is not collected, and its holder's late Commit
/// lands although nobody took the token over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_ahead_does_not_collect_a_lease_early() {
    use stateseal::internals::binding::Tenant;
    use stateseal::internals::clock::Clock;
    use stateseal::internals::sealer::Sealer;

    let dir = tempfile::tempdir().unwrap();
    let (keys, clock, limits) = manual_time();
    let sled = Arc::new(
        crate::common::open_sled_again(&dir.path().join("ledger"))
            .with_clock(clock.clone())
            .with_lease_collection_margin(5),
    );
    let s = Sealer::new(keys, sled.clone(), clock.clone(), limits);
    let tenant = Tenant::new("t");
    let reservation = reserve_fresh(&s, &tenant).await.unwrap();
    // The lease ended 2 s ago by the ledger's clock (within the skew); the
    // wall clock runs 1000 s ahead and sets the horizon from it.
    clock.advance(2 + 2);
    let removed = sled
        .remove_expired(clock.now_unix() + 1000 - 5, 100)
        .await
        .unwrap();
    assert_eq!(
        removed, 0,
        "a lease collected before the skew had passed by its own clock"
    );
    s.commit(&tenant, &reservation, &mut Default::default())
        .await
        .unwrap();
    // Once the skew has passed by the ledger's clock, an ended lease nobody
    // committed is collected as before.
    reserve_fresh(&s, &tenant).await.unwrap();
    clock.advance(2 + 5 + 1);
    let removed = sled
        .remove_expired(clock.now_unix() + 1000 - 5, 100)
        .await
        .unwrap();
    assert_eq!(removed, 1);
}

/// Issue 58, finding 2: by default the record bound is divided among the
/// tenants in force, so no two tenants can take the whole of it. With
/// `--max-ledger-records 60` and three bearer tenants, a and b each consume
/// what they can (20 each, their share), and c, which consumed nothing,
/// still has its 20. The share follows the tenants file: the third tenant
/// arrives by a reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_share_divides_the_bound_among_the_tenants() {
    use sha2::{Digest, Sha256};
    let dir = tempfile::tempdir().unwrap();
    let entry = |name: &str| {
        format!(
            r#"{{"name":"{name}","bearer_sha256":"{}"}}"#,
            hex(&Sha256::digest(format!("secret-{name}").as_bytes()))
        )
    };
    let tenants = dir.path().join("tenants.json");
    let write = |names: &[&str]| {
        let entries: Vec<String> = names.iter().map(|n| entry(n)).collect();
        let tmp = dir.path().join("tenants.tmp");
        std::fs::write(&tmp, format!(r#"{{"tenants":[{}]}}"#, entries.join(","))).unwrap();
        std::fs::rename(&tmp, &tenants).unwrap();
    };
    // Two tenants at the start (30 each); the third arrives by a reload.
    write(&["a", "b"]);
    let s = crate::common::process::spawn(
        &dir.path().join("data"),
        &[
            "--auth",
            "bearer",
            "--tenants",
            tenants.to_str().unwrap(),
            "--max-ledger-records",
            "60",
            "--reload-interval-ms",
            "100",
        ],
        &[],
    );
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", s.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let as_tenant = |name: &'static str| {
        stateseal::proto::request_state_client::RequestStateClient::with_interceptor(
            ch.clone(),
            move |mut req: tonic::Request<()>| {
                req.metadata_mut().insert(
                    "authorization",
                    format!("Bearer secret-{name}").parse().unwrap(),
                );
                Ok(req)
            },
        )
    };
    // Consumes up to `n` fresh single-use tokens; how many were accepted.
    async fn consume(
        c: &mut stateseal::proto::request_state_client::RequestStateClient<
            tonic::service::interceptor::InterceptedService<
                tonic::transport::Channel,
                impl tonic::service::Interceptor,
            >,
        >,
        n: usize,
    ) -> usize {
        let mut accepted = 0;
        for _ in 0..n {
            let t = c
                .seal(seal_req(b"s", true))
                .await
                .unwrap()
                .into_inner()
                .request_state;
            match c.open(open_req(&t)).await {
                Ok(_) => accepted += 1,
                Err(e) => assert_eq!(reason(&e), "OVERLOADED"),
            }
        }
        accepted
    }
    write(&["a", "b", "c"]);
    s.wait_logged("reloaded");
    assert_eq!(consume(&mut as_tenant("a"), 30).await, 20);
    assert_eq!(consume(&mut as_tenant("b"), 30).await, 20);
    assert_eq!(
        consume(&mut as_tenant("c"), 20).await,
        20,
        "a tenant that consumed nothing was crowded out"
    );
    let (status, _) = s.terminate();
    assert!(status.success());
}
