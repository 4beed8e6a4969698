use super::*;
use crate::domain::binding::{Method, ParamsDigest, Tenant};
use crate::domain::codec::{Codec, Reader};
use crate::domain::keyring::{Keyring, KeysetFile};

fn keys() -> std::sync::Arc<TenantKeys> {
    let ring = Keyring::from_file(&KeysetFile::generate(0)).unwrap();
    ring.primary().tenant_keys(&Tenant::new("t"))
}

fn binding() -> Binding {
    Binding {
        tenant: Tenant::new("t"),
        subject: "s".into(),
        method: Method::ToolsCall,
        params: ParamsDigest([7; 32]),
        version: crate::domain::binding::BindingVersion::V1,
    }
}

const H: Header = Header {
    key_id: KeyId(1),
    expires_at: 100,
    single_use: true,
    binding: crate::domain::binding::BindingVersion::V1,
    manifest: false,
};

#[test]
fn overhead_is_49_bytes() {
    for n in [0usize, 1, 64, 256, 4096] {
        let t = seal(&keys(), H, &binding(), None, &vec![0; n], Nonce::Fresh).unwrap();
        assert_eq!(URL_SAFE_NO_PAD.decode(&t).unwrap().len(), n + OVERHEAD);
        assert_eq!(t.len(), encoded_len(n + OVERHEAD));
    }
    assert_eq!(OVERHEAD, 49);
}

#[test]
fn header_round_trip_and_reserved_bits() {
    for h in [
        H,
        Header {
            single_use: false,
            ..H
        },
        Header {
            binding: crate::domain::binding::BindingVersion::V2,
            ..H
        },
        Header {
            manifest: true,
            ..H
        },
    ] {
        assert_eq!(Header::read(&mut Reader::new(&h.to_bytes())), Some(h));
    }
    let mut b = H.to_bytes();
    // Version nibble other than 1 and 2, or a binding version field other than
    // 0 (v1) and 1 (v2).
    let token = seal(&keys(), H, &binding(), None, b"x", Nonce::Fresh).unwrap();
    let mut raw = URL_SAFE_NO_PAD.decode(&token).unwrap();
    for bad in [0x00, 0x30, 0x14, 0x16, 0x18, 0x1e, 0x24, 0xff] {
        b[0] = bad;
        assert_eq!(Header::read(&mut Reader::new(&b)), None, "{bad:#x}");
        // And a token with that first byte is MALFORMED before any key use.
        raw[0] = bad;
        assert_eq!(
            UntrustedToken::parse(&URL_SAFE_NO_PAD.encode(&raw), 1024).err(),
            Some(Reject::Malformed),
            "{bad:#x}"
        );
    }
}

#[test]
fn stripping_the_single_use_flag_is_rejected() {
    let k = keys();
    let t = seal(&k, H, &binding(), None, b"x", Nonce::Fresh).unwrap();
    let mut raw = URL_SAFE_NO_PAD.decode(&t).unwrap();
    raw[0] &= !FLAG_SINGLE_USE;
    let forged = UntrustedToken::parse(&URL_SAFE_NO_PAD.encode(&raw), 1024).unwrap();
    assert!(!forged.header().single_use);
    assert_eq!(forged.open(&k, &binding()).unwrap_err(), Reject::Rejected);
}

#[test]
fn parse_bounds() {
    assert_eq!(
        UntrustedToken::parse("", 10).unwrap_err(),
        Reject::Malformed
    );
    let t = seal(&keys(), H, &binding(), None, &[0; 11], Nonce::Fresh).unwrap();
    assert_eq!(UntrustedToken::parse(&t, 10).unwrap_err(), Reject::TooLarge);
    assert!(UntrustedToken::parse(&t, 11).is_ok());
    let dbg = format!("{:?}", UntrustedToken::parse(&t, 11).unwrap());
    assert!(!dbg.contains(&t[..20]));
}

#[test]
fn other_tenant_keys_do_not_open() {
    let ring = Keyring::from_file(&KeysetFile::generate(0)).unwrap();
    let a = ring.primary().tenant_keys(&Tenant::new("a"));
    let b = ring.primary().tenant_keys(&Tenant::new("b"));
    let mut bind = binding();
    bind.tenant = Tenant::new("a");
    let t = seal(&a, H, &bind, None, b"x", Nonce::Fresh).unwrap();
    // Even with the AAD claiming tenant "a", tenant b's key fails.
    assert_eq!(
        UntrustedToken::parse(&t, 64)
            .unwrap()
            .open(&b, &bind)
            .unwrap_err(),
        Reject::Rejected
    );
    let opened = UntrustedToken::parse(&t, 64)
        .unwrap()
        .open(&a, &bind)
        .unwrap();
    assert_eq!(&opened.state[..], b"x");
}

#[test]
fn a_reservation_is_decoded_once_and_opens_only_as_sealed() {
    let k = keys();
    let c = ReservationClaims {
        expires_at: 1_900_000_000,
        ledger_id: [7; 32],
        rid: [9; 16],
        lease_until: 1_800_000_030,
    };
    let s = seal_reservation(&k, KeyId(1), "t", &c).unwrap();
    let sealed = SealedReservation::parse(&s).unwrap();
    assert_eq!(sealed.key_id(), KeyId(1));
    assert_eq!(sealed.open(&k, "t").unwrap(), c);
    // Another tenant, or one changed character: REJECTED.
    let other = SealedReservation::parse(&s).unwrap().open(&k, "u");
    assert_eq!(other.unwrap_err(), Reject::Rejected);
    let mut changed = s.clone().into_bytes();
    let last = changed.len() - 2;
    changed[last] = if changed[last] == b'A' { b'B' } else { b'A' };
    let changed = String::from_utf8(changed).unwrap();
    let opened = SealedReservation::parse(&changed).and_then(|r| r.open(&k, "t"));
    assert_eq!(opened.unwrap_err(), Reject::Rejected);
    // Wrong length, not base64url, another format byte: MALFORMED.
    for bad in [
        &s[..s.len() - 1],
        &format!("{s}A"),
        &s.replace(&s[..2], "!!"),
    ] {
        assert_eq!(
            SealedReservation::parse(bad).err(),
            Some(Reject::Malformed),
            "{bad}"
        );
    }
    let mut raw = URL_SAFE_NO_PAD.decode(&s).unwrap();
    raw[0] ^= 0xff;
    let other_format = URL_SAFE_NO_PAD.encode(&raw);
    assert_eq!(
        SealedReservation::parse(&other_format).err(),
        Some(Reject::Malformed)
    );
}

#[test]
fn the_size_bound_is_the_state_limit_and_one_manifest_exactly() {
    let max = 1024;
    // Written out, not MANIFEST_ROOM: the bound itself is what is checked.
    let limit = encoded_len(OVERHEAD + max + 2 + crate::domain::manifest::MAX_MANIFEST);
    assert_eq!(
        UntrustedToken::parse(&"A".repeat(limit + 1), max).err(),
        Some(Reject::TooLarge),
        "one character over the bound"
    );
    // At the bound the string is decoded, and refused for what it holds.
    assert_eq!(
        UntrustedToken::parse(&"A".repeat(limit), max).err(),
        Some(Reject::Malformed)
    );
}

#[test]
fn an_empty_state_is_the_shortest_token_and_one_byte_less_is_malformed() {
    let k = keys();
    let t = seal(&k, H, &binding(), None, b"", Nonce::Fresh).unwrap();
    let raw = URL_SAFE_NO_PAD.decode(&t).unwrap();
    assert_eq!(raw.len(), OVERHEAD);
    let opened = UntrustedToken::parse(&t, 1024)
        .unwrap()
        .open(&k, &binding())
        .unwrap();
    assert!(opened.state.is_empty());
    let short = URL_SAFE_NO_PAD.encode(&raw[..OVERHEAD - 1]);
    assert_eq!(
        UntrustedToken::parse(&short, 1024).err(),
        Some(Reject::Malformed)
    );
}

#[test]
fn the_header_written_follows_the_binding_and_the_manifest() {
    let k = keys();
    let mut b = binding();
    b.version = crate::domain::binding::BindingVersion::V2;
    // H says binding v1 and no manifest: the token says what was sealed.
    let t = seal(&k, H, &b, Some(b"m"), b"x", Nonce::Fresh).unwrap();
    let u = UntrustedToken::parse(&t, 1024).unwrap();
    assert_eq!(u.header().binding, b.version);
    assert!(u.header().manifest);
    let opened = u.open(&k, &b).unwrap();
    assert_eq!(opened.manifest.as_deref().map(|m| &m[..]), Some(&b"m"[..]));
    assert_eq!(&opened.state[..], b"x");
}

#[test]
fn a_manifest_is_bounded_at_its_maximum() {
    let k = keys();
    let max = crate::domain::manifest::MAX_MANIFEST;
    assert!(seal(&k, H, &binding(), Some(&vec![0; max]), b"x", Nonce::Fresh).is_ok());
    assert_eq!(
        seal(
            &k,
            H,
            &binding(),
            Some(&vec![0; max + 1]),
            b"x",
            Nonce::Fresh
        )
        .err(),
        Some(Reject::TooLarge)
    );
}

#[test]
fn ledger_ids_and_attempt_hashes_are_keyed_and_distinct() {
    let k = keys();
    let open = |t: &str| {
        UntrustedToken::parse(t, 1024)
            .unwrap()
            .open(&k, &binding())
            .unwrap()
    };
    let a = open(&seal(&k, H, &binding(), None, b"x", Nonce::Fixed(&[1; NONCE_LEN])).unwrap());
    let b = open(&seal(&k, H, &binding(), None, b"x", Nonce::Fixed(&[2; NONCE_LEN])).unwrap());
    assert_eq!(a.ledger_id(&k), ledger_id(&k, &[1; NONCE_LEN]));
    assert_ne!(a.ledger_id(&k), b.ledger_id(&k));
    assert_ne!(a.ledger_id(&k), [0; 32]);
    assert_eq!(attempt_hash(&k, "x"), attempt_hash(&k, "x"));
    assert_ne!(attempt_hash(&k, "x"), attempt_hash(&k, "y"));
    assert_ne!(attempt_hash(&k, "x"), [0; 16]);
    // Debug shows lengths, never bytes, and says what it is.
    let t = seal(&k, H, &binding(), None, b"secret-state", Nonce::Fresh).unwrap();
    let u = UntrustedToken::parse(&t, 1024).unwrap();
    let shown = format!("{u:?}");
    assert!(
        shown.starts_with("UntrustedToken") && shown.contains("len"),
        "{shown}"
    );
    let o = u.open(&k, &binding()).unwrap();
    let shown = format!("{o:?}");
    assert!(
        shown.starts_with("Opened") && shown.contains("state_len") && !shown.contains("secret"),
        "{shown}"
    );
    let claims = ReservationClaims {
        expires_at: 1,
        ledger_id: [9; 32],
        rid: [8; 16],
        lease_until: 77,
    };
    let shown = format!("{claims:?}");
    assert!(
        shown.starts_with("ReservationClaims") && shown.contains("77") && !shown.contains("9, 9"),
        "{shown}"
    );
}
