//! Golden token vectors: the wire format and the key derivation are frozen.
//! This test regenerates every vector from its inputs and compares it with
//! tests/data/golden.json. After an intended format change, regenerate with
//! `STATESEAL_REGENERATE_GOLDEN=1 cargo test --test golden` and review the diff.
#![allow(clippy::unwrap_used)]

use serde_json::{json, Value};
use stateseal::binding::{params_digest, Binding, Method, Tenant};
use stateseal::keyring::{KeyMaterial, KeyRecord, KeyState, Keyring, KeysetFile, KEYSET_FORMAT};
use stateseal::token::{seal_with_nonce, Header, UntrustedToken};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

struct Input {
    name: &'static str,
    key_id: u32,
    tenant: &'static str,
    subject: &'static str,
    method: Method,
    params_json: &'static str,
    state: &'static [u8],
    expires_at: u32,
    single_use: bool,
}

const INPUTS: [Input; 4] = [
    Input {
        name: "tools/call reusable",
        key_id: 1,
        tenant: "default",
        subject: "alice",
        method: Method::ToolsCall,
        params_json: r#"{"name":"transfer","arguments":{"amount":42}}"#,
        state: b"{\"step\":1}",
        expires_at: 1_900_000_600,
        single_use: false,
    },
    Input {
        name: "tools/call single-use",
        key_id: 1,
        tenant: "default",
        subject: "alice",
        method: Method::ToolsCall,
        params_json: r#"{"arguments":{"amount":42},"name":"transfer","_meta":{"progressToken":1}}"#,
        state: b"{\"step\":1}",
        expires_at: 1_900_000_600,
        single_use: true,
    },
    Input {
        name: "prompts/get empty state, other tenant and key",
        key_id: 4_000_000_000,
        tenant: "team-b",
        subject: "user:\u{e9}",
        method: Method::PromptsGet,
        params_json: r#"{"name":"greet","arguments":{"lang":"fr"}}"#,
        state: b"",
        expires_at: 4_000_000_000,
        single_use: false,
    },
    Input {
        name: "resources/read 64-byte state",
        key_id: 2,
        tenant: "default",
        subject: "bob",
        method: Method::ResourcesRead,
        params_json: r#"{"uri":"file:///tmp/x"}"#,
        state: b"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        expires_at: 1_900_003_600,
        single_use: true,
    },
];

fn root_key(id: u32) -> [u8; 32] {
    let mut k = [0u8; 32];
    for (i, b) in k.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(7) ^ (id as u8);
    }
    k
}

fn nonce(i: usize) -> [u8; 24] {
    let mut n = [0u8; 24];
    for (j, b) in n.iter_mut().enumerate() {
        *b = (0xa0 + j + i) as u8;
    }
    n
}

fn keyring_for(id: u32) -> Keyring {
    Keyring::from_file(&KeysetFile {
        format: KEYSET_FORMAT.into(),
        keys: vec![KeyRecord {
            id,
            state: KeyState::Primary,
            created_at: 0,
            promoted_at: Some(0),
            demoted_at: None,
            retired_at: None,
            material: Some(KeyMaterial::from_bytes(root_key(id))),
        }],
    })
    .unwrap()
}

fn generate() -> Value {
    let vectors: Vec<Value> = INPUTS
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let digest = params_digest(v.params_json).unwrap();
            let binding = Binding {
                tenant: Tenant::new(v.tenant),
                subject: v.subject.into(),
                method: v.method,
                params: digest,
                version: stateseal::binding::BindingVersion::V1,
            };
            let ring = keyring_for(v.key_id);
            let keys = ring.primary().tenant_keys(&binding.tenant);
            let header = Header {
                key_id: ring.primary().id(),
                expires_at: v.expires_at,
                single_use: v.single_use,
                binding: stateseal::binding::BindingVersion::V1,
                manifest: false,
            };
            let token = seal_with_nonce(&keys, header, &binding, v.state, &nonce(i)).unwrap();
            // Every vector opens, and gives back its state.
            let opened = UntrustedToken::parse(&token, 1 << 16)
                .unwrap()
                .open(&keys, &binding)
                .unwrap();
            assert_eq!(&opened.state[..], v.state);
            json!({
                "name": v.name,
                "root_key_hex": hex(&root_key(v.key_id)),
                "key_id": v.key_id,
                "tenant": v.tenant,
                "subject": v.subject,
                "method": v.method.as_str(),
                "params_json": v.params_json,
                "params_digest_hex": hex(&digest.0),
                "state_hex": hex(v.state),
                "expires_at": v.expires_at,
                "single_use": v.single_use,
                "nonce_hex": hex(&nonce(i)),
                "ledger_id_hex": hex(&opened.ledger_id(&keys)),
                "token": token,
            })
        })
        .collect();
    json!({
        "format": "stateseal token v1 (see docs/token-format.md)",
        "vectors": vectors,
    })
}

#[test]
fn golden_vectors_match() {
    let path = format!("{}/tests/data/golden.json", env!("CARGO_MANIFEST_DIR"));
    let generated = serde_json::to_string_pretty(&generate()).unwrap() + "\n";
    if std::env::var_os("STATESEAL_REGENERATE_GOLDEN").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let stored = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}; regenerate with STATESEAL_REGENERATE_GOLDEN=1"));
    assert_eq!(
        stored, generated,
        "the token format or key derivation changed"
    );
}
