use super::*;

fn ks() -> KeysetFile {
    KeysetFile::generate(1000)
}

#[test]
fn generated_keyset_has_one_primary_and_validates() {
    let k = ks();
    k.validate().unwrap();
    let ring = Keyring::from_file(&k).unwrap();
    assert_eq!(ring.primary().id(), KeyId(1));
    assert_eq!(ring.summary(), vec![(KeyId(1), KeyState::Primary)]);
}

#[test]
fn rotation_moves() {
    let mut k = ks();
    let id = k.add_staged(2000, None).unwrap();
    assert_eq!(id, 2);
    assert!(k.promote(1, 2000, 0, false).is_err(), "already primary");
    assert!(
        k.promote(2, 2050, 100, false).is_err(),
        "staged for less than the rollout time"
    );
    k.promote(2, 3000, 100, false).unwrap();
    assert_eq!(k.keys[0].state, KeyState::Staged);
    assert_eq!(k.keys[0].demoted_at, Some(3000));
    assert_eq!(k.keys[1].state, KeyState::Primary);
    // Retiring the primary is refused; retiring too early is refused.
    let p = RetirePolicy {
        max_ttl: 3600,
        clock_skew: 60,
        rollout: 100,
    };
    assert!(k.retire(2, 9999, p, false).is_err());
    assert_eq!(k.safe_retire_at(1, p), Some(3000 + 100 + 3600 + 60));
    assert!(k.retire(1, 3000 + 3759, p, false).is_err());
    k.retire(1, 3000 + 3760, p, false).unwrap();
    assert_eq!(k.keys[0].state, KeyState::Retired);
    assert!(
        k.keys[0].material.is_none(),
        "material is erased on retirement"
    );
    assert!(
        k.promote(1, 9999, 0, true).is_err(),
        "a retired key never comes back"
    );
    assert!(k.retire(1, 9999, p, false).is_err(), "already retired");
    // Ids are never reused while retired entries stay in the file.
    assert_eq!(k.add_staged(9999, None).unwrap(), 3);
    k.validate().unwrap();
    let ring = Keyring::from_file(&k).unwrap();
    assert!(ring.get(KeyId(1)).is_none());
    assert!(ring.get(KeyId(3)).is_some());
}

#[test]
fn a_never_promoted_key_retires_at_once_and_force_overrides() {
    let mut k = ks();
    let id = k.add_staged(2000, None).unwrap();
    let p = RetirePolicy::default();
    k.retire(id, 2000, p, false).unwrap();
    let id = k.add_staged(2000, None).unwrap();
    k.promote(id, 2000, 120, true).unwrap();
    assert!(k.retire(1, 2001, p, false).is_err());
    k.retire(1, 2001, p, true).unwrap();
}

#[test]
fn promote_right_after_add_is_refused_without_force() {
    let mut k = ks();
    let id = k.add_staged(5000, None).unwrap();
    let err = k.promote(id, 5001, 120, false).unwrap_err().to_string();
    assert!(err.contains("--force"), "{err}");
    k.promote(id, 5120, 120, false).unwrap();
    // A demoted key going back to primary was staged long ago: no wait.
    k.promote(1, 5121, 120, false).unwrap();
}

#[test]
fn a_staged_key_promoted_but_never_demoted_is_not_retired_without_force() {
    // A hand-edited file: staged, with promoted_at and no demoted_at.
    let mut k = ks();
    let id = k.add_staged(1000, None).unwrap();
    k.keys[1].promoted_at = Some(1500);
    k.validate().unwrap();
    let p = RetirePolicy::default();
    assert_eq!(k.safe_retire_at(id, p), None);
    let err = k.retire(id, 999_999, p, false).unwrap_err().to_string();
    assert!(err.contains("no demotion time"), "{err}");
    k.retire(id, 999_999, p, true).unwrap();
}

#[test]
fn parse_errors_never_echo_values() {
    let good = ks().to_json().unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&good).unwrap();
    let material = v["keys"][0]["material"].as_str().unwrap().to_owned();
    // Key material pasted into the wrong member, of the wrong type.
    v["keys"][0]["id"] = material.clone().into();
    let err = KeysetFile::parse(v.to_string().as_bytes())
        .unwrap_err()
        .to_string();
    assert!(!err.contains(&material), "{err}");
    // As an unknown member name.
    let mut v: serde_json::Value = serde_json::from_slice(&good).unwrap();
    v["keys"][0][material.as_str()] = 1.into();
    let err = KeysetFile::parse(v.to_string().as_bytes())
        .unwrap_err()
        .to_string();
    assert!(!err.contains(&material), "{err}");
    // As the format string.
    let mut v: serde_json::Value = serde_json::from_slice(&good).unwrap();
    v["format"] = 7.into();
    v["keys"][0]["state"] = material.clone().into();
    let err = KeysetFile::parse(v.to_string().as_bytes())
        .unwrap_err()
        .to_string();
    assert!(!err.contains(&material), "{err}");
}

#[test]
fn to_json_allocates_once_at_the_exact_size() {
    let mut k = ks();
    for t in 0..20 {
        k.add_staged(t, None).unwrap();
    }
    let out = k.to_json().unwrap();
    assert_eq!(
        out.len(),
        out.capacity(),
        "no spare capacity, no reallocation"
    );
    assert_eq!(KeysetFile::parse(&out).unwrap().keys.len(), 21);
}

#[test]
fn bad_files_are_rejected() {
    let good = ks().to_json().unwrap();
    let text = std::str::from_utf8(&good).unwrap().to_owned();
    let bad = [
        String::new(),
        "{}".into(),
        "not json".into(),
        text.replace("stateseal-keyset/v1", "stateseal-keyset/v9"),
        text.replace("\"primary\"", "\"staged\""),
        text.replace("\"id\": 1", "\"id\": 0"),
        text.replace("\"state\"", "\"extra\": 1, \"state\""),
    ];
    for b in bad {
        assert!(KeysetFile::parse(b.as_bytes()).is_err(), "accepted: {b}");
    }
    // Short or non-base64 key material, without echoing it.
    let mut v: serde_json::Value = serde_json::from_slice(&good).unwrap();
    v["keys"][0]["material"] = "c2hvcnQ".into();
    let err = KeysetFile::parse(v.to_string().as_bytes())
        .unwrap_err()
        .to_string();
    assert!(!err.contains("c2hvcnQ"), "{err}");
    // Two primaries.
    let mut two = ks();
    two.add_staged(1, None).unwrap();
    two.keys[1].state = KeyState::Primary;
    assert!(two.validate().is_err());
}

#[test]
fn write_is_atomic_private_and_init_refuses_to_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("keyset.json");
    let k = ks();
    k.write(&p, true).unwrap();
    assert!(k.write(&p, true).is_err(), "init must not overwrite");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
    let mut k2 = KeysetFile::read(&p).unwrap();
    k2.add_staged(5, None).unwrap();
    k2.write(&p, false).unwrap();
    assert_eq!(KeysetFile::read(&p).unwrap().keys.len(), 2);
    // No temp files are left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

#[test]
fn debug_output_never_shows_key_bytes() {
    let k = ks();
    let material = k.keys[0].material.clone().unwrap();
    let b64 = URL_SAFE_NO_PAD.encode(material.expose());
    let ring = Keyring::from_file(&k).unwrap();
    let tk = ring.primary().tenant_keys(&Tenant::new("t"));
    for dbg in [
        format!("{k:?}"),
        format!("{ring:?}"),
        format!("{material:?}"),
        format!("{tk:?}"),
    ] {
        assert!(!dbg.contains(&b64), "{dbg}");
        let hex: String = material
            .expose()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert!(!dbg.contains(&hex));
        assert!(!dbg.contains(
            &format!("{:?}", &material.expose()[..4])
                .trim_end_matches(']')
                .to_string()
        ));
    }
}

#[test]
fn subkeys_differ_by_tenant_and_key() {
    let mut k = ks();
    k.add_staged(1, None).unwrap();
    let ring = Keyring::from_file(&k).unwrap();
    let a1 = ring.get(KeyId(1)).unwrap().tenant_keys(&Tenant::new("a"));
    let b1 = ring.get(KeyId(1)).unwrap().tenant_keys(&Tenant::new("b"));
    let a2 = ring.get(KeyId(2)).unwrap().tenant_keys(&Tenant::new("a"));
    let n = [7u8; 24];
    let id = |k: &TenantKeys| crate::domain::token::ledger_id(k, &n);
    assert_ne!(id(&a1), id(&b1));
    assert_ne!(id(&a1), id(&a2));
    // Cached: the same Arc comes back.
    let again = ring.get(KeyId(1)).unwrap().tenant_keys(&Tenant::new("a"));
    assert!(Arc::ptr_eq(&a1, &again));
}

#[test]
fn wiped_states_are_overwritten_with_a_secret_free_value() {
    use hmac::Mac;
    let keyed = |k: &[u8]| <Hmac<Sha256> as Mac>::new_from_slice(k).unwrap();
    let tag = |m: &Hmac<Sha256>| m.clone().finalize().into_bytes().to_vec();
    let mut w = Wiped(keyed(b"a secret ledger-id key"));
    assert_ne!(tag(&w.0), tag(&keyed(&[])));
    w.wipe();
    // After the wipe (what drop does) the state is that of the empty key.
    assert_eq!(tag(&w.0), tag(&keyed(&[])));

    let prk_out = |h: &Hkdf<Sha256>| {
        let mut o = [0u8; 32];
        h.expand(b"x", &mut o).unwrap();
        o
    };
    let mut h = Wiped(Hkdf::<Sha256>::new(Some(b"salt"), b"root key"));
    let blank = Hkdf::<Sha256>::from_prk(&[0u8; 32]).unwrap();
    assert_ne!(prk_out(&h.0), prk_out(&blank));
    h.wipe();
    assert_eq!(prk_out(&h.0), prk_out(&blank));
}

#[test]
fn rfc3339_and_listing() {
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(rfc3339(1_900_000_000), "2030-03-17T17:46:40Z");
    assert_eq!(rfc3339(4_102_444_799), "2099-12-31T23:59:59Z");
    assert_eq!(human_age(42), "42s");
    assert_eq!(human_age(3 * 86_400 + 4 * 3600), "3d04h");
    let mut k = ks();
    k.add_staged(1000, None).unwrap();
    k.promote(2, 2000, 0, false).unwrap();
    let p = RetirePolicy {
        max_ttl: 100,
        clock_skew: 10,
        rollout: 5,
    };
    // As `keys list --json` prints it.
    let json = |l: KeyListing| serde_json::to_value(l).unwrap();
    let l = json(k.listing(2050, p));
    let keys = l["keys"].as_array().unwrap();
    assert_eq!(keys[0]["state"], "staged");
    assert_eq!(keys[0]["demoted_for_seconds"], 50);
    assert_eq!(keys[0]["retire_after"], rfc3339(2000 + 5 + 100 + 10));
    assert_eq!(keys[0]["retirable_now"], false);
    assert_eq!(keys[1]["primary_for_seconds"], 50);
    assert_eq!(keys[1]["retire_after"], serde_json::Value::Null);
    assert!(json(k.listing(2115, p))["keys"][0]["retirable_now"]
        .as_bool()
        .unwrap());
    let text = l.to_string();
    let material = serde_json::to_value(&k).unwrap()["keys"][1]["material"].clone();
    assert!(!text.contains(material.as_str().unwrap()));
}

// === zeroizing, checked in memory ===
//
// Each value is built in a slot of its own, dropped in place, and the slot's
// bytes are read back: what a later reader of that memory would find.
// (Reading a dropped value's bytes through a raw pointer reads initialized
// bytes the drop itself wrote; no value is used after its drop.)

/// The bytes of `slot`'s value as they are now.
#[allow(unsafe_code)]
fn image<T>(slot: &std::mem::MaybeUninit<T>) -> Vec<u8> {
    // SAFETY: the slot holds `size_of::<T>()` bytes that were written by
    // `MaybeUninit::zeroed` and then by the value's construction and drop.
    unsafe {
        std::slice::from_raw_parts(slot.as_ptr().cast::<u8>(), std::mem::size_of::<T>()).to_vec()
    }
}

/// Builds `make()` in a zeroed slot, returns its bytes before and after an
/// in-place drop.
#[allow(unsafe_code)]
fn before_and_after_drop<T>(make: impl FnOnce() -> T) -> (Vec<u8>, Vec<u8>) {
    let mut slot = std::mem::MaybeUninit::<T>::zeroed();
    slot.write(make());
    let before = image(&slot);
    // SAFETY: the slot holds a value, dropped exactly once and not used after.
    unsafe { std::ptr::drop_in_place(slot.as_mut_ptr()) };
    (before, image(&slot))
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The 16-byte windows of `secret_image` that a secret-free value of the
/// same type (`blank_image`) does not have: key-dependent content.
fn secret_windows(secret_image: &[u8], blank_image: &[u8]) -> Vec<Vec<u8>> {
    secret_image
        .windows(16)
        .filter(|w| !contains(blank_image, w))
        .map(<[u8]>::to_vec)
        .collect()
}

#[test]
fn key_material_is_overwritten_in_memory_on_drop() {
    let (before, after) = before_and_after_drop(|| KeyMaterial::from_bytes([0xA5; 32]));
    assert!(
        contains(&before, &[0xA5; 32]),
        "the scan must see the key first"
    );
    assert!(
        !contains(&after, &[0xA5; 8]),
        "root key bytes left after drop"
    );
}

#[test]
fn tenant_keys_are_overwritten_in_memory_on_drop() {
    let root = RootKey {
        id: KeyId(3),
        state: KeyState::Primary,
        material: KeyMaterial::from_bytes([0x5A; 32]),
        cache: RwLock::default(),
        audit: Default::default(),
    };
    let tenant = Tenant::new("acme");
    // The two subkeys, derived here as the token format documents them.
    let hk = Hkdf::<Sha256>::new(Some(labels::SALT), &[0x5A; 32]);
    let kid = 3u32.to_be_bytes();
    let t = b"acme";
    let tlen = (t.len() as u32).to_be_bytes();
    let mut aead_key = [0u8; 32];
    hk.expand_multi_info(&[labels::TOKEN_AEAD, &kid, &tlen, t], &mut aead_key)
        .unwrap();
    let mut ledger_key = [0u8; 32];
    hk.expand_multi_info(&[labels::LEDGER_ID, &kid, &tlen, t], &mut ledger_key)
        .unwrap();
    let hmac = |k: &[u8]| <Hmac<Sha256> as hmac::Mac>::new_from_slice(k).unwrap();
    // The ledger-id HMAC's keyed states, as bytes: what must not survive.
    let keyed = before_and_after_drop(|| std::mem::ManuallyDrop::new(hmac(&ledger_key))).0;
    let blank = before_and_after_drop(|| std::mem::ManuallyDrop::new(hmac(&[]))).0;
    let hmac_secrets = secret_windows(&keyed, &blank);
    assert!(!hmac_secrets.is_empty());

    let (before, after) = before_and_after_drop(|| root.derive(&tenant));
    assert!(
        contains(&before, &aead_key),
        "the scan must see the AEAD key first"
    );
    assert!(
        hmac_secrets.iter().any(|w| contains(&before, w)),
        "the scan must see the HMAC state first"
    );
    assert!(
        !contains(&after, &aead_key[..8]),
        "AEAD subkey left after drop"
    );
    let left: Vec<_> = hmac_secrets
        .iter()
        .filter(|w| contains(&after, w))
        .collect();
    assert!(
        left.is_empty(),
        "{} keyed HMAC windows left after drop",
        left.len()
    );
}

#[test]
fn wiped_hkdf_is_overwritten_in_memory_on_drop() {
    let hk = || Hkdf::<Sha256>::new(Some(labels::SALT), &[0x77; 32]);
    let keyed = before_and_after_drop(|| std::mem::ManuallyDrop::new(hk())).0;
    let blank = before_and_after_drop(|| std::mem::ManuallyDrop::new(Hkdf::<Sha256>::blank())).0;
    let secrets = secret_windows(&keyed, &blank);
    assert!(!secrets.is_empty());
    let (before, after) = before_and_after_drop(|| Wiped(hk()));
    assert!(secrets.iter().any(|w| contains(&before, w)));
    let left = secrets.iter().filter(|w| contains(&after, w)).count();
    assert_eq!(left, 0, "PRK-derived windows left after drop");
}

/// A key-encryption key for these tests: XChaCha20-Poly1305 under a fixed
/// key (the operations layer's file KEK is the same construction).
#[derive(Debug)]
struct TestKek(&'static str);

impl Kek for TestKek {
    fn kind(&self) -> &'static str {
        self.0
    }
    fn wrap(&self, aad: &[u8], key: &[u8; 32]) -> Result<Vec<u8>, KeysetError> {
        use chacha20poly1305::aead::{Aead, Payload};
        use chacha20poly1305::{KeyInit, XChaCha20Poly1305, XNonce};
        let aead = XChaCha20Poly1305::new(&[9u8; 32].into());
        let nonce = [4u8; 24];
        let mut blob = nonce.to_vec();
        blob.extend(
            aead.encrypt(XNonce::from_slice(&nonce), Payload { msg: key, aad })
                .map_err(|_| KeysetError::Refused("wrap".into()))?,
        );
        Ok(blob)
    }
    fn unwrap(&self, aad: &[u8], blob: &[u8]) -> Result<Zeroizing<[u8; 32]>, KeysetError> {
        use chacha20poly1305::aead::{Aead, Payload};
        use chacha20poly1305::{KeyInit, XChaCha20Poly1305, XNonce};
        let aead = XChaCha20Poly1305::new(&[9u8; 32].into());
        let (nonce, ct) = blob.split_at(24.min(blob.len()));
        let clear = Zeroizing::new(
            aead.decrypt(XNonce::from_slice(nonce), Payload { msg: ct, aad })
                .map_err(|_| KeysetError::Refused("does not open".into()))?,
        );
        let mut out = Zeroizing::new([0u8; 32]);
        out.copy_from_slice(&clear);
        Ok(out)
    }
}

#[test]
fn a_wrapped_key_opens_only_under_its_own_id_and_keyset() {
    let kek = TestKek("file");
    let mut k = ks();
    k.add_staged(2000, None).unwrap();
    k.rewrap(None, &kek).unwrap();
    k.validate().unwrap();
    assert!(Keyring::from_file_with(&k, Some(&kek)).is_ok());
    // A KEK of another kind is refused even where it would open the blobs.
    let err = Keyring::from_file_with(&k, Some(&TestKek("pkcs11")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("wrapped by a file KEK, not pkcs11"), "{err}");

    let mut swapped = k.clone();
    let (a, b) = (
        swapped.keys[0].wrapped.clone(),
        swapped.keys[1].wrapped.clone(),
    );
    swapped.keys[0].wrapped = b;
    swapped.keys[1].wrapped = a;
    let err = Keyring::from_file_with(&swapped, Some(&kek))
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not open key 1"), "{err}");

    let mut moved = k.clone();
    moved.keyset_id = Some("another keyset".into());
    let err = Keyring::from_file_with(&moved, Some(&kek))
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not open key 1"), "{err}");
}

#[test]
fn a_wrapped_keyset_names_a_known_kek() {
    let mut k = ks();
    k.rewrap(None, &TestKek("file")).unwrap();
    k.validate().unwrap();
    k.kek = Some("pkcs11".into());
    k.validate().unwrap();
    k.kek = Some("hsm".into());
    assert_eq!(
        k.validate().unwrap_err().to_string(),
        "keyset is invalid: unknown kek (want file or pkcs11)"
    );
}

#[test]
fn display_and_debug_forms() {
    assert_eq!(KeyId(7).to_string(), "7");
    let states = [KeyState::Staged, KeyState::Primary, KeyState::Retired];
    assert_eq!(
        states.map(|s| s.to_string()),
        ["staged", "primary", "retired"]
    );
    assert_eq!(
        format!("{:?}", KeyMaterial::from_bytes([0x41; 32])),
        "KeyMaterial(..)"
    );
    let err = serde_json::from_str::<KeyMaterial>("5")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("expected 32 bytes of key material, base64url without padding"),
        "{err}"
    );
}

#[test]
fn times_and_ages_as_operators_read_them() {
    for (t, want) in [
        (0, "1970-01-01T00:00:00Z"),
        // Just after 1 March, where the century terms of the year move it.
        (5_097_600, "1970-03-01T00:00:00Z"),
        (5_184_000, "1970-03-02T00:00:00Z"),
        (825_638_400, "1996-03-01T00:00:00Z"),
        (920_376_000, "1999-03-02T12:00:00Z"),
        (951_782_400, "2000-02-29T00:00:00Z"),
        (1_709_164_800, "2024-02-29T00:00:00Z"),
        (1_764_512_790, "2025-11-30T14:26:30Z"),
        (4_102_444_799, "2099-12-31T23:59:59Z"),
    ] {
        assert_eq!(rfc3339(t), want);
    }
    for (s, want) in [
        (42, "42s"),
        (450, "7m30s"),
        (18_720, "5h12m"),
        (273_600, "3d04h"),
        (3_600, "1h00m"),
    ] {
        assert_eq!(human_age(s), want);
    }
}

#[test]
fn a_listing_gives_no_retirement_time_for_a_retired_key() {
    let mut k = ks();
    let id = k.add_staged(2000, None).unwrap();
    k.promote(id, 2000, 0, true).unwrap();
    k.retire(
        1,
        3000,
        RetirePolicy {
            max_ttl: 10,
            clock_skew: 10,
            rollout: 10,
        },
        true,
    )
    .unwrap();
    let policy = RetirePolicy {
        max_ttl: 10,
        clock_skew: 10,
        rollout: 10,
    };
    let listing = k.listing(5000, policy);
    let retired = listing.keys.iter().find(|l| l.id == 1).unwrap();
    assert_eq!(retired.state, KeyState::Retired);
    assert_eq!(retired.retire_after, None);
    assert!(!retired.retirable_now);
    let primary = listing.keys.iter().find(|l| l.id == id).unwrap();
    assert_eq!(primary.state, KeyState::Primary);
}

#[test]
fn a_running_keyring_takes_a_successor_only_of_the_same_keyset_and_bytes() {
    let k = ks();
    let ring = Keyring::from_file(&k).unwrap();
    assert_eq!(ring.primary_since(), Some(1000));
    assert_eq!(
        ring.refuses_successor(&Keyring::from_file(&k).unwrap()),
        None
    );

    let mut changed = k.clone();
    changed.keys[0].material = Some(KeyMaterial::generate());
    assert_eq!(
        ring.refuses_successor(&Keyring::from_file(&changed).unwrap()),
        Some("key 1's material changed".to_owned())
    );

    let kek = TestKek("file");
    let (mut a, mut b) = (k.clone(), k.clone());
    a.rewrap(None, &kek).unwrap();
    b.rewrap(None, &kek).unwrap();
    let ring_a = Keyring::from_file_with(&a, Some(&kek)).unwrap();
    let why = ring_a
        .refuses_successor(&Keyring::from_file_with(&b, Some(&kek)).unwrap())
        .unwrap();
    assert!(why.starts_with("the keyset's id changed"), "{why}");

    let handle = KeyringHandle::new(ring);
    let mut next = k.clone();
    let id = next.add_staged(2000, None).unwrap();
    handle.replace(Keyring::from_file(&next).unwrap());
    assert!(
        handle.current().get(KeyId(id)).is_some(),
        "the new keyring is in force"
    );
}

#[test]
fn audit_keys_separate_lines_and_fields() {
    let ring = Keyring::from_file(&ks()).unwrap();
    let audit = ring.primary().audit_keys();
    let prev = [7u8; 32];
    let a = audit.chain_mac(&prev, b"line one");
    assert_eq!(a, audit.chain_mac(&prev, b"line one"));
    assert_ne!(a, audit.chain_mac(&prev, b"line two"));
    assert_ne!(a, audit.chain_mac(&[8u8; 32], b"line one"));
    let d = audit.digest("subject", &[b"alice"]);
    assert_eq!(d, audit.digest("subject", &[b"alice"]));
    assert_ne!(d, audit.digest("attempt", &[b"alice"]));
    assert_ne!(d, audit.digest("subject", &[b"bob"]));
    assert_ne!(d, [0u8; 16]);
    assert_ne!(d, [1u8; 16]);
}

#[test]
fn debug_of_key_holders_shows_no_bytes() {
    let ring = Keyring::from_file(&ks()).unwrap();
    let root = ring.primary();
    assert_eq!(
        format!("{root:?}"),
        "RootKey { id: KeyId(1), state: Primary, .. }"
    );
    assert_eq!(
        format!("{:?}", root.tenant_keys(&Tenant::new("t"))),
        "TenantKeys { .. }"
    );
    assert_eq!(format!("{:?}", root.audit_keys()), "AuditKeys(..)");
    let wiped = Wiped(Hkdf::<Sha256>::new(Some(b"salt"), b"root key"));
    assert_eq!(format!("{wiped:?}"), "Wiped(..)");
}

#[test]
fn a_keyset_written_new_reads_back_private() {
    use std::os::unix::fs::PermissionsExt;
    // On tmpfs where there is one: another file system than the working
    // directory's, so a temporary file made anywhere but beside the keyset
    // could not be linked into place.
    let dir = match Path::new("/dev/shm").is_dir() {
        true => tempfile::tempdir_in("/dev/shm").unwrap(),
        false => tempfile::tempdir().unwrap(),
    };
    let path = dir.path().join("keyset.json");
    let k = ks();
    k.write(&path, true).unwrap();
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let back = KeysetFile::read(&path).unwrap();
    assert_eq!(*back.to_json().unwrap(), *k.to_json().unwrap());
    let err = k.write(&path, true).unwrap_err().to_string();
    assert!(err.contains("exists; not overwriting"), "{err}");
}
