//! Golden token vectors: the wire format and the key derivation are frozen.
//! This test regenerates every vector from its inputs and compares it with
//! tests/data/golden.json. After an intended format change, regenerate with
//! `STATESEAL_REGENERATE_GOLDEN=1 cargo test --test it golden::` and review the diff.
#![allow(clippy::unwrap_used)]

use crate::common::hex;
use serde_json::{json, Value};
use stateseal::internals::binding::{params_digest, Binding, Method, Tenant};
use stateseal::internals::keyring::{
    KeyMaterial, KeyRecord, KeyState, Keyring, KeysetFile, KEYSET_FORMAT,
};
use stateseal::internals::token::{seal, Header, Nonce, UntrustedToken};

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
        kek: None,
        keyset_id: None,
        keys: vec![KeyRecord {
            id,
            state: KeyState::Primary,
            created_at: 0,
            promoted_at: Some(0),
            demoted_at: None,
            retired_at: None,
            material: Some(KeyMaterial::from_bytes(root_key(id))),
            wrapped: None,
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
                version: stateseal::internals::binding::BindingVersion::V1,
            };
            let ring = keyring_for(v.key_id);
            let keys = ring.primary().tenant_keys(&binding.tenant);
            let header = Header {
                key_id: ring.primary().id(),
                expires_at: v.expires_at,
                single_use: v.single_use,
                binding: stateseal::internals::binding::BindingVersion::V1,
                manifest: false,
            };
            let token = seal(
                &keys,
                header,
                &binding,
                None,
                v.state,
                Nonce::Fixed(&nonce(i)),
            )
            .unwrap();
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

/// Today's formats, frozen (tests/data/golden-v2.json): binding v2 with
/// exact numbers, single use, format 2 with a sealed manifest (and one of
/// no questions), and a
/// reservation string. Tokens regenerate byte for byte (fixed nonces); the
/// reservation string is sealed under a random nonce, so the stored one
/// must open, under the stored key and tenant, to the stored claims.
struct InputV2 {
    name: &'static str,
    method: Method,
    params_json: &'static str,
    state: &'static [u8],
    single_use: bool,
    input_requests: Option<&'static str>,
}

const INPUTS_V2: [InputV2; 4] = [
    InputV2 {
        name: "v2 tools/call single-use, exact numbers",
        method: Method::ToolsCall,
        params_json: r#"{"name":"transfer","arguments":{"amount":9007199254740993,"fee":1.10},"_meta":{"progressToken":"p"},"requestState":"x","inputResponses":{}}"#,
        state: b"{\"step\":2}",
        single_use: true,
        input_requests: None,
    },
    InputV2 {
        name: "v2 format 2: a sealed manifest",
        method: Method::ToolsCall,
        params_json: r#"{"name":"transfer","arguments":{"amount":42}}"#,
        state: b"{\"step\":1}",
        single_use: true,
        input_requests: Some(
            r#"{"confirm":{"method":"elicitation/create","params":{"mode":"form","message":"Transfer 42?","requestedSchema":{"type":"object","properties":{"confirm":{"type":"boolean"},"note":{"type":"string","maxLength":40},"n":{"type":"integer","minimum":1,"maximum":9007199254740993}},"required":["confirm"]}}},"site":{"method":"elicitation/create","params":{"mode":"url","message":"Sign in","url":"https://auth.example.com/start"}}}"#,
        ),
    },
    InputV2 {
        name: "v2 resources/read reusable",
        method: Method::ResourcesRead,
        params_json: r#"{"uri":"file:///tmp/x","_meta":{}}"#,
        state: b"",
        single_use: false,
        input_requests: None,
    },
    // A round that asked nothing ("still working, call again"): a manifest
    // of no questions, which drops every answer.
    InputV2 {
        name: "v2 format 2: a round that asked nothing",
        method: Method::ToolsCall,
        params_json: r#"{"name":"close_account","arguments":{}}"#,
        state: b"{\"step\":3}",
        single_use: true,
        input_requests: Some("{}"),
    },
];

fn generate_v2(reservation: Option<&Value>) -> Value {
    use stateseal::internals::binding::{params_digest_for, BindingVersion};
    use stateseal::internals::manifest::{CredentialPolicy, Manifest};
    use stateseal::internals::token::{seal_reservation, ReservationClaims, SealedReservation};
    let ring = keyring_for(7);
    let tenant = Tenant::new("acme");
    let keys = ring.primary().tenant_keys(&tenant);
    let vectors: Vec<Value> = INPUTS_V2
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let digest = params_digest_for(BindingVersion::V2, v.method, v.params_json).unwrap();
            let binding = Binding {
                tenant: tenant.clone(),
                subject: "mcp:alice".into(),
                method: v.method,
                params: digest,
                version: BindingVersion::V2,
            };
            let manifest = v.input_requests.map(|q| {
                Manifest::build(q, CredentialPolicy::Deny)
                    .unwrap()
                    .0
                    .encode()
                    .unwrap()
            });
            let header = Header {
                key_id: ring.primary().id(),
                expires_at: 1_900_000_600,
                single_use: v.single_use,
                binding: BindingVersion::V2,
                manifest: manifest.is_some(),
            };
            let token = seal(
                &keys,
                header,
                &binding,
                manifest.as_deref(),
                v.state,
                Nonce::Fixed(&nonce(10 + i)),
            )
            .unwrap();
            let opened = UntrustedToken::parse(&token, 1 << 16)
                .unwrap()
                .open(&keys, &binding)
                .unwrap();
            assert_eq!(&opened.state[..], v.state);
            assert_eq!(
                opened.manifest.as_deref().map(|m| &m[..]),
                manifest.as_deref()
            );
            json!({
                "name": v.name,
                "method": v.method.as_str(),
                "params_json": v.params_json,
                "params_digest_v2_hex": hex(&digest.0),
                "state_hex": hex(v.state),
                "single_use": v.single_use,
                "input_requests_json": v.input_requests,
                "manifest_hex": manifest.as_deref().map(hex),
                "nonce_hex": hex(&nonce(10 + i)),
                "ledger_id_hex": hex(&opened.ledger_id(&keys)),
                "token": token,
            })
        })
        .collect();
    let claims = ReservationClaims {
        expires_at: 1_900_000_600,
        ledger_id: [0x5a; 32],
        rid: [0x3c; 16],
        lease_until: 1_900_000_030,
    };
    let reservation = match reservation {
        // The stored string must still open to these claims.
        Some(Value::String(r)) => {
            let c = SealedReservation::parse(r)
                .and_then(|sealed| sealed.open(&keys, tenant.as_str()))
                .expect("the stored reservation opens");
            assert_eq!(
                (c.expires_at, c.ledger_id, c.rid, c.lease_until),
                (
                    claims.expires_at,
                    claims.ledger_id,
                    claims.rid,
                    claims.lease_until
                ),
                "the reservation format changed"
            );
            r.clone()
        }
        _ => seal_reservation(&keys, ring.primary().id(), tenant.as_str(), &claims).unwrap(),
    };
    json!({
        "format": "stateseal token v2 / format 2 and reservation strings (see docs/token-format.md)",
        "root_key_hex": hex(&root_key(7)),
        "key_id": 7,
        "tenant": "acme",
        "subject": "mcp:alice",
        "expires_at": 1_900_000_600,
        "vectors": vectors,
        "reservation": {
            "expires_at": claims.expires_at,
            "ledger_id_hex": hex(&claims.ledger_id),
            "rid_hex": hex(&claims.rid),
            "lease_until": claims.lease_until,
            "string": reservation,
        },
    })
}

#[test]
fn golden_vectors_of_todays_formats_match() {
    let path = format!("{}/tests/data/golden-v2.json", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("STATESEAL_REGENERATE_GOLDEN").is_some() {
        let generated = serde_json::to_string_pretty(&generate_v2(None)).unwrap() + "\n";
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let stored = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}; regenerate with STATESEAL_REGENERATE_GOLDEN=1"));
    let stored_json: Value = serde_json::from_str(&stored).unwrap();
    let generated =
        serde_json::to_string_pretty(&generate_v2(Some(&stored_json["reservation"]["string"])))
            .unwrap()
            + "\n";
    assert_eq!(
        stored, generated,
        "the token format, binding v2, the manifest encoding or key derivation changed"
    );
}
