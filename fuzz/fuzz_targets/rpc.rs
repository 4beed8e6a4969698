//! SealRequest / OpenRequest bytes decoded with prost and run through the
//! domain (binding, seal, precheck, open on an in-memory ledger): never a
//! panic; every refusal is one of the fixed reasons.
#![no_main]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use prost::Message;
use stateseal::internals::binding::Tenant;
use stateseal::internals::clock::ManualClock;
use stateseal::internals::keyring::{Keyring, KeyringHandle, KeysetFile};
use stateseal::internals::ledger::{Consumed, Held, LeaseAsk, Ledger, LedgerError, LedgerKey, Reserved};
use stateseal::proto::{binding::Params, OpenRequest, SealRequest};
use stateseal::internals::sealer::{BindingInput, Limits, ParamsInput, Sealer};

/// An in-memory ledger, emptied at the start of every fuzz input (never in
/// the middle of one: that would make a consumed key consumable again).
#[derive(Default)]
struct MemLedger(Mutex<HashMap<[u8; 40], Option<[u8; 16]>>>);

impl MemLedger {
    fn clear(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// No clock of its own: the guard's monotonic anchor.
impl stateseal::internals::clock::guard::Reference for MemLedger {}

#[async_trait::async_trait]
impl Ledger for MemLedger {
    async fn consume_as(
        &self,
        key: &LedgerKey,
        attempt: Option<[u8; 16]>,
    ) -> Result<Consumed, LedgerError> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        Ok(match map.get(&key.to_bytes()) {
            None => {
                map.insert(key.to_bytes(), attempt);
                Consumed::Now
            }
            Some(a) if attempt.is_some() && *a == attempt => Consumed::Again,
            Some(_) => Consumed::Before,
        })
    }
    // This target opens with OPEN_MODE_CONSUME only; the reservation path is
    // covered by tests/ledger_contract.rs and tests/at_most_once.rs.
    async fn reserve(&self, _: &LedgerKey, _: LeaseAsk, _: u64) -> Result<Reserved, LedgerError> {
        Err(LedgerError("reservations are not fuzzed".into()))
    }
    async fn renew(
        &self,
        _: &LedgerKey,
        _: [u8; 16],
        _: u32,
        _: u64,
        _: u64,
    ) -> Result<Held, LedgerError> {
        Err(LedgerError("reservations are not fuzzed".into()))
    }
    async fn commit(&self, _: &LedgerKey, _: [u8; 16]) -> Result<Held, LedgerError> {
        Err(LedgerError("reservations are not fuzzed".into()))
    }
    async fn release(&self, _: &LedgerKey, _: [u8; 16]) -> Result<(), LedgerError> {
        Err(LedgerError("reservations are not fuzzed".into()))
    }
    async fn ready(&self) -> bool {
        true
    }
    async fn remove_expired(&self, _: u64, _: usize) -> Result<usize, LedgerError> {
        Ok(0)
    }
    async fn close(&self) -> Result<(), LedgerError> {
        Ok(())
    }
    fn backend(&self) -> &'static str {
        "memory"
    }
}

type World = (Sealer, Arc<MemLedger>, tokio::runtime::Runtime);

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let ring = Keyring::from_file(&KeysetFile::generate(1_900_000_000)).expect("keyring");
        let ledger = Arc::new(MemLedger::default());
        let sealer = Sealer::new(
            Arc::new(KeyringHandle::new(ring)),
            ledger.clone(),
            Arc::new(ManualClock::new(1_900_000_000)),
            Limits::default(),
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        (sealer, ledger, rt)
    })
}

fn input(b: &Option<stateseal::proto::Binding>) -> Option<BindingInput<'_>> {
    let b = b.as_ref()?;
    Some(BindingInput {
        version: stateseal::internals::binding::BindingVersion::from_wire(b.binding_version).ok()?,
        subject: &b.subject,
        method: &b.method,
        params: b.params.as_ref().map(|p| match p {
            Params::ParamsDigest(d) => ParamsInput::Digest(d),
            Params::ParamsJson(j) => ParamsInput::Json(j),
        }),
    })
}

fuzz_target!(|data: &[u8]| {
    let (sealer, ledger, rt) = world();
    ledger.clear();
    let tenant = Tenant::new("t");
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    if which % 2 == 0 {
        let Ok(req) = SealRequest::decode(rest) else {
            return;
        };
        let Some(b) = input(&req.binding) else { return };
        let Ok(binding) = sealer.binding(&tenant, b) else {
            return;
        };
        if let Ok(s) = sealer.seal(&binding, &req.state, req.ttl_seconds, req.single_use) {
            // What was sealed opens, once when single-use, with its state.
            let o = rt
                .block_on(sealer.open(&binding, &s.token))
                .expect("own token opens");
            assert_eq!(&o.state[..], &req.state[..]);
            assert_eq!(o.consumed, req.single_use);
            let again = rt.block_on(sealer.open(&binding, &s.token));
            assert_eq!(again.is_ok(), !req.single_use);
        }
    } else {
        let Ok(req) = OpenRequest::decode(rest) else {
            return;
        };
        let Ok(untrusted) = sealer.precheck(&req.request_state) else {
            return;
        };
        let Some(b) = input(&req.binding) else { return };
        let Ok(binding) = sealer.binding(&tenant, b) else {
            return;
        };
        // A request the fuzzer built cannot hold a token this key sealed.
        assert!(rt
            .block_on(sealer.open_checked(&binding, untrusted))
            .is_err());
    }
});
