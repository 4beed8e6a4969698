//! The tonic service: proto → domain → proto. No crypto here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::ops::metrics::{Metrics, Rpc};

use tonic::{Request, Response, Status};

use crate::domain::binding::{params_digest_for, Binding, BindingVersion, ParamsDigest, Tenant};
use crate::domain::error::Reject;
use crate::domain::manifest::{Answers, Manifest};
use crate::domain::sealer::{OpenMode, Sealer, Trail};
use crate::domain::token::RESERVATION_CHARS;
use crate::grpc::auth::Caller;
use crate::grpc::canon_pool::CanonPool;
use crate::ops::audit::{Audit, Decision, Method};
use crate::proto::request_state_server::RequestState;
use crate::proto::{self, binding::Params};

#[derive(Debug, Clone)]
pub struct RequestStateService {
    sealer: Arc<Sealer>,
    canon: Arc<CanonPool>,
    metrics: Arc<Metrics>,
    audit: Option<Arc<Audit>>,
}

/// What a decision's audit line says besides its outcome.
struct Asked {
    method: Method,
    caller: Arc<str>,
    mode: Option<&'static str>,
    subject: Option<String>,
    attempt: Option<String>,
}

impl RequestStateService {
    pub fn new(sealer: Arc<Sealer>, canon: Arc<CanonPool>, metrics: Arc<Metrics>) -> Self {
        RequestStateService {
            sealer,
            canon,
            metrics,
            audit: None,
        }
    }

    /// Every decision is recorded in `audit`.
    pub fn with_audit(mut self, audit: Option<Arc<Audit>>) -> Self {
        self.audit = audit;
        self
    }

    /// Before a Seal or an Open: refused while a fail-closed audit log
    /// cannot write. Commit, Renew and Release are not asked: they finish
    /// a handler's work, and refusing them would run it again
    /// ([`Audit::record`] keeps their lines).
    fn admit(&self) -> Result<(), Reject> {
        self.audit.as_ref().map_or(Ok(()), |a| a.admit())
    }

    /// What the audit line will need, taken from the request only when
    /// there is an audit log (the subject and attempt id are copied).
    fn asked<T>(
        &self,
        req: &Request<T>,
        method: Method,
        subject: impl FnOnce(&T) -> Option<String>,
        attempt: impl FnOnce(&T) -> Option<String>,
    ) -> Option<Asked> {
        self.audit.as_ref()?;
        // Copied only within the limits the request is checked against (a
        // longer one is refused TOO_LARGE anyway): the queue holds no
        // attacker-sized strings.
        let bounded = |s: Option<String>, max: usize| s.filter(|s| s.len() <= max);
        let caller = caller_of(req);
        Some(Asked {
            method,
            caller,
            mode: None,
            subject: bounded(subject(req.get_ref()), self.sealer.limits().max_subject),
            attempt: bounded(
                attempt(req.get_ref()),
                crate::domain::sealer::MAX_ATTEMPT_ID,
            ),
        })
    }

    /// Ends a decision: records it in the audit log (with a fail-closed
    /// log, the answer waits for its line, and becomes `AUDIT_UNAVAILABLE`
    /// if it cannot be written), then in the metrics, as answered.
    async fn settle<T>(
        &self,
        rpc: Rpc,
        started: Instant,
        asked: Option<Asked>,
        tenant: &Tenant,
        trail: Trail,
        result: Result<T, Reject>,
    ) -> Result<T, Reject> {
        let result = self.audited(asked, tenant, trail, result).await;
        self.metrics
            .request(rpc, result.as_ref().err().copied(), started.elapsed());
        result
    }

    async fn audited<T>(
        &self,
        asked: Option<Asked>,
        tenant: &Tenant,
        trail: Trail,
        result: Result<T, Reject>,
    ) -> Result<T, Reject> {
        let (Some(audit), Some(a)) = (&self.audit, asked) else {
            return result;
        };
        let refused = result.as_ref().err().copied();
        if refused == Some(Reject::AuditUnavailable) {
            return result; // refused at admission: no line can be written
        }
        let d = Decision {
            method: a.method,
            tenant: tenant.clone(),
            caller: a.caller,
            mode: a.mode,
            subject: a.subject,
            attempt: a.attempt,
            trail,
            refused,
        };
        audit.record(d).await?;
        result
    }

    /// One Commit, audited and counted as such: the Commit RPC's, and each
    /// that an Open carries (`carried`: its audit line says so).
    async fn commit_one(
        &self,
        tenant: &Tenant,
        caller: Option<Arc<str>>,
        reservation: &str,
        carried: bool,
    ) -> Result<(), Reject> {
        let started = Instant::now();
        let asked = caller.map(|caller| Asked {
            method: Method::Commit,
            caller,
            mode: carried.then_some("carried"),
            subject: None,
            attempt: None,
        });
        let mut trail = Trail::default();
        let result = self.sealer.commit(tenant, reservation, &mut trail).await;
        self.settle(Rpc::Commit, started, asked, tenant, trail, result)
            .await
    }

    /// The commits an Open carries: each distinct reservation decided once,
    /// at most [`CARRIED_AT_ONCE`] at a time (one Open holds no more of the
    /// ledger than that beside its own); one outcome per entry, in order.
    async fn carried(
        &self,
        tenant: &Tenant,
        caller: Option<Arc<str>>,
        reservations: &[&str],
    ) -> Vec<proto::CommitOutcome> {
        let mut distinct: Vec<&str> = reservations.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let mut decided = Vec::with_capacity(distinct.len());
        for group in distinct.chunks(CARRIED_AT_ONCE) {
            let each = group
                .iter()
                .map(|r| self.carried_one(tenant, caller.clone(), r));
            decided.extend(futures_util::future::join_all(each).await);
        }
        reservations
            .iter()
            .map(|r| {
                // Always found (`distinct` holds every entry); were it not,
                // "not known to be committed": the caller sends it again.
                distinct
                    .binary_search(r)
                    .ok()
                    .and_then(|at| decided.get(at).cloned())
                    .unwrap_or_else(|| proto::CommitOutcome {
                        reason: Reject::LedgerUnavailable.reason().to_owned(),
                        code: Reject::LedgerUnavailable.code() as i32,
                    })
            })
            .collect()
    }

    async fn carried_one(
        &self,
        tenant: &Tenant,
        caller: Option<Arc<str>>,
        reservation: &str,
    ) -> proto::CommitOutcome {
        let result = self.commit_one(tenant, caller, reservation, true).await;
        log_outcome(tenant, "carried commit", &result);
        match result {
            Ok(()) => proto::CommitOutcome::default(),
            Err(e) => proto::CommitOutcome {
                reason: e.reason().to_owned(),
                code: e.code() as i32,
            },
        }
    }

    /// Checks a received binding and computes its params digest: the cheap
    /// checks first, then the digest (big `params_json` on the bounded
    /// canonicalization pool). `json_version` is the binding version to
    /// compute a `params_json` digest under (the current one to seal; the
    /// token's to open); a `params_digest` carries its own
    /// (`binding_version`).
    async fn binding(
        &self,
        tenant: &Tenant,
        b: Option<proto::Binding>,
        json_version: BindingVersion,
    ) -> Result<Binding, Reject> {
        let b = b.ok_or(Reject::Malformed)?;
        let method = self.sealer.check_binding(&b.subject, &b.method)?;
        let (digest, version) = match b.params {
            None => return Err(Reject::Malformed),
            Some(Params::ParamsDigest(d)) => (
                ParamsDigest::from_slice(&d)?,
                BindingVersion::from_wire(b.binding_version)?,
            ),
            Some(Params::ParamsJson(j)) => {
                self.sealer.check_params_json(&j)?;
                let digest = self
                    .canon
                    .run(j, move |j| params_digest_for(json_version, method, j))
                    .await
                    .map_err(|_| Reject::Overloaded)??;
                (digest, json_version)
            }
        };
        Ok(self.sealer.bind(tenant, b.subject, method, digest, version))
    }
}

impl RequestStateService {
    /// Validates `inputRequests` and encodes its manifest (on the bounded
    /// pool when big); none without questions.
    async fn manifest(&self, json: String) -> Result<Option<Vec<u8>>, Reject> {
        if json.is_empty() {
            return Ok(None);
        }
        let limits = self.sealer.limits();
        if json.len() > limits.max_input_json {
            return Err(Reject::TooLarge);
        }
        let policy = limits.credential_policy;
        let (manifest, warned) = self
            .canon
            .run(json, move |j| Manifest::build(j, policy))
            .await
            .map_err(|_| Reject::Overloaded)??;
        for field in warned {
            // A field name the MCP server chose, not user data.
            tracing::warn!(
                field = field.as_str(),
                "form field looks like a credential; sealed under --credential-fields warn"
            );
        }
        manifest.encode().map(Some)
    }

    /// Checks `inputResponses` before the token is opened, so a malformed
    /// answer never burns a single-use token.
    async fn answers(&self, json: String) -> Result<Option<(Answers, String)>, Reject> {
        if json.is_empty() {
            return Ok(None);
        }
        if json.len() > self.sealer.limits().max_input_json {
            return Err(Reject::TooLarge);
        }
        self.canon
            .run(json, |j| Answers::parse(j).map(|a| Some((a, j.to_owned()))))
            .await
            .map_err(|_| Reject::Overloaded)?
    }
}

/// The answers as Open returns them: filtered against the token's manifest,
/// or as received when it has none.
fn filtered(
    manifest: Option<&[u8]>,
    answers: Option<(Answers, String)>,
) -> Result<(String, Vec<proto::DroppedResponse>), Reject> {
    let Some((answers, raw)) = answers else {
        return Ok((String::new(), Vec::new()));
    };
    let Some(manifest) = manifest else {
        return Ok((raw, Vec::new()));
    };
    let f = Manifest::decode(manifest)?.filter(answers);
    let dropped = f
        .dropped
        .into_iter()
        .map(|(key, why)| proto::DroppedResponse {
            key,
            reason: why.code().to_owned(),
        })
        .collect();
    Ok((f.json, dropped))
}

/// Who called, as the audit log names them.
fn caller_of<T>(req: &Request<T>) -> Arc<str> {
    req.extensions()
        .get::<Caller>()
        .map_or_else(|| Arc::from("none"), |c| c.0.clone())
}

/// The most reservations one Open may carry to commit.
pub const MAX_CARRIED_COMMITS: usize = 16;
/// The longest `OpenRequest.commit`: that many reservations and the commas
/// between them.
const MAX_CARRIED_BYTES: usize = MAX_CARRIED_COMMITS * (RESERVATION_CHARS + 1) - 1;
/// How many of one Open's carried commits are decided at a time.
const CARRIED_AT_ONCE: usize = 4;

/// The reservations an `OpenRequest.commit` names, or `TOO_LARGE` past the
/// bounds (checked on the length before anything is split).
fn carried_list(joined: &str) -> Result<Vec<&str>, Reject> {
    if joined.is_empty() {
        return Ok(Vec::new());
    }
    if joined.len() > MAX_CARRIED_BYTES {
        return Err(Reject::TooLarge);
    }
    let list: Vec<&str> = joined.split(',').take(MAX_CARRIED_COMMITS + 1).collect();
    if list.len() > MAX_CARRIED_COMMITS {
        return Err(Reject::TooLarge);
    }
    Ok(list)
}

/// A process-unique id for the request's log lines.
fn next_request_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The caller's tenant, put there by the authentication layer.
fn tenant_of<T>(req: &Request<T>) -> Result<Tenant, Status> {
    req.extensions()
        .get::<Tenant>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated("caller not authenticated"))
}

#[tonic::async_trait]
impl RequestState for RequestStateService {
    #[tracing::instrument(level = "debug", name = "seal", skip_all, fields(request_id = next_request_id()))]
    async fn seal(
        &self,
        req: Request<proto::SealRequest>,
    ) -> Result<Response<proto::SealResponse>, Status> {
        let started = Instant::now();
        let tenant = tenant_of(&req)?;
        let asked = self.asked(
            &req,
            Method::Seal,
            |r| r.binding.as_ref().map(|b| b.subject.clone()),
            |_| None,
        );
        let mut r = req.into_inner();
        let questions = std::mem::take(&mut r.input_requests_json);
        let result = async {
            self.admit()?;
            let b = self
                .binding(&tenant, r.binding.take(), BindingVersion::CURRENT)
                .await?;
            let manifest = self.manifest(questions).await?;
            self.sealer.seal(
                &b,
                &r.state,
                r.ttl_seconds,
                r.single_use,
                manifest.as_deref(),
            )
        }
        .await;
        let trail = Trail {
            key_id: result.as_ref().ok().map(|s| s.key_id),
            ledger_id: None,
        };
        let result = self
            .settle(Rpc::Seal, started, asked, &tenant, trail, result)
            .await;
        match result {
            Ok(s) => {
                tracing::debug!(
                    tenant = tenant.as_str(),
                    key_id = s.key_id.0,
                    single_use = r.single_use,
                    "sealed"
                );
                Ok(Response::new(proto::SealResponse {
                    request_state: s.token,
                    expires_at_unix: s.expires_at as i64,
                    key_id: s.key_id.to_string(),
                }))
            }
            Err(e) => {
                tracing::debug!(
                    tenant = tenant.as_str(),
                    reason = e.reason(),
                    "seal refused"
                );
                Err(e.into())
            }
        }
    }

    #[tracing::instrument(level = "debug", name = "open", skip_all, fields(request_id = next_request_id()))]
    async fn open(
        &self,
        req: Request<proto::OpenRequest>,
    ) -> Result<Response<proto::OpenResponse>, Status> {
        let started = Instant::now();
        let tenant = tenant_of(&req)?;
        let mut asked = self.asked(
            &req,
            Method::Open,
            |r| r.binding.as_ref().map(|b| b.subject.clone()),
            |r| Some(r.attempt_id.clone()),
        );
        let caller = self.audit.as_ref().map(|_| caller_of(&req));
        let mut r = req.into_inner();
        // Past the bounds the whole call is refused, and none is committed.
        let joined = std::mem::take(&mut r.commit);
        let carried = carried_list(&joined);
        let mode = match proto::OpenMode::try_from(r.mode) {
            Ok(proto::OpenMode::Consume) => Ok(OpenMode::Consume),
            Ok(proto::OpenMode::Reserve) => Ok(OpenMode::Reserve {
                lease_seconds: r.lease_seconds,
            }),
            Err(_) => Err(Reject::Malformed),
        };
        if let (Some(a), Ok(m)) = (asked.as_mut(), &mode) {
            a.mode = Some(match m {
                OpenMode::Consume => "consume",
                OpenMode::Reserve { .. } => "reserve",
            });
        }
        let mut trail = Trail::default();
        // The token's form and key id first: a garbage token costs nothing
        // proportional to the params.
        let opening = async {
            carried.as_ref().map_err(|e| *e)?;
            let mode = mode?;
            self.admit()?;
            let untrusted = self.sealer.precheck(&r.request_state)?;
            let binding = self
                .binding(&tenant, r.binding, untrusted.header().binding)
                .await?;
            let answers = self.answers(r.input_responses_json).await?;
            let o = self
                .sealer
                .open(&binding, untrusted, mode, Some(&r.attempt_id), &mut trail)
                .await?;
            // Infallible for a token this service sealed: the answers were
            // checked above.
            let a = filtered(o.manifest.as_deref().map(|m| &m[..]), answers)?;
            Ok((o, a))
        };
        // The carried commits run beside the opening: on sled both reach
        // the ledger's writer together and usually share its durable round.
        let (result, commits) = tokio::join!(
            opening,
            self.carried(&tenant, caller, carried.as_deref().unwrap_or_default())
        );
        let result = self
            .settle(Rpc::Open, started, asked, &tenant, trail, result)
            .await;
        match result {
            Ok((mut o, (input_responses_json, dropped))) => {
                tracing::debug!(
                    tenant = tenant.as_str(),
                    key_id = o.key_id.0,
                    consumed = o.consumed,
                    reserved = o.reservation.is_some(),
                    "opened"
                );
                let (reservation, lease) = o.reservation.take().unzip();
                Ok(Response::new(proto::OpenResponse {
                    // Moved, not copied: the allocation goes to prost.
                    state: std::mem::take(&mut *o.state),
                    expires_at_unix: o.expires_at as i64,
                    key_id: o.key_id.to_string(),
                    consumed: o.consumed,
                    reservation: reservation.unwrap_or_default(),
                    lease_expires_at_unix: lease.map_or(0, |l| l.until),
                    lease_seconds: lease.map_or(0, |l| l.seconds),
                    input_responses_json,
                    dropped,
                    commits,
                }))
            }
            Err(e) => {
                tracing::debug!(
                    tenant = tenant.as_str(),
                    reason = e.reason(),
                    "open refused"
                );
                Err(e.into())
            }
        }
    }

    #[tracing::instrument(level = "debug", name = "commit", skip_all, fields(request_id = next_request_id()))]
    async fn commit(
        &self,
        req: Request<proto::CommitRequest>,
    ) -> Result<Response<proto::CommitResponse>, Status> {
        let tenant = tenant_of(&req)?;
        let caller = self.audit.as_ref().map(|_| caller_of(&req));
        let result = self
            .commit_one(&tenant, caller, &req.get_ref().reservation, false)
            .await;
        finish(&tenant, "commit", result.map(|()| proto::CommitResponse {}))
    }

    #[tracing::instrument(level = "debug", name = "renew", skip_all, fields(request_id = next_request_id()))]
    async fn renew(
        &self,
        req: Request<proto::RenewRequest>,
    ) -> Result<Response<proto::RenewResponse>, Status> {
        let started = Instant::now();
        let tenant = tenant_of(&req)?;
        let asked = self.asked(&req, Method::Renew, |_| None, |_| None);
        let r = req.get_ref();
        let mut trail = Trail::default();
        let result = self
            .sealer
            .renew(&tenant, &r.reservation, r.lease_seconds, &mut trail)
            .await;
        let result = self
            .settle(Rpc::Renew, started, asked, &tenant, trail, result)
            .await;
        finish(
            &tenant,
            "renew",
            result.map(|l| proto::RenewResponse {
                lease_expires_at_unix: l.until,
                lease_seconds: l.seconds,
            }),
        )
    }

    #[tracing::instrument(level = "debug", name = "release", skip_all, fields(request_id = next_request_id()))]
    async fn release(
        &self,
        req: Request<proto::ReleaseRequest>,
    ) -> Result<Response<proto::ReleaseResponse>, Status> {
        let started = Instant::now();
        let tenant = tenant_of(&req)?;
        let asked = self.asked(&req, Method::Release, |_| None, |_| None);
        let mut trail = Trail::default();
        let result = self
            .sealer
            .release(&tenant, &req.get_ref().reservation, &mut trail)
            .await;
        let result = self
            .settle(Rpc::Release, started, asked, &tenant, trail, result)
            .await;
        finish(
            &tenant,
            "release",
            result.map(|()| proto::ReleaseResponse {}),
        )
    }
}

/// Logs the outcome of an RPC without payload and turns it into a response.
fn finish<T>(
    tenant: &Tenant,
    rpc: &'static str,
    result: Result<T, Reject>,
) -> Result<Response<T>, Status> {
    log_outcome(tenant, rpc, &result);
    result.map(Response::new).map_err(Status::from)
}

/// Logs an outcome without payload: done, or the reason refused.
fn log_outcome<T>(tenant: &Tenant, rpc: &'static str, result: &Result<T, Reject>) {
    match result {
        Ok(_) => tracing::debug!(tenant = tenant.as_str(), rpc, "done"),
        Err(e) => tracing::debug!(
            tenant = tenant.as_str(),
            rpc,
            reason = e.reason(),
            "refused"
        ),
    }
}
