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
    let id = k.add_staged(2000);
    assert_eq!(id, 2);
    assert!(k.promote(1, 2000).is_err(), "already primary");
    k.promote(2, 3000).unwrap();
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
        k.promote(1, 9999).is_err(),
        "a retired key never comes back"
    );
    assert!(k.retire(1, 9999, p, false).is_err(), "already retired");
    // Ids are never reused while retired entries stay in the file.
    assert_eq!(k.add_staged(9999), 3);
    k.validate().unwrap();
    let ring = Keyring::from_file(&k).unwrap();
    assert!(ring.get(KeyId(1)).is_none());
    assert!(ring.get(KeyId(3)).is_some());
}

#[test]
fn a_never_promoted_key_retires_at_once_and_force_overrides() {
    let mut k = ks();
    let id = k.add_staged(2000);
    let p = RetirePolicy::default();
    k.retire(id, 2000, p, false).unwrap();
    let id = k.add_staged(2000);
    k.promote(id, 2000).unwrap();
    assert!(k.retire(1, 2001, p, false).is_err());
    k.retire(1, 2001, p, true).unwrap();
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
    two.add_staged(1);
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
    k2.add_staged(5);
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
    k.add_staged(1);
    let ring = Keyring::from_file(&k).unwrap();
    let a1 = ring.get(KeyId(1)).unwrap().tenant_keys(&Tenant::new("a"));
    let b1 = ring.get(KeyId(1)).unwrap().tenant_keys(&Tenant::new("b"));
    let a2 = ring.get(KeyId(2)).unwrap().tenant_keys(&Tenant::new("a"));
    assert_ne!(*a1.ledger_id, *b1.ledger_id);
    assert_ne!(*a1.ledger_id, *a2.ledger_id);
    // Cached: the same Arc comes back.
    let again = ring.get(KeyId(1)).unwrap().tenant_keys(&Tenant::new("a"));
    assert!(Arc::ptr_eq(&a1, &again));
}
