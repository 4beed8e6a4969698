//! SealRequest / OpenRequest bytes decoded with prost and served by the
//! gRPC service itself (the path the server runs: binding, canonicalization
//! pool, manifest, seal, precheck, open), over an in-memory ledger: never a
//! panic; every refusal is one of the fixed reasons; what seals opens.
#![no_main]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use prost::Message;
use stateseal::internals::binding::Tenant;
use stateseal::internals::canon_pool::CanonPool;
use stateseal::internals::clock::ManualClock;
use stateseal::internals::error::Reject;
use stateseal::internals::keyring::{Keyring, KeyringHandle, KeysetFile};
use stateseal::internals::ledger::{
    Consumed, Held, LeaseAsk, Ledger, LedgerError, LedgerKey, Reserved,
};
use stateseal::internals::metrics::Metrics;
use stateseal::internals::sealer::{Limits, Sealer};
use stateseal::internals::service::RequestStateService;
use stateseal::proto::request_state_server::RequestState;
use stateseal::proto::{OpenRequest, SealRequest};

/// An in-memory ledger, emptied at the start of every fuzz input (never in
/// the middle of one: that would make a consumed key consumable again).
#[derive(Default)]
struct MemLedger(Mutex<HashMap<[u8; 40], Option<[u8; 16]>>>);

impl MemLedger {
    fn clear(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// This target opens with OPEN_MODE_CONSUME only; the reservation path is
/// covered by tests/it/ledger_contract.rs and tests/it/at_most_once.rs.
const NOT_FUZZED: LedgerError = LedgerError::Corrupt("reservations are not fuzzed");

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
    async fn reserve(&self, _: &LedgerKey, _: LeaseAsk) -> Result<Reserved, LedgerError> {
        Err(NOT_FUZZED)
    }
    async fn renew(&self, _: &LedgerKey, _: [u8; 16], _: u32, _: u64) -> Result<Held, LedgerError> {
        Err(NOT_FUZZED)
    }
    async fn commit(&self, _: &LedgerKey, _: [u8; 16]) -> Result<Held, LedgerError> {
        Err(NOT_FUZZED)
    }
    async fn release(&self, _: &LedgerKey, _: [u8; 16]) -> Result<(), LedgerError> {
        Err(NOT_FUZZED)
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

type World = (RequestStateService, Arc<MemLedger>, tokio::runtime::Runtime);

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
        let svc = RequestStateService::new(
            Arc::new(sealer),
            Arc::new(CanonPool::new(1, 4, Arc::default())),
            Arc::new(Metrics::new()),
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        (svc, ledger, rt)
    })
}

/// A request as the authentication layer hands it on: with its tenant.
fn as_tenant<T>(msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.extensions_mut().insert(Tenant::new("t"));
    req
}

fn assert_fixed_reason(s: &tonic::Status) {
    let reason = stateseal::internals::status::reason_of(s).expect("a reason");
    assert!(Reject::ALL.iter().any(|r| r.reason() == reason), "{reason}");
}

fuzz_target!(|data: &[u8]| {
    let (svc, ledger, rt) = world();
    ledger.clear();
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    if which % 2 == 0 {
        let Ok(req) = SealRequest::decode(rest) else {
            return;
        };
        match rt.block_on(svc.seal(as_tenant(req.clone()))) {
            Ok(sealed) => {
                // What was sealed opens, once when single-use, with its state.
                let open = OpenRequest {
                    request_state: sealed.into_inner().request_state,
                    binding: req.binding.clone(),
                    ..Default::default()
                };
                let o = rt
                    .block_on(svc.open(as_tenant(open.clone())))
                    .expect("own token opens")
                    .into_inner();
                assert_eq!(o.state, req.state);
                assert_eq!(o.consumed, req.single_use);
                let again = rt.block_on(svc.open(as_tenant(open)));
                assert_eq!(again.is_ok(), !req.single_use);
            }
            Err(s) => assert_fixed_reason(&s),
        }
    } else {
        let Ok(req) = OpenRequest::decode(rest) else {
            return;
        };
        // A request the fuzzer built cannot hold a token this key sealed.
        let e = rt
            .block_on(svc.open(as_tenant(req)))
            .expect_err("a fuzzed token never opens");
        assert_fixed_reason(&e);
    }
});
