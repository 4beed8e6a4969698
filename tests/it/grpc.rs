//! The service end to end: a real gRPC client over 127.0.0.1, a real sled
//! directory, an injected clock.
#![allow(clippy::unwrap_used)]

use crate::common::*;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use sha2::{Digest, Sha256};
use stateseal::internals::sealer::Limits;
use stateseal::proto::{binding::Params, Binding, OpenRequest, SealRequest};
use tonic::Code;

#[tokio::test]
async fn round_trip_returns_the_state_and_metadata() {
    let mut s = start().await;
    let sealed = s
        .client
        .seal(seal_req(b"cart=42", false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(sealed.expires_at_unix, (T0 + 600) as i64);
    assert_eq!(sealed.key_id, "1");
    assert_eq!(
        sealed.request_state.len(),
        stateseal::internals::token::encoded_len(49 + 7)
    );
    let opened = s
        .client
        .open(open_req(&sealed.request_state))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(opened.state, b"cart=42");
    assert_eq!(opened.expires_at_unix, sealed.expires_at_unix);
    assert_eq!(opened.key_id, "1");
    assert!(!opened.consumed);
    s.stop().await;
}

#[tokio::test]
async fn the_token_reveals_nothing_of_the_state() {
    let mut s = start().await;
    let state = b"SECRET-STATE-SECRET-STATE-SECRET-STATE";
    let t = s
        .client
        .seal(seal_req(state, false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let raw = URL_SAFE_NO_PAD.decode(&t).unwrap();
    assert!(!raw.windows(6).any(|w| state.windows(6).any(|s| s == w)));
    // Two seals of the same state differ (random nonce).
    let t2 = s
        .client
        .seal(seal_req(state, false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert_ne!(t, t2);
    s.stop().await;
}

#[tokio::test]
async fn every_single_byte_change_is_rejected() {
    let mut s = start().await;
    let t = s
        .client
        .seal(seal_req(b"state bytes", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let raw = URL_SAFE_NO_PAD.decode(&t).unwrap();
    for i in 0..raw.len() {
        for flip in [0x01u8, 0x80] {
            let mut m = raw.clone();
            m[i] ^= flip;
            let err = s
                .client
                .open(open_req(&URL_SAFE_NO_PAD.encode(&m)))
                .await
                .unwrap_err();
            let r = reason(&err);
            assert!(
                ["REJECTED", "UNKNOWN_KEY", "MALFORMED"].contains(&r.as_str()),
                "byte {i} flip {flip:#x}: {r}"
            );
        }
    }
    // Truncated by one byte, extended by one byte.
    for m in [
        raw[..raw.len() - 1].to_vec(),
        [raw.clone(), vec![0]].concat(),
    ] {
        let err = s
            .client
            .open(open_req(&URL_SAFE_NO_PAD.encode(&m)))
            .await
            .unwrap_err();
        assert_eq!(reason(&err), "REJECTED");
    }
    // None of that burned the single-use token.
    let ok = s.client.open(open_req(&t)).await.unwrap().into_inner();
    assert!(ok.consumed);
    s.stop().await;
}

#[tokio::test]
async fn wrong_subject_method_or_params_is_rejected_and_does_not_burn() {
    let mut s = start().await;
    let t = s
        .client
        .seal(seal_req(b"x", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let params = r#"{"name":"transfer","arguments":{"amount":42}}"#;
    let wrong = [
        binding("mallory", "tools/call", params),
        binding("alice", "prompts/get", params),
        binding(
            "alice",
            "tools/call",
            r#"{"name":"transfer","arguments":{"amount":43}}"#,
        ),
        binding(
            "alice",
            "tools/call",
            r#"{"name":"transfer","arguments":{"amount":42,"to":"x"}}"#,
        ),
    ];
    for b in wrong {
        let err = s
            .client
            .open(OpenRequest {
                request_state: t.clone(),
                binding: Some(b),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(reason(&err), "REJECTED");
        assert_eq!(err.code(), Code::PermissionDenied);
    }
    // The same params with other key order, whitespace and round-trip members open.
    let same = binding(
        "alice",
        "tools/call",
        r#"{ "arguments": {"amount": 42.0}, "name": "transfer", "requestState": "t",
             "inputResponses": {"confirm": {"action": "accept"}}, "_meta": {"x": 1} }"#,
    );
    let ok = s
        .client
        .open(OpenRequest {
            request_state: t,
            binding: Some(same),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ok.consumed);
    s.stop().await;
}

#[tokio::test]
async fn a_caller_digest_and_params_json_bind_the_same() {
    let mut s = start().await;
    let params = r#"{"name":"transfer","arguments":{"amount":42}}"#;
    let canonical = stateseal::internals::binding::canonical_json(params).unwrap();
    let digest = Sha256::digest(&canonical).to_vec();
    let by_digest = Binding {
        subject: "alice".into(),
        method: "tools/call".into(),
        params: Some(Params::ParamsDigest(digest)),
        binding_version: 0,
    };
    let t = s
        .client
        .seal(SealRequest {
            binding: Some(by_digest),
            state: b"s".to_vec(),
            ttl_seconds: 0,
            single_use: false,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .request_state;
    s.client.open(open_req(&t)).await.unwrap();
    s.stop().await;
}

#[tokio::test]
async fn expired_tokens_are_rejected_at_expiry() {
    let mut s = start().await;
    let req = SealRequest {
        ttl_seconds: 30,
        ..seal_req(b"x", false)
    };
    let t = s.client.seal(req).await.unwrap().into_inner().request_state;
    s.clock.advance(29);
    s.client.open(open_req(&t)).await.unwrap();
    s.clock.advance(1);
    let err = s.client.open(open_req(&t)).await.unwrap_err();
    assert_eq!(reason(&err), "EXPIRED");
    assert_eq!(err.code(), Code::FailedPrecondition);
    s.stop().await;
}

#[tokio::test]
async fn ttl_above_the_maximum_is_an_error_not_cut() {
    let mut s = start().await;
    let req = SealRequest {
        ttl_seconds: 3601,
        ..seal_req(b"x", false)
    };
    assert_eq!(reason(&s.client.seal(req).await.unwrap_err()), "TOO_LARGE");
    let req = SealRequest {
        ttl_seconds: 3600,
        ..seal_req(b"x", false)
    };
    assert_eq!(
        s.client
            .seal(req)
            .await
            .unwrap()
            .into_inner()
            .expires_at_unix,
        (T0 + 3600) as i64
    );
    s.stop().await;
}

#[tokio::test]
async fn a_reusable_token_opens_many_times() {
    let mut s = start().await;
    let t = s
        .client
        .seal(seal_req(b"x", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    for _ in 0..20 {
        let o = s.client.open(open_req(&t)).await.unwrap().into_inner();
        assert!(!o.consumed);
    }
    s.stop().await;
}

#[tokio::test]
async fn single_use_opens_once_then_replayed() {
    let mut s = start().await;
    let t = s
        .client
        .seal(seal_req(b"x", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert!(
        s.client
            .open(open_req(&t))
            .await
            .unwrap()
            .into_inner()
            .consumed
    );
    let err = s.client.open(open_req(&t)).await.unwrap_err();
    assert_eq!(reason(&err), "REPLAYED");
    assert_eq!(err.code(), Code::AlreadyExists);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_opens_of_one_single_use_token_give_one_success() {
    let mut s = start().await;
    for round in 0..5 {
        let t = s
            .client
            .seal(seal_req(b"x", true))
            .await
            .unwrap()
            .into_inner()
            .request_state;
        let mut tasks = Vec::new();
        for _ in 0..64 {
            let mut c = s.client.clone();
            let t = t.clone();
            tasks.push(tokio::spawn(async move { c.open(open_req(&t)).await }));
        }
        let mut ok = 0;
        for task in tasks {
            match task.await.unwrap() {
                Ok(r) => {
                    assert!(r.into_inner().consumed);
                    ok += 1;
                }
                Err(e) => assert_eq!(reason(&e), "REPLAYED"),
            }
        }
        assert_eq!(ok, 1, "round {round}");
    }
    // Group commit: fewer flushes than consumptions is the point, but one is
    // enough to prove a flush happened before the answer.
    assert!(
        s.ledger
            .stats()
            .flushes
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_consumptions_share_flushes() {
    let mut s = start().await;
    let tokens = seal_tokens(&mut s.client, 256, true).await;
    let before = s
        .ledger
        .stats()
        .flushes
        .load(std::sync::atomic::Ordering::Relaxed);
    let tasks: Vec<_> = tokens
        .into_iter()
        .map(|t| {
            let mut c = s.client.clone();
            tokio::spawn(async move { c.open(open_req(&t)).await.map(|r| r.into_inner().consumed) })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap().unwrap());
    }
    let flushes = s
        .ledger
        .stats()
        .flushes
        .load(std::sync::atomic::Ordering::Relaxed)
        - before;
    assert!(
        flushes < 256,
        "256 consumptions took {flushes} flushes: no group commit"
    );
    assert!(
        s.ledger
            .stats()
            .max_batch
            .load(std::sync::atomic::Ordering::Relaxed)
            > 1
    );
    s.stop().await;
}

#[tokio::test]
async fn a_consumed_token_stays_consumed_after_restart_on_the_same_dir() {
    let s = start().await;
    let keyset = stateseal::internals::keyring::KeysetFile::generate(T0);
    let dir = s.stop().await;
    let mut s = TestServer::builder()
        .dir(dir)
        .keyset(keyset.clone())
        .start()
        .await;
    let t = s
        .client
        .seal(seal_req(b"x", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    s.client.open(open_req(&t)).await.unwrap();
    let dir = s.stop().await;
    let mut s = TestServer::builder().dir(dir).keyset(keyset).start().await;
    assert_eq!(
        reason(&s.client.open(open_req(&t)).await.unwrap_err()),
        "REPLAYED"
    );
    s.stop().await;
}

#[tokio::test]
async fn garbage_truncated_and_oversized_inputs_get_the_documented_reasons() {
    let limits = Limits {
        max_state: 1024,
        max_params_json: 4096,
        ..Limits::default()
    };
    let mut s = TestServer::builder().limits(limits).start().await;
    let t = s
        .client
        .seal(seal_req(b"0123456789", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let raw = URL_SAFE_NO_PAD.decode(&t).unwrap();
    let cases: Vec<(String, &str)> = vec![
        (String::new(), "MALFORMED"),
        ("!!!!".into(), "MALFORMED"),
        ("not a token at all".into(), "MALFORMED"),
        (format!("{t}="), "MALFORMED"),
        (t.replace('A', "+"), "MALFORMED"),
        (t[..20].to_string(), "MALFORMED"),
        (URL_SAFE_NO_PAD.encode(&raw[..raw.len() - 3]), "REJECTED"),
        (URL_SAFE_NO_PAD.encode(&raw[..48]), "MALFORMED"),
        // Longer than a token with the largest state and manifest.
        (
            "A".repeat(
                stateseal::internals::token::encoded_len(
                    49 + stateseal::internals::token::MANIFEST_ROOM + 1024,
                ) + 4,
            ),
            "TOO_LARGE",
        ),
        // A version-1 header (no manifest) may not use the manifest's room.
        (
            URL_SAFE_NO_PAD.encode([[0x10u8, 0, 0, 0, 1].as_slice(), &[0u8; 49 + 1025]].concat()),
            "TOO_LARGE",
        ),
        (URL_SAFE_NO_PAD.encode([0x30u8; 60]), "MALFORMED"),
        (
            URL_SAFE_NO_PAD.encode([[0x10u8, 0, 0, 0, 9].as_slice(), &[0u8; 60]].concat()),
            "UNKNOWN_KEY",
        ),
    ];
    for (token, want) in cases {
        if token == t.replace('A', "+") && !t.contains('A') {
            continue;
        }
        let err = s.client.open(open_req(&token)).await.unwrap_err();
        assert_eq!(
            reason(&err),
            want,
            "token {:?}",
            &token[..token.len().min(24)]
        );
    }
    // Oversized state, params, subject; bad method; missing pieces.
    let big_state = SealRequest {
        state: vec![0; 1025],
        ..seal_req(b"", false)
    };
    assert_eq!(
        reason(&s.client.seal(big_state).await.unwrap_err()),
        "TOO_LARGE"
    );
    let big_params = SealRequest {
        binding: Some(binding(
            "alice",
            "tools/call",
            &format!("{{\"a\":\"{}\"}}", "x".repeat(5000)),
        )),
        ..seal_req(b"", false)
    };
    assert_eq!(
        reason(&s.client.seal(big_params).await.unwrap_err()),
        "TOO_LARGE"
    );
    let long_subject = SealRequest {
        binding: Some(binding(&"s".repeat(1025), "tools/call", "{}")),
        ..seal_req(b"", false)
    };
    assert_eq!(
        reason(&s.client.seal(long_subject).await.unwrap_err()),
        "TOO_LARGE"
    );
    let bad_method = SealRequest {
        binding: Some(binding("alice", "tools/list", "{}")),
        ..seal_req(b"", false)
    };
    let err = s.client.seal(bad_method).await.unwrap_err();
    assert_eq!(
        (reason(&err).as_str(), err.code()),
        ("BAD_METHOD", Code::InvalidArgument)
    );
    for b in [
        None,
        Some(Binding {
            subject: "alice".into(),
            method: "tools/call".into(),
            params: None,
            binding_version: 0,
        }),
        Some(binding("", "tools/call", "{}")),
        Some(binding("alice", "tools/call", "[1,2]")),
        Some(binding("alice", "tools/call", r#"{"a":1,"a":2}"#)),
        Some(binding("alice", "tools/call", "{")),
        Some(Binding {
            subject: "alice".into(),
            method: "tools/call".into(),
            params: Some(Params::ParamsDigest(vec![0; 31])),
            binding_version: 0,
        }),
    ] {
        let req = SealRequest {
            binding: b,
            ..seal_req(b"", false)
        };
        assert_eq!(reason(&s.client.seal(req).await.unwrap_err()), "MALFORMED");
    }
    // Deep nesting is refused, not a stack overflow.
    let deep = format!("{{\"a\":{}{}}}", "[".repeat(2000), "]".repeat(2000));
    let req = SealRequest {
        binding: Some(binding("alice", "tools/call", &deep)),
        ..seal_req(b"", false)
    };
    assert_eq!(reason(&s.client.seal(req).await.unwrap_err()), "MALFORMED");
    // A message past the transport limit is refused by the transport.
    let huge = SealRequest {
        state: vec![0; 8 << 20],
        ..seal_req(b"", false)
    };
    assert_eq!(
        s.client.seal(huge).await.unwrap_err().code(),
        Code::OutOfRange
    );
    // And the server still serves.
    s.client.open(open_req(&t)).await.unwrap();
    s.stop().await;
}

#[tokio::test]
async fn health_and_reflection_are_served() {
    let s = start().await;
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", s.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch);
    for service in ["", "stateseal.v1.RequestState"] {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    }
    s.stop().await;
}

/// Binding v2 end to end: a transfer of 2^53+1 sealed, the retry with 2^53
/// refused; extra top-level members and absent/null arguments do not matter;
/// a token sealed under binding v1 (a caller's v1 digest) still opens with
/// params_json, because the token's header says which binding to compute.
#[tokio::test]
async fn binding_v2_is_exact_and_v1_tokens_still_open() {
    let mut s = start().await;
    let seal = |params: &str| SealRequest {
        binding: Some(binding("alice", "tools/call", params)),
        ..seal_req(b"s", false)
    };
    let open = |t: &str, params: &str| OpenRequest {
        request_state: t.into(),
        binding: Some(binding("alice", "tools/call", params)),
        ..Default::default()
    };
    let big = r#"{"name":"transfer","arguments":{"amount":9007199254740993}}"#;
    let t = s
        .client
        .seal(seal(big))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let err = s
        .client
        .open(open(
            &t,
            r#"{"name":"transfer","arguments":{"amount":9007199254740992}}"#,
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "REJECTED");
    s.client
        .open(open(
            &t,
            r#"{"arguments":{"amount":9007199254740993},"name":"transfer","task":{"ttl":5},"_meta":{}}"#,
        ))
        .await
        .unwrap();
    let t = s
        .client
        .seal(seal(r#"{"name":"t"}"#))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    for p in [
        r#"{"name":"t","arguments":null}"#,
        r#"{"name":"t","arguments":{}}"#,
    ] {
        s.client.open(open(&t, p)).await.unwrap();
    }
    // Beyond the double range: sealable (v1 refused it as MALFORMED).
    let t = s
        .client
        .seal(seal(r#"{"name":"t","arguments":{"n":1e400}}"#))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert_eq!(
        reason(
            &s.client
                .open(open(&t, r#"{"name":"t","arguments":{"n":1e401}}"#))
                .await
                .unwrap_err()
        ),
        "REJECTED"
    );

    // A v1 token: sealed by a caller's v1 digest (binding_version 0).
    let params = r#"{"name":"transfer","arguments":{"amount":42},"x":1}"#;
    let v1 = stateseal::internals::binding::params_digest(params).unwrap();
    let t = s
        .client
        .seal(SealRequest {
            binding: Some(Binding {
                subject: "alice".into(),
                method: "tools/call".into(),
                params: Some(Params::ParamsDigest(v1.0.to_vec())),
                binding_version: 0,
            }),
            ..seal_req(b"s", false)
        })
        .await
        .unwrap()
        .into_inner()
        .request_state;
    s.client.open(open(&t, params)).await.unwrap();
    // Under v1 the whole params are bound: another extra member is refused.
    let err = s
        .client
        .open(open(
            &t,
            r#"{"name":"transfer","arguments":{"amount":42},"x":2}"#,
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "REJECTED");
    // An unknown binding version is malformed.
    let err = s
        .client
        .seal(SealRequest {
            binding: Some(Binding {
                subject: "alice".into(),
                method: "tools/call".into(),
                params: Some(Params::ParamsDigest(vec![0; 32])),
                binding_version: 3,
            }),
            ..seal_req(b"s", false)
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "MALFORMED");
    s.stop().await;
}

/// Two-phase consumption through the service: reserve → IN_USE for others →
/// release → reserve again → commit → REPLAYED; a lease that ends (injected
/// clock) → LEASE_EXPIRED and the next attempt takes over; reusable tokens
/// ignore the mode; a forged reservation is refused.
#[tokio::test]
async fn reserve_commit_release_through_the_service() {
    use stateseal::internals::clock::Clock;
    use stateseal::proto::{CommitRequest, OpenMode, ReleaseRequest, RenewRequest};
    let mut s = start().await;
    let reserve = |t: &str, lease: u32| OpenRequest {
        mode: OpenMode::Reserve as i32,
        lease_seconds: lease,
        ..open_req(t)
    };
    let t = s
        .client
        .seal(seal_req(b"st", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let r1 = s.client.open(reserve(&t, 0)).await.unwrap().into_inner();
    assert!(!r1.consumed);
    assert_eq!(r1.state, b"st");
    assert_eq!(r1.lease_expires_at_unix, T0 + 30, "default lease");
    assert!(!r1.reservation.is_empty());
    assert!(
        !r1.reservation.contains(&t[..20]),
        "reveals nothing of the token"
    );
    assert_eq!(
        reason(&s.client.open(reserve(&t, 0)).await.unwrap_err()),
        "IN_USE"
    );
    let in_use = s.client.open(open_req(&t)).await.unwrap_err();
    assert_eq!(reason(&in_use), "IN_USE");
    assert_eq!(in_use.code(), tonic::Code::Aborted);
    s.client
        .release(ReleaseRequest {
            reservation: r1.reservation.clone(),
        })
        .await
        .unwrap();
    let r2 = s
        .client
        .open(reserve(&t, 10_000))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r2.lease_expires_at_unix,
        T0 + 300,
        "capped at the maximum lease"
    );
    let lost = s
        .client
        .commit(CommitRequest {
            reservation: r1.reservation,
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&lost), "LEASE_EXPIRED");
    s.client
        .commit(CommitRequest {
            reservation: r2.reservation.clone(),
        })
        .await
        .unwrap();
    assert_eq!(
        reason(&s.client.open(reserve(&t, 0)).await.unwrap_err()),
        "REPLAYED"
    );
    assert_eq!(
        reason(&s.client.open(open_req(&t)).await.unwrap_err()),
        "REPLAYED"
    );

    // A lease that ends before the commit, and nobody took the token over:
    // the commit still counts (the handler ran once).
    let t = s
        .client
        .seal(seal_req(b"x", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let r = s.client.open(reserve(&t, 5)).await.unwrap().into_inner();
    assert_eq!(r.lease_seconds, 5);
    s.clock.advance(6);
    s.client
        .commit(CommitRequest {
            reservation: r.reservation,
        })
        .await
        .unwrap();
    assert_eq!(
        reason(&s.client.open(reserve(&t, 5)).await.unwrap_err()),
        "REPLAYED"
    );

    // A lease that ended and was taken over: the late holder's commit and
    // renewal are refused (LEASE_EXPIRED), the taker's commit counts.
    let t = s
        .client
        .seal(seal_req(b"x", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let late = s.client.open(reserve(&t, 5)).await.unwrap().into_inner();
    s.clock.advance(6);
    let again = s.client.open(reserve(&t, 5)).await.unwrap().into_inner();
    for err in [
        s.client
            .commit(CommitRequest {
                reservation: late.reservation.clone(),
            })
            .await
            .unwrap_err(),
        s.client
            .renew(RenewRequest {
                reservation: late.reservation.clone(),
                lease_seconds: 0,
            })
            .await
            .unwrap_err(),
    ] {
        assert_eq!(reason(&err), "LEASE_EXPIRED");
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    }
    s.client
        .commit(CommitRequest {
            reservation: again.reservation.clone(),
        })
        .await
        .unwrap();

    // Renewed while its handler runs: never taken over.
    let t = s
        .client
        .seal(seal_req(b"x", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let held = s.client.open(reserve(&t, 5)).await.unwrap().into_inner();
    for _ in 0..4 {
        s.clock.advance(4);
        let r = s
            .client
            .renew(RenewRequest {
                reservation: held.reservation.clone(),
                lease_seconds: 5,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.lease_seconds, 5);
        assert_eq!(r.lease_expires_at_unix, s.clock.now_unix() + 5);
        assert_eq!(
            reason(&s.client.open(reserve(&t, 5)).await.unwrap_err()),
            "IN_USE"
        );
    }
    s.client
        .commit(CommitRequest {
            reservation: held.reservation,
        })
        .await
        .unwrap();

    // Forged or damaged reservations.
    let mut raw = again.reservation.into_bytes();
    raw[40] = if raw[40] == b'A' { b'B' } else { b'A' };
    let err = s
        .client
        .commit(CommitRequest {
            reservation: String::from_utf8(raw).unwrap(),
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "REJECTED");
    for bad in ["", "garbage", &t] {
        let err = s
            .client
            .commit(CommitRequest {
                reservation: bad.to_string(),
            })
            .await
            .unwrap_err();
        assert_eq!(reason(&err), "MALFORMED", "{bad:?}");
    }

    // Reusable tokens ignore the mode.
    let t = s
        .client
        .seal(seal_req(b"r", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    for _ in 0..2 {
        let o = s.client.open(reserve(&t, 0)).await.unwrap().into_inner();
        assert!(o.reservation.is_empty() && !o.consumed);
    }
    s.stop().await;
}

/// Commits carried by an Open (`OpenRequest.commit`): each is decided as
/// Commit would decide it, with its outcome in `OpenResponse.commits` in
/// order, whatever the Open's own outcome; a committed reservation's token
/// is REPLAYED, not IN_USE; more than 16, or more than 16 reservations'
/// length, refuse the whole call and commit none; a carried commit repeats
/// as a plain Commit (idempotent), and one named twice is decided once.
#[tokio::test]
async fn an_open_carries_commits_and_answers_each() {
    use stateseal::proto::{CommitRequest, OpenMode, ReleaseRequest};
    let mut s = start().await;
    let mut sealed = Vec::new();
    for _ in 0..6 {
        sealed.push(
            s.client
                .seal(seal_req(b"st", true))
                .await
                .unwrap()
                .into_inner()
                .request_state,
        );
    }
    let reserve = |t: &str, commit: Vec<String>| OpenRequest {
        mode: OpenMode::Reserve as i32,
        lease_seconds: 5,
        commit: commit.join(","),
        ..open_req(t)
    };
    let mut held = Vec::new();
    for t in &sealed[..4] {
        held.push(
            s.client
                .open(reserve(t, Vec::new()))
                .await
                .unwrap()
                .into_inner()
                .reservation,
        );
    }
    // held[2] released: gone. held[3] taken over after its lease ended.
    s.client
        .release(ReleaseRequest {
            reservation: held[2].clone(),
        })
        .await
        .unwrap();
    s.clock.advance(6);
    let taker = s
        .client
        .open(reserve(&sealed[3], Vec::new()))
        .await
        .unwrap()
        .into_inner();

    // One Open (reserving sealed[4]) carries five: two held (one past its
    // lease, still untaken), the released one, the one taken over, and
    // garbage.
    let carried = vec![
        held[0].clone(),
        held[1].clone(),
        held[2].clone(),
        held[3].clone(),
        "garbage".to_string(),
    ];
    let o = s
        .client
        .open(reserve(&sealed[4], carried))
        .await
        .unwrap()
        .into_inner();
    assert!(!o.reservation.is_empty(), "the Open itself reserved");
    let outcomes: Vec<(&str, i32)> = o
        .commits
        .iter()
        .map(|c| (c.reason.as_str(), c.code))
        .collect();
    let expired = tonic::Code::FailedPrecondition as i32;
    assert_eq!(
        outcomes,
        [
            ("", 0),
            ("", 0),
            ("LEASE_EXPIRED", expired),
            ("LEASE_EXPIRED", expired),
            ("MALFORMED", tonic::Code::InvalidArgument as i32),
        ]
    );
    for t in &sealed[..2] {
        let err = s.client.open(reserve(t, Vec::new())).await.unwrap_err();
        assert_eq!(reason(&err), "REPLAYED", "committed by the carried commit");
    }
    // Idempotent: the same reservation committed again, plainly or carried.
    s.client
        .commit(CommitRequest {
            reservation: held[0].clone(),
        })
        .await
        .unwrap();

    // A refused Open still decides what it carries: the taker's commit
    // lands although the token it carries it on is garbage.
    let mut bad = reserve("garbage", vec![taker.reservation.clone(), held[1].clone()]);
    bad.request_state = "garbage".into();
    let err = s.client.open(bad).await.unwrap_err();
    assert_eq!(reason(&err), "MALFORMED");
    let err = s
        .client
        .open(reserve(&sealed[3], Vec::new()))
        .await
        .unwrap_err();
    assert_eq!(
        reason(&err),
        "REPLAYED",
        "the refused Open's carried commit"
    );

    // More than 16: the whole call is TOO_LARGE, nothing is committed, and
    // the Open itself does not reserve.
    let r5 = s
        .client
        .open(reserve(&sealed[5], Vec::new()))
        .await
        .unwrap()
        .into_inner()
        .reservation;
    let mut many = vec![r5.clone()];
    many.extend((0..16).map(|i| format!("filler-{i}")));
    let err = s.client.open(reserve(&sealed[4], many)).await.unwrap_err();
    assert_eq!(reason(&err), "TOO_LARGE");
    let err = s
        .client
        .open(OpenRequest {
            attempt_id: "another".into(),
            ..reserve(&sealed[5], Vec::new())
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "IN_USE", "r5 still only reserved");
    // Sixteen is allowed; an Open of a reusable token carries them too.
    // Past the length of 16 reservations, however few: TOO_LARGE.
    let long = vec![r5.clone(), "x".repeat(16 * r5.len())];
    let err = s.client.open(reserve(&sealed[4], long)).await.unwrap_err();
    assert_eq!(reason(&err), "TOO_LARGE");
    // Sixteen of a reservation's length: the longest string allowed.
    let mut sixteen = vec![r5.clone()];
    sixteen.extend((0..14).map(|i| format!("{i:x<width$}", width = r5.len())));
    // Named twice: decided once (a second decision would be the same).
    sixteen.push(r5.clone());
    assert_eq!(sixteen.join(",").len(), 16 * (r5.len() + 1) - 1);
    let reusable = s
        .client
        .seal(seal_req(b"r", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let o = s
        .client
        .open(OpenRequest {
            commit: sixteen.join(","),
            ..open_req(&reusable)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(o.commits.len(), 16);
    assert_eq!(o.commits[0].reason, "");
    assert!(o.commits[1..15].iter().all(|c| c.reason == "MALFORMED"));
    assert_eq!(o.commits[15].reason, "", "the same reservation again");
    let err = s
        .client
        .open(reserve(&sealed[5], Vec::new()))
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "REPLAYED");
    s.stop().await;
}

/// A relay on 127.0.0.1 to `target` that forwards the client's bytes, and the
/// server's only until `drop` is set; after that the server's answers are
/// lost (a response lost on the way back, as a timeout or a cut connection
/// would lose it).
async fn response_dropping_relay(
    target: std::net::SocketAddr,
    drop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = l.accept().await {
            let server = tokio::net::TcpStream::connect(target).await.unwrap();
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut cr, &mut sw).await;
            });
            let drop = drop.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                // While dropping: the server's frames, parsed until the
                // first HEADERS frame of a stream (the answer), then the
                // connection to the client is cut.
                let mut held: Vec<u8> = Vec::new();
                while let Ok(n) = sr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if !drop.load(std::sync::atomic::Ordering::SeqCst) {
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        continue;
                    }
                    held.extend_from_slice(&buf[..n]);
                    let mut at = 0;
                    let mut answered = false;
                    while held.len() >= at + 9 {
                        let len = (usize::from(held[at]) << 16)
                            | (usize::from(held[at + 1]) << 8)
                            | usize::from(held[at + 2]);
                        let kind = held[at + 3];
                        let stream = u32::from_be_bytes([
                            held[at + 5],
                            held[at + 6],
                            held[at + 7],
                            held[at + 8],
                        ]) & 0x7fff_ffff;
                        if kind == 1 && stream != 0 {
                            answered = true;
                            break;
                        }
                        if held.len() < at + 9 + len {
                            break;
                        }
                        at += 9 + len;
                    }
                    held.drain(..at);
                    if answered {
                        break; // drops `cw`: the client sees the connection cut
                    }
                }
            });
        }
    });
    addr
}

/// Attempt ids: an Open whose answer is lost after the ledger recorded the
/// consumption (the connection is cut as the answer arrives, so the server
/// has decided by then, however slow the machine) is retried safely by the
/// same attempt (the same success), while another attempt gets REPLAYED;
/// the same for a reservation. An attempt ends with its Commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_retried_safely_with_the_same_attempt_id() {
    use stateseal::proto::{CommitRequest, OpenMode};
    let mut s = start().await;
    let drop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let relay = response_dropping_relay(s.addr, drop.clone()).await;
    let mut via_relay = connect(relay).await;
    let with_attempt = |t: &str, a: &str, mode: OpenMode| OpenRequest {
        attempt_id: a.into(),
        mode: mode as i32,
        ..open_req(t)
    };
    for mode in [OpenMode::Consume, OpenMode::Reserve] {
        let t = via_relay
            .seal(seal_req(b"once", true))
            .await
            .unwrap()
            .into_inner()
            .request_state;
        drop.store(true, std::sync::atomic::Ordering::SeqCst);
        // No deadline: the server must not cut the call short; the bound
        // is a liveness bound only.
        let lost = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            via_relay.open(with_attempt(&t, "mcp-request-17", mode)),
        )
        .await
        .expect("the relay cuts the connection when the answer arrives")
        .unwrap_err();
        assert!(
            matches!(
                lost.code(),
                tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown
            ),
            "{lost:?}"
        );
        // The server did record it: another attempt is refused …
        let other = s
            .client
            .open(with_attempt(&t, "mcp-request-99", mode))
            .await
            .unwrap_err();
        let want = if mode == OpenMode::Consume {
            "REPLAYED"
        } else {
            "IN_USE"
        };
        assert_eq!(reason(&other), want);
        // … and the same attempt, retried, gets the same success.
        let again = s
            .client
            .open(with_attempt(&t, "mcp-request-17", mode))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(again.state, b"once");
        if mode == OpenMode::Consume {
            assert!(again.consumed);
        } else {
            s.client
                .commit(CommitRequest {
                    reservation: again.reservation,
                })
                .await
                .unwrap();
            assert_eq!(
                reason(
                    &s.client
                        .open(with_attempt(&t, "mcp-request-17", mode))
                        .await
                        .unwrap_err()
                ),
                "REPLAYED",
                "after the commit the attempt is over"
            );
            let consume = s
                .client
                .open(with_attempt(&t, "mcp-request-17", OpenMode::Consume))
                .await
                .unwrap_err();
            assert_eq!(
                reason(&consume),
                "REPLAYED",
                "a plain consume by the committed attempt's id is REPLAYED too"
            );
        }
        drop.store(false, std::sync::atomic::Ordering::SeqCst);
        via_relay = connect(relay).await;
    }
    // Attempt ids are bounded.
    let t = s
        .client
        .seal(seal_req(b"x", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    let err = s
        .client
        .open(with_attempt(&t, &"a".repeat(129), OpenMode::Consume))
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "TOO_LARGE");
    s.stop().await;
}
