//! Token parse and open under the golden vectors' keys: never a panic; a
//! token that opens has exactly one string form, and any one-bit change to
//! it is rejected. The keys and tenants are those of tests/data/golden.json
//! (key 1, tenant `default`) and tests/data/golden-v2.json (key 7, tenant
//! `acme`), so the seeds made from those vectors open and the oracle runs;
//! the binding version is the token header's. How often the oracle ran is
//! printed (`oracle reached N times`) at 1, 10, 100, ... times, and exactly
//! when the run ends (`oracle reached N times in all`, from an `atexit`
//! handler: libFuzzer ends a `-runs=N` run with `exit`).
#![no_main]

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use libfuzzer_sys::fuzz_target;
use stateseal::internals::binding::{params_digest_for, Binding, Method, Tenant};
use stateseal::internals::keyring::{
    KeyMaterial, KeyRecord, KeyState, Keyring, KeysetFile, KEYSET_FORMAT,
};
use stateseal::internals::token::UntrustedToken;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The golden vectors' root key of key `id` (tests/it/golden.rs `root_key`).
fn root_key(id: u32) -> [u8; 32] {
    let mut k = [0u8; 32];
    for (i, b) in k.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(7) ^ (id as u8);
    }
    k
}

extern "C" {
    fn atexit(callback: extern "C" fn()) -> i32;
}

extern "C" fn report_oracle() {
    eprintln!(
        "oracle reached {} times in all",
        ORACLE.load(Ordering::Relaxed)
    );
}

fn ring() -> &'static Keyring {
    static RING: OnceLock<Keyring> = OnceLock::new();
    RING.get_or_init(|| {
        // SAFETY: registers a plain function with no captured state; the C
        // runtime calls it once at exit.
        assert_eq!(unsafe { atexit(report_oracle) }, 0, "atexit");
        let record = |id: u32, state: KeyState| KeyRecord {
            id,
            state,
            created_at: 0,
            promoted_at: Some(0),
            demoted_at: None,
            retired_at: None,
            material: Some(KeyMaterial::from_bytes(root_key(id))),
            wrapped: None,
        };
        Keyring::from_file(&KeysetFile {
            format: KEYSET_FORMAT.into(),
            kek: None,
            keyset_id: None,
            keys: vec![record(1, KeyState::Staged), record(7, KeyState::Primary)],
        })
        .expect("keyring")
    })
}

static ORACLE: AtomicU64 = AtomicU64::new(0);

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
    let Ok(untrusted) = UntrustedToken::parse(token, 1 << 16) else {
        return;
    };
    let Some(key) = ring().get(untrusted.header().key_id) else {
        return;
    };
    let version = untrusted.header().binding;
    let Ok(digest) = params_digest_for(version, Method::ToolsCall, params) else {
        return;
    };
    let binding = Binding {
        tenant: Tenant::new(if key.id().0 == 7 { "acme" } else { "default" }),
        subject: subject.into(),
        method: Method::ToolsCall,
        params: digest,
        version,
    };
    let keys = key.tenant_keys(&binding.tenant);
    if untrusted.open(&keys, &binding).is_ok() {
        let n = ORACLE.fetch_add(1, Ordering::Relaxed) + 1;
        let mut m = n;
        while m % 10 == 0 {
            m /= 10;
        }
        if m == 1 {
            eprintln!("oracle reached {n} times");
        }
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
