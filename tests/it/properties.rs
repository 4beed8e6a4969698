//! Property tests (proptest) of the token and the params digest: round trips
//! for arbitrary inputs, every kind of mutation rejected, arbitrary bytes
//! never open, and the digest invariant under key order and whitespace.
//! Case counts scale with PROPTEST_CASES (the documented long run uses 100000).
#![allow(clippy::unwrap_used)]

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use proptest::prelude::*;
use stateseal::internals::binding::{params_digest, Binding, Method, ParamsDigest, Tenant};
use stateseal::internals::keyring::{KeyId, Keyring, KeysetFile, TenantKeys};
use stateseal::internals::token::{self, Header, UntrustedToken};
use std::sync::{Arc, OnceLock};

fn ring() -> &'static Keyring {
    static RING: OnceLock<Keyring> = OnceLock::new();
    RING.get_or_init(|| {
        let mut ks = KeysetFile::generate(0);
        ks.add_staged(0, None).unwrap();
        Keyring::from_file(&ks).unwrap()
    })
}

fn keys(tenant: &str) -> Arc<TenantKeys> {
    ring().primary().tenant_keys(&Tenant::new(tenant))
}

fn method() -> impl Strategy<Value = Method> {
    prop_oneof![
        Just(Method::ToolsCall),
        Just(Method::PromptsGet),
        Just(Method::ResourcesRead)
    ]
}

fn binding() -> impl Strategy<Value = Binding> {
    ("[a-z]{1,8}", ".{1,40}", method(), any::<[u8; 32]>()).prop_map(|(t, s, m, d)| Binding {
        tenant: Tenant::new(t),
        subject: s,
        method: m,
        params: ParamsDigest(d),
        version: stateseal::internals::binding::BindingVersion::V1,
    })
}

fn sealed() -> impl Strategy<Value = (Binding, Vec<u8>, Header, String)> {
    (
        binding(),
        proptest::collection::vec(any::<u8>(), 0..512),
        any::<u32>(),
        any::<bool>(),
    )
        .prop_map(|(b, state, exp, single_use)| {
            let header = Header {
                key_id: KeyId(1),
                expires_at: exp,
                single_use,
                binding: b.version,
                manifest: false,
            };
            let t = token::seal(
                &keys(b.tenant.as_str()),
                header,
                &b,
                None,
                &state,
                token::Nonce::Fresh,
            )
            .unwrap();
            (b, state, header, t)
        })
}

fn opens(t: &str, b: &Binding) -> bool {
    match UntrustedToken::parse(t, 1 << 16) {
        Ok(u) => match ring().get(u.header().key_id) {
            Some(k) => u.open(&k.tenant_keys(&b.tenant), b).is_ok(),
            None => false,
        },
        Err(_) => false,
    }
}

proptest! {
    #[test]
    fn seal_then_open_round_trips((b, state, header, t) in sealed()) {
        let u = UntrustedToken::parse(&t, 1 << 16).unwrap();
        prop_assert_eq!(u.header(), header);
        let opened = u.open(&keys(b.tenant.as_str()), &b).unwrap();
        prop_assert_eq!(&opened.state[..], &state[..]);
        prop_assert_eq!(t.len(), token::encoded_len(token::OVERHEAD + opened_len(&t)));
    }

    #[test]
    fn any_bit_flip_is_rejected((b, _s, _h, t) in sealed(), pos in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut raw = URL_SAFE_NO_PAD.decode(&t).unwrap();
        let i = pos.index(raw.len());
        raw[i] ^= 1 << bit;
        prop_assert!(!opens(&URL_SAFE_NO_PAD.encode(&raw), &b));
    }

    #[test]
    fn truncation_and_extension_are_rejected((b, _s, _h, t) in sealed(), cut in any::<prop::sample::Index>(),
                                             extra in proptest::collection::vec(any::<u8>(), 1..64)) {
        let raw = URL_SAFE_NO_PAD.decode(&t).unwrap();
        let n = cut.index(raw.len());
        prop_assert!(!opens(&URL_SAFE_NO_PAD.encode(&raw[..n]), &b));
        prop_assert!(!opens(&URL_SAFE_NO_PAD.encode([raw.clone(), extra].concat()), &b));
        // The string form too: any prefix of the token string.
        let m = cut.index(t.len());
        prop_assert!(!opens(&t[..m], &b));
    }

    #[test]
    fn splicing_two_tokens_is_rejected((b, _s, _h, t1) in sealed(), state2 in proptest::collection::vec(any::<u8>(), 0..512),
                                       at in any::<prop::sample::Index>()) {
        let header = Header { key_id: KeyId(1), expires_at: 7, single_use: false, binding: stateseal::internals::binding::BindingVersion::V1, manifest: false };
        let t2 = token::seal(&keys(b.tenant.as_str()), header, &b, None, &state2, token::Nonce::Fresh).unwrap();
        let (r1, r2) = (URL_SAFE_NO_PAD.decode(&t1).unwrap(), URL_SAFE_NO_PAD.decode(&t2).unwrap());
        let i = at.index(r1.len().min(r2.len()));
        for spliced in [[&r1[..i], &r2[i..]].concat(), [&r2[..i], &r1[i..]].concat()] {
            if spliced != r1 && spliced != r2 {
                prop_assert!(!opens(&URL_SAFE_NO_PAD.encode(&spliced), &b));
            }
        }
    }

    #[test]
    fn another_binding_never_opens((b, _s, _h, t) in sealed(), other in binding()) {
        let same = other.tenant == b.tenant && other.subject == b.subject
            && other.method == b.method && other.params == b.params;
        prop_assume!(!same);
        prop_assert!(!opens(&t, &other));
    }

    #[test]
    fn arbitrary_strings_never_open_or_panic(s in ".{0,300}", b in binding()) {
        prop_assert!(!opens(&s, &b));
    }

    #[test]
    fn arbitrary_bytes_never_open_or_panic(raw in proptest::collection::vec(any::<u8>(), 0..400), b in binding()) {
        prop_assert!(!opens(&URL_SAFE_NO_PAD.encode(&raw), &b));
    }

    #[test]
    fn digest_ignores_key_order_and_whitespace(members in proptest::collection::btree_map("[a-zA-Z_é😀]{1,6}", json_value(), 0..8),
                                                seed in any::<u64>()) {
        let mut pairs: Vec<(String, String)> = members.iter()
            .map(|(k, v)| (serde_json::to_string(k).unwrap(), serde_json::to_string(v).unwrap()))
            .collect();
        let compact = format!("{{{}}}", pairs.iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join(","));
        // Another order and spacing, plus round-trip members that must be ignored.
        let n = pairs.len().max(1);
        pairs.rotate_left((seed as usize) % n);
        pairs.reverse();
        let mut spaced: Vec<String> = pairs.iter().map(|(k, v)| format!("\n  {k} :\t{v} ")).collect();
        spaced.push("\"_meta\": {\"progressToken\": 1}".into());
        spaced.push("\"requestState\": \"x\"".into());
        let other = format!("{{ {} }}", spaced.join(","));
        prop_assert_eq!(params_digest(&compact).unwrap(), params_digest(&other).unwrap());
    }

    /// Differential: our streaming canonicalizer against an independent RFC
    /// 8785 implementation (serde_json_canonicalizer over serde_json values).
    #[test]
    fn canonical_form_matches_an_independent_implementation(v in wide_json_value()) {
        let text = serde_json::to_string_pretty(&v).unwrap();
        let theirs = serde_json_canonicalizer::to_vec(&v).unwrap();
        let ours = stateseal::internals::binding::canonical_json(&text).unwrap();
        prop_assert_eq!(&ours, &theirs, "input {}", text);
        // Idempotent: the canonical form is its own canonical form.
        let again = stateseal::internals::binding::canonical_json(std::str::from_utf8(&ours).unwrap()).unwrap();
        prop_assert_eq!(again, ours);
    }
}

/// JSON values with numbers across the whole double range (integers past
/// 2^53, tiny and huge exponents) and strings with controls and astral
/// characters.
fn wide_json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(|n| serde_json::json!(n)),
        any::<u64>().prop_map(|n| serde_json::json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| serde_json::json!(f)),
        "[\\u{0}-\\u{1f}\"\\\\a-z\\u{7f}-\\u{10ffff}]{0,8}".prop_map(serde_json::Value::String),
    ];
    leaf.prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(serde_json::Value::Array),
            proptest::collection::btree_map("[a-zA-Z\\u{80}-\\u{10ffff}_]{0,4}", inner, 0..5)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

fn opened_len(t: &str) -> usize {
    URL_SAFE_NO_PAD.decode(t).unwrap().len() - token::OVERHEAD
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i32>().prop_map(|n| serde_json::json!(n)),
        (-1e6f64..1e6).prop_map(|f| serde_json::json!(f)),
        ".{0,12}".prop_map(serde_json::Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
            proptest::collection::btree_map("[a-z]{1,4}", inner, 0..4)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

/// The gRPC service over a real sled ledger, called through its trait as
/// tonic calls it, with the tenant the authentication layer would attach.
fn service() -> &'static (
    tokio::runtime::Runtime,
    stateseal::internals::service::RequestStateService,
    tempfile::TempDir,
) {
    static S: OnceLock<(
        tokio::runtime::Runtime,
        stateseal::internals::service::RequestStateService,
        tempfile::TempDir,
    )> = OnceLock::new();
    S.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let ledger =
            Arc::new(stateseal::internals::ledger::sled::SledLedger::open(dir.path()).unwrap());
        let ring = Keyring::from_file(&KeysetFile::generate(0)).unwrap();
        let sealer = stateseal::internals::sealer::Sealer::new(
            Arc::new(stateseal::internals::keyring::KeyringHandle::new(ring)),
            ledger,
            Arc::new(stateseal::internals::clock::ManualClock::new(1_900_000_000)),
            stateseal::internals::sealer::Limits::default(),
        );
        let svc = stateseal::internals::service::RequestStateService::new(
            Arc::new(sealer),
            Arc::new(stateseal::internals::canon_pool::CanonPool::new(
                1,
                4,
                Arc::default(),
            )),
            Arc::new(stateseal::internals::metrics::Metrics::new()),
        );
        (
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            svc,
            dir,
        )
    })
}

/// A request as the authentication layer hands it on: with its tenant.
fn as_tenant<T>(msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.extensions_mut().insert(Tenant::new("t"));
    req
}

/// Every refusal carries one of the fixed reasons.
fn fixed_reason(s: &tonic::Status) -> bool {
    stateseal::internals::status::reason_of(s).is_some_and(|r| {
        stateseal::internals::error::Reject::ALL
            .iter()
            .any(|x| x.reason() == r)
    })
}

proptest! {
    #[test]
    fn keyset_parser_never_panics_on_arbitrary_bytes(raw in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = KeysetFile::parse(&raw);
    }

    #[test]
    fn keyset_parser_never_panics_on_mutated_keysets(pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut raw = KeysetFile::generate(0).to_json().unwrap().to_vec();
        let i = pos.index(raw.len());
        raw[i] = byte;
        if let Ok(k) = KeysetFile::parse(&raw) {
            prop_assert!(k.validate().is_ok());
        }
    }

    /// Arbitrary bytes decoded as each RPC's request and served by the
    /// gRPC service itself: a result or a fixed reason, never a panic. What
    /// seals opens with its state (once when single-use); a request built
    /// from arbitrary bytes never opens.
    #[test]
    fn arbitrary_requests_never_panic(raw in proptest::collection::vec(any::<u8>(), 0..800)) {
        use prost::Message;
        use stateseal::proto::request_state_server::RequestState;
        use stateseal::proto::{OpenRequest, SealRequest};
        let (rt, svc, _) = service();
        if let Ok(req) = SealRequest::decode(&raw[..]) {
            match rt.block_on(svc.seal(as_tenant(req.clone()))) {
                Ok(sealed) => {
                    let open = OpenRequest {
                        request_state: sealed.into_inner().request_state,
                        binding: req.binding.clone(),
                        ..Default::default()
                    };
                    let o = rt.block_on(svc.open(as_tenant(open.clone()))).unwrap().into_inner();
                    prop_assert_eq!(&o.state, &req.state);
                    prop_assert_eq!(o.consumed, req.single_use);
                    let again = rt.block_on(svc.open(as_tenant(open)));
                    prop_assert_eq!(again.is_ok(), !req.single_use);
                }
                Err(s) => prop_assert!(fixed_reason(&s), "{:?}", s),
            }
        }
        if let Ok(req) = OpenRequest::decode(&raw[..]) {
            let e = rt.block_on(svc.open(as_tenant(req))).unwrap_err();
            prop_assert!(fixed_reason(&e), "{:?}", e);
        }
    }
}

#[test]
fn key_types_zeroize_on_drop() {
    // Checked through the types: every holder of key bytes is ZeroizeOnDrop,
    // so a keyring replaced on reload wipes its keys when its last user drops it.
    fn zeroize_on_drop<T: zeroize::ZeroizeOnDrop>() {}
    zeroize_on_drop::<stateseal::internals::keyring::KeyMaterial>();
    zeroize_on_drop::<stateseal::internals::keyring::TenantKeys>();
    zeroize_on_drop::<chacha20poly1305::XChaCha20Poly1305>();
    zeroize_on_drop::<zeroize::Zeroizing<[u8; 32]>>();
}
