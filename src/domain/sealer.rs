//! The domain core: seal and open with limits, binding, expiry and single
//! use. No gRPC here; `service.rs` maps the wire to these calls.

use std::sync::Arc;

use zeroize::Zeroizing;

use crate::clock::guard::TimeGuard;
use crate::clock::Clock;
use crate::domain::binding::{Binding, BindingVersion, Method, ParamsDigest, Tenant};
use crate::domain::error::Reject;
use crate::domain::keyring::{KeyId, KeyringHandle};
use crate::domain::token::{self, Header, ReservationClaims, UntrustedToken};
use crate::ledger::{
    Consumed, Held, Lease, LeaseAsk, LeaseEnd, Ledger, LedgerKey, Reserved, TenantTag,
};

/// Configured bounds. Every input is checked against these before any work
/// proportional to its size.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest state a token may carry, in bytes.
    pub max_state: usize,
    /// Largest `params_json`, in bytes.
    pub max_params_json: usize,
    /// Longest subject, in bytes.
    pub max_subject: usize,
    /// TTL used when a seal asks for 0.
    pub default_ttl: u32,
    /// Largest TTL a seal may ask for.
    pub max_ttl: u32,
    /// How long after expiry ledger records are kept, to cover clock skew
    /// between replicas sharing a ledger.
    pub clock_skew: u64,
    /// Lease of a reservation that asks for 0 seconds, and the largest.
    pub default_lease: u32,
    pub max_lease: u32,
    /// Largest `input_requests_json` / `input_responses_json`, in bytes.
    pub max_input_json: usize,
    /// What Seal does with a form field that asks for a credential.
    pub credential_policy: crate::domain::manifest::CredentialPolicy,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_state: 64 * 1024,
            max_params_json: 1024 * 1024,
            max_subject: 1024,
            default_ttl: 600,
            max_ttl: 3600,
            clock_skew: 60,
            default_lease: 30,
            max_lease: 300,
            max_input_json: 256 * 1024,
            credential_policy: crate::domain::manifest::CredentialPolicy::Deny,
        }
    }
}

pub struct Sealed {
    pub token: String,
    pub expires_at: u64,
    pub key_id: KeyId,
}

impl std::fmt::Debug for Sealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealed")
            .field("token_len", &self.token.len())
            .field("expires_at", &self.expires_at)
            .field("key_id", &self.key_id)
            .finish()
    }
}

/// What Open returns. The state is zeroized on drop, up to the gRPC edge
/// (where it moves into the response message).
pub struct OpenedState {
    pub state: Zeroizing<Vec<u8>>,
    /// The sealed manifest of the questions, if the token has one.
    pub manifest: Option<Zeroizing<Vec<u8>>>,
    pub expires_at: u64,
    pub key_id: KeyId,
    /// This call consumed a single-use token.
    pub consumed: bool,
    /// OPEN_MODE_RESERVE on a single-use token: the reservation string and
    /// its lease.
    pub reservation: Option<(String, LeaseEnd)>,
}

impl std::fmt::Debug for OpenedState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedState")
            .field("state_len", &self.state.len())
            .field("expires_at", &self.expires_at)
            .field("key_id", &self.key_id)
            .field("consumed", &self.consumed)
            .field("reserved", &self.reservation.is_some())
            .finish()
    }
}

/// What one decision touched, as far as the sealer got before it decided:
/// the key id (once the token or reservation named a key in force) and the
/// ledger id (once it was authenticated). The audit log records digests of
/// them; nothing here is secret, and `Debug` shows presence only.
#[derive(Clone, Copy, Default)]
pub struct Trail {
    pub key_id: Option<KeyId>,
    pub ledger_id: Option<[u8; 32]>,
}

impl std::fmt::Debug for Trail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trail")
            .field("key_id", &self.key_id)
            .field("ledger_id", &self.ledger_id.is_some())
            .finish()
    }
}

/// What the sealer reports of its ledger rounds. The metrics implement it
/// and are handed down from the composition root, so the core names no
/// registry.
pub trait LedgerFigures: Send + Sync {
    /// A consumption, reservation or commit round: how long the ledger
    /// took, whether it answered, and whether a token was consumed.
    fn ledger_round(&self, took: std::time::Duration, answered: bool, consumed: bool);
    /// A Commit or Renew of a reservation that no longer held its token.
    fn lease_lost(&self);
}

/// Reports nothing: for tools, tests and benches that keep no metrics.
#[derive(Debug)]
pub struct Unobserved;

impl LedgerFigures for Unobserved {
    fn ledger_round(&self, _: std::time::Duration, _: bool, _: bool) {}
    fn lease_lost(&self) {}
}

pub struct Sealer {
    keys: Arc<KeyringHandle>,
    ledger: Arc<dyn Ledger>,
    clock: Arc<dyn Clock>,
    limits: Limits,
    guard: Arc<TimeGuard>,
    figures: Arc<dyn LedgerFigures>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("ledger", &self.ledger.backend())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Sealer {
    pub fn new(
        keys: Arc<KeyringHandle>,
        ledger: Arc<dyn Ledger>,
        clock: Arc<dyn Clock>,
        limits: Limits,
    ) -> Self {
        Sealer {
            keys,
            ledger,
            clock,
            limits,
            guard: TimeGuard::always_synced(),
            figures: Arc::new(Unobserved),
        }
    }

    /// Reports ledger rounds and lost leases to `figures`.
    pub fn with_figures(mut self, figures: Arc<dyn LedgerFigures>) -> Self {
        self.figures = figures;
        self
    }

    /// Refuses to seal and open while `guard` says the clock disagrees with
    /// the reference.
    pub fn with_guard(mut self, guard: Arc<TimeGuard>) -> Self {
        self.guard = guard;
        self
    }

    pub fn guard(&self) -> &Arc<TimeGuard> {
        &self.guard
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }
    pub fn ledger(&self) -> &Arc<dyn Ledger> {
        &self.ledger
    }
    pub fn keys(&self) -> &Arc<KeyringHandle> {
        &self.keys
    }
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The cheap checks of a binding: subject and method.
    pub fn check_binding(&self, subject: &str, method: &str) -> Result<Method, Reject> {
        if subject.len() > self.limits.max_subject {
            return Err(Reject::TooLarge);
        }
        if subject.is_empty() {
            return Err(Reject::Malformed);
        }
        Method::parse(method)
    }

    /// The size bound of `params_json`.
    pub fn check_params_json(&self, json: &str) -> Result<(), Reject> {
        if json.len() > self.limits.max_params_json {
            return Err(Reject::TooLarge);
        }
        Ok(())
    }

    /// A binding from parts that passed [`Sealer::check_binding`] and a
    /// computed digest.
    pub fn bind(
        &self,
        tenant: &Tenant,
        subject: String,
        method: Method,
        params: ParamsDigest,
        version: BindingVersion,
    ) -> Binding {
        Binding {
            tenant: tenant.clone(),
            subject,
            method,
            params,
            version,
        }
    }

    /// Seals `state` under the primary key, and the encoded manifest of the
    /// questions when given. The one way to seal.
    pub fn seal(
        &self,
        binding: &Binding,
        state: &[u8],
        ttl_seconds: u32,
        single_use: bool,
        manifest: Option<&[u8]>,
    ) -> Result<Sealed, Reject> {
        if state.len() > self.limits.max_state {
            return Err(Reject::TooLarge);
        }
        if !self.guard.synced() {
            return Err(Reject::ClockUnsynced);
        }
        let ttl = match ttl_seconds {
            0 => self.limits.default_ttl,
            t if t > self.limits.max_ttl => return Err(Reject::TooLarge),
            t => t,
        };
        let expires_at = self.clock.now_unix() + u64::from(ttl);
        let expires_at_u32 = u32::try_from(expires_at).map_err(|_| Reject::TooLarge)?;
        let ring = self.keys.current();
        let key = ring.primary();
        let header = Header {
            key_id: key.id(),
            expires_at: expires_at_u32,
            single_use,
            binding: binding.version,
            manifest: manifest.is_some(),
        };
        let token = token::seal(
            &key.tenant_keys(&binding.tenant),
            header,
            binding,
            manifest,
            state,
            token::Nonce::Fresh,
        )?;
        Ok(Sealed {
            token,
            expires_at,
            key_id: key.id(),
        })
    }

    /// The checks of a token that need no binding: size, encoding, header,
    /// and a key in force for its key id. Cheap; run before any work
    /// proportional to the params.
    pub fn precheck(&self, token: &str) -> Result<UntrustedToken, Reject> {
        let untrusted = UntrustedToken::parse(token, self.limits.max_state)?;
        if self.keys.current().get(untrusted.header().key_id).is_none() {
            return Err(Reject::UnknownKey);
        }
        Ok(untrusted)
    }

    /// Opens a token that passed [`Sealer::precheck`]; a single-use token is
    /// consumed, or reserved, as `mode` says. With `attempt_id`, the same
    /// attempt opening again gets the same success (consumed again, or the
    /// reservation it holds) instead of REPLAYED / IN_USE. The one way to
    /// open.
    pub async fn open(
        &self,
        binding: &Binding,
        untrusted: UntrustedToken,
        mode: OpenMode,
        attempt_id: Option<&str>,
        trail: &mut Trail,
    ) -> Result<OpenedState, Reject> {
        if attempt_id.is_some_and(|a| a.len() > MAX_ATTEMPT_ID) {
            return Err(Reject::TooLarge);
        }
        if !self.guard.synced() {
            return Err(Reject::ClockUnsynced);
        }
        let key_id = untrusted.header().key_id;
        trail.key_id = Some(key_id);
        let tenant_keys = {
            let ring = self.keys.current();
            let key = ring.get(key_id).ok_or(Reject::UnknownKey)?;
            key.tenant_keys(&binding.tenant)
        };
        // Authenticate before trusting anything in the header.
        let opened = untrusted.open(&tenant_keys, binding)?;
        let expires_at = u64::from(opened.header.expires_at);
        let now = self.clock.now_unix();
        if now >= expires_at {
            return Err(Reject::Expired);
        }
        let mut consumed = false;
        let mut reservation = None;
        let attempt = attempt_id
            .filter(|a| !a.is_empty())
            .map(|a| token::attempt_hash(&tenant_keys, a));
        if opened.header.single_use {
            let key = LedgerKey {
                expires_at,
                id: opened.ledger_id(&tenant_keys),
                tenant: TenantTag::of(binding.tenant.as_str()),
            };
            trail.ledger_id = Some(key.id);
            let started = std::time::Instant::now();
            let outcome = match mode {
                OpenMode::Consume => self.ledger.consume_as(&key, attempt).await.map(Ok),
                OpenMode::Reserve { lease_seconds } => {
                    let mut rid = [0u8; 16];
                    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut rid);
                    let ask = LeaseAsk {
                        rid,
                        attempt,
                        seconds: self.lease_seconds(lease_seconds),
                        cap: self.lease_cap(expires_at),
                    };
                    self.ledger.reserve(&key, ask).await.map(Err)
                }
            };
            self.figures.ledger_round(
                started.elapsed(),
                outcome.is_ok(),
                matches!(outcome, Ok(Ok(Consumed::Now))),
            );
            let outcome = match outcome {
                Ok(o) => o,
                Err(e) => {
                    tracing::warn!(error = %e, backend = self.ledger.backend(), "ledger failed; failing closed");
                    return Err(Reject::LedgerUnavailable);
                }
            };
            let accepted = matches!(
                outcome,
                Ok(Consumed::Now | Consumed::Again) | Err(Reserved::Now(_) | Reserved::Again(_))
            );
            // Re-checked after the ledger decided: a decision that came
            // late (a stalled disk or database) is not an acceptance.
            if accepted && self.clock.now_unix() >= expires_at {
                tracing::warn!("consumption decided after the token expired; refused");
                return Err(Reject::Expired);
            }
            match outcome {
                // Consumed now, or by the same attempt before: the same success.
                Ok(Consumed::Now | Consumed::Again) => consumed = true,
                Err(Reserved::Now(lease) | Reserved::Again(lease)) => {
                    reservation = Some(self.reservation_string(
                        &tenant_keys,
                        key_id,
                        binding,
                        &key,
                        lease,
                    )?);
                }
                Ok(Consumed::Before) | Err(Reserved::Before) => return Err(Reject::Replayed),
                Ok(Consumed::PastHorizon) | Err(Reserved::PastHorizon) => {
                    return Err(Reject::Expired)
                }
                Ok(Consumed::InUse) | Err(Reserved::InUse) => return Err(Reject::InUse),
                Ok(Consumed::Full) | Err(Reserved::Full) => return Err(Reject::Overloaded),
            }
        }
        Ok(OpenedState {
            state: opened.state,
            manifest: opened.manifest,
            expires_at,
            key_id,
            consumed,
            reservation,
        })
    }

    /// The lease a reservation or renewal asking for `asked` seconds gets.
    fn lease_seconds(&self, asked: u32) -> u32 {
        match asked {
            0 => self.limits.default_lease,
            s => s.min(self.limits.max_lease),
        }
    }

    /// The latest a lease may end: never past the token's own life plus
    /// the skew its ledger record is kept for.
    fn lease_cap(&self, expires_at: u64) -> u64 {
        expires_at + self.limits.clock_skew
    }

    /// The reservation string of `lease` on `key`, and the lease.
    fn reservation_string(
        &self,
        tenant_keys: &crate::domain::keyring::TenantKeys,
        key_id: KeyId,
        binding: &Binding,
        key: &LedgerKey,
        lease: Lease,
    ) -> Result<(String, LeaseEnd), Reject> {
        let claims = ReservationClaims {
            expires_at: key.expires_at,
            ledger_id: key.id,
            rid: lease.rid,
            lease_until: lease.end.until,
        };
        let r = token::seal_reservation(tenant_keys, key_id, binding.tenant.as_str(), &claims)?;
        Ok((r, lease.end))
    }

    /// Opens a reservation string of `tenant`: its claims and ledger key.
    fn reservation(
        &self,
        tenant: &Tenant,
        r: &str,
        trail: &mut Trail,
    ) -> Result<(ReservationClaims, LedgerKey), Reject> {
        // Decoded once: the key id picks the key, which opens the rest.
        let sealed = token::SealedReservation::parse(r)?;
        trail.key_id = Some(sealed.key_id());
        let keys = {
            let ring = self.keys.current();
            let key = ring.get(sealed.key_id()).ok_or(Reject::UnknownKey)?;
            key.tenant_keys(tenant)
        };
        let c = sealed.open(&keys, tenant.as_str())?;
        let key = LedgerKey {
            expires_at: c.expires_at,
            id: c.ledger_id,
            tenant: TenantTag::of(tenant.as_str()),
        };
        trail.ledger_id = Some(key.id);
        Ok((c, key))
    }

    /// Makes a reservation a durable consumption while it still holds the
    /// token: its lease may have ended, as long as no other attempt took
    /// the token over (then `LEASE_EXPIRED`: its handler ran, and another
    /// may have; logged and counted).
    ///
    /// Not refused while the clock guard disagrees: a Commit reads no clock,
    /// and refusing it would let the lease lapse under a handler that ran.
    pub async fn commit(
        &self,
        tenant: &Tenant,
        reservation: &str,
        trail: &mut Trail,
    ) -> Result<(), Reject> {
        let (c, key) = self.reservation(tenant, reservation, trail)?;
        let started = std::time::Instant::now();
        let outcome = self.ledger.commit(&key, c.rid).await;
        self.figures.ledger_round(
            started.elapsed(),
            outcome.is_ok(),
            matches!(outcome, Ok(Held::Yes(_))),
        );
        self.held(tenant, "commit", outcome).map(|_| ())
    }

    /// Extends a reservation's lease while its handler runs: to
    /// `lease_seconds` (0 = the default) from the ledger's reference clock,
    /// capped as at Open. `LEASE_EXPIRED` once another attempt took the
    /// token over.
    pub async fn renew(
        &self,
        tenant: &Tenant,
        reservation: &str,
        lease_seconds: u32,
        trail: &mut Trail,
    ) -> Result<LeaseEnd, Reject> {
        // Not refused while the clock guard disagrees either: a refused
        // renewal certainly lets the lease lapse under a running handler,
        // and the ledger judges the renewal by its own clock, which no step
        // of this replica's wall clock moves (the database's on PostgreSQL,
        // a monotonic one on sled).
        let (c, key) = self.reservation(tenant, reservation, trail)?;
        let outcome = self
            .ledger
            .renew(
                &key,
                c.rid,
                self.lease_seconds(lease_seconds),
                self.lease_cap(c.expires_at),
            )
            .await;
        self.held(tenant, "renew", outcome)?
            .ok_or(Reject::LedgerUnavailable)
    }

    /// A commit's or renewal's outcome as the caller sees it.
    fn held(
        &self,
        tenant: &Tenant,
        rpc: &'static str,
        outcome: Result<Held, crate::ledger::LedgerError>,
    ) -> Result<Option<LeaseEnd>, Reject> {
        match outcome {
            Ok(Held::Yes(end)) => Ok(end),
            Ok(Held::Lost) => {
                self.figures.lease_lost();
                tracing::warn!(
                    tenant = tenant.as_str(),
                    rpc,
                    "reservation lost: another attempt took the token over after its lease \
                     ended, or it was released or collected; its handler may run twice"
                );
                Err(Reject::LeaseExpired)
            }
            Err(e) => {
                tracing::warn!(error = %e, backend = self.ledger.backend(), "ledger failed; failing closed");
                Err(Reject::LedgerUnavailable)
            }
        }
    }

    /// Gives a reservation back (if it still holds the token).
    pub async fn release(
        &self,
        tenant: &Tenant,
        reservation: &str,
        trail: &mut Trail,
    ) -> Result<(), Reject> {
        let (c, key) = self.reservation(tenant, reservation, trail)?;
        self.ledger.release(&key, c.rid).await.map_err(|e| {
            tracing::warn!(error = %e, backend = self.ledger.backend(), "ledger failed on release");
            Reject::LedgerUnavailable
        })
    }
}

/// The longest attempt id accepted, in bytes.
pub const MAX_ATTEMPT_ID: usize = 128;

/// How Open treats a single-use token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// Consume it now.
    Consume,
    /// Reserve it for a lease (0 = the default).
    Reserve { lease_seconds: u32 },
}
