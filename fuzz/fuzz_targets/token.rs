//! Token parse and open under the golden-vector key: never a panic; a token
//! that opens has exactly one string form, and any one-bit change to it is
//! rejected.
#![no_main]

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use libfuzzer_sys::fuzz_target;
use stateseal::binding::{params_digest, Binding, Method, Tenant};
use stateseal::keyring::{KeyMaterial, KeyRecord, KeyState, Keyring, KeysetFile, KEYSET_FORMAT};
use stateseal::token::UntrustedToken;
use std::sync::OnceLock;

fn ring() -> &'static Keyring {
    static RING: OnceLock<Keyring> = OnceLock::new();
    RING.get_or_init(|| {
        let mut root = [0u8; 32];
        for (i, b) in root.iter_mut().enumerate() {
            *b = (i * 5 + 1) as u8; // the golden vectors' root key
        }
        Keyring::from_file(&KeysetFile {
            format: KEYSET_FORMAT.into(),
            keys: vec![KeyRecord {
                id: 1,
                state: KeyState::Primary,
                created_at: 0,
                promoted_at: Some(0),
                demoted_at: None,
                retired_at: None,
                material: Some(KeyMaterial::from_bytes(root)),
            }],
        })
        .expect("keyring")
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // "token\nsubject\nparams" lets the fuzzer reach the binding too.
    let mut parts = text.splitn(3, '\n');
    let token = parts.next().unwrap_or_default();
    let subject = parts.next().unwrap_or("alice");
    let params = parts
        .next()
        .unwrap_or(r#"{"name":"transfer","arguments":{"amount":42}}"#);
    let Ok(digest) = params_digest(params) else {
        return;
    };
    let binding = Binding {
        tenant: Tenant::new("tenant-a"),
        subject: subject.into(),
        method: Method::ToolsCall,
        params: digest,
        version: stateseal::binding::BindingVersion::V1,
    };
    let Ok(untrusted) = UntrustedToken::parse(token, 1 << 16) else {
        return;
    };
    let Some(key) = ring().get(untrusted.header().key_id) else {
        return;
    };
    let keys = key.tenant_keys(&binding.tenant);
    if untrusted.open(&keys, &binding).is_ok() {
        let raw = URL_SAFE_NO_PAD
            .decode(token)
            .expect("an opened token decodes");
        assert_eq!(URL_SAFE_NO_PAD.encode(&raw), token, "one string form");
        for pos in 0..raw.len() {
            let mut m = raw.clone();
            m[pos] ^= 1 << (pos % 8);
            let t = URL_SAFE_NO_PAD.encode(&m);
            let opened = UntrustedToken::parse(&t, 1 << 16)
                .ok()
                .and_then(|u| ring().get(u.header().key_id).map(|_| u))
                .map(|u| u.open(&keys, &binding).is_ok())
                .unwrap_or(false);
            assert!(!opened, "a changed token opened");
        }
    }
});
