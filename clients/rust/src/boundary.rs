//! [`StatesealBoundary`] and the [`Sealed`] handler wrapper: stateseal in
//! front of an rmcp server's tools, prompts and resources.
//!
//! Inbound (`tools/call`, `prompts/get`, `resources/read` carrying
//! `requestState`), the token is opened by stateseal, bound to the audience
//! and the verified principal (hashed together into the subject), the
//! method, and the binding-v2 digest of the params the handler sees; a
//! single-use token is consumed at most once across every replica:
//! - by default in two phases: stateseal *reserves* the token for a lease,
//!   the handler runs (the lease renewed every third of its length), and the
//!   reservation is *committed* when the handler returns (beside the
//!   answer) or *released* when it fails, panics, reports an error, or its
//!   request is cancelled. A Commit that cannot land yet (stateseal, its
//!   ledger or its audit sink down) is kept: retried with capped backoff,
//!   its lease still renewed, until stateseal gives a definite answer or
//!   the commit window has passed; a Release that cannot land is kept the
//!   same way (without the renewals);
//! - for targets in `at_most_once`, consumed before the handler runs.
//!
//! Each request gets an attempt id, so an Open that timed out after
//! stateseal recorded it is sent again safely (twice at most).
//! `inputResponses` without a `requestState` answer no question this server
//! asked: they are removed before the handler runs. An `input_required`
//! result with `inputRequests` but no `requestState` gets one minted here
//! (an empty state, which the handler later sees as none).
//!
//! Outbound, an `input_required` result's `requestState` (the handler's
//! plaintext) is sealed under the same binding, single-use unless the target
//! is in `reusable`, always with the round's questions as its manifest: a
//! round that asked nothing is sealed with none (`{}`), so no answer
//! reaches the handler with its token.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ErrorCode, GetPromptRequestParams, GetPromptResponse,
    InputRequiredResult, InputResponses, JsonObject, ReadResourceRequestParams,
    ReadResourceResponse,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::ErrorData;
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use crate::binding::{params_digest, subject_for, Bound};
use crate::client::{Binding, OpenMode, Opened, RequestStateClient, StatesealError};
use crate::refusal::{
    call_refusal, open_refusal, renewal_lost, resend, retry_commit, Kind, Level, OnReplay, Refusal,
    INVALID_PARAMS,
};
use crate::steps::{nanos, Step, Steps};

/// The longest `requestState` (UTF-8 bytes) sent to stateseal: a 64 KiB
/// state sealed with a 16 KiB manifest, with 512 bytes of room for the
/// fixed parts, in base64url (the service admits 109,295).
pub const DEFAULT_MAX_REQUEST_STATE_BYTES: usize = ((65536 + 16384 + 512) * 4_usize).div_ceil(3);
/// The longest `inputResponses` JSON sent to stateseal: the service's
/// `--max-input-bytes` default, 256 KiB.
pub const DEFAULT_MAX_INPUT_RESPONSES_BYTES: usize = 256 * 1024;

/// The shortest pause between two renewals of a lease.
const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(500);
/// The shortest deadline of a Renew, or of one try of a Commit, which each
/// get a third of the lease (at most the client's timeout).
const MIN_LEASE_RPC_DEADLINE: Duration = Duration::from_millis(250);
/// How long an Open of a token whose Commit this boundary still keeps (its
/// handler answered; the Commit has not landed) waits, at most, for that
/// Commit before it is answered IN_USE without opening the token. Asked
/// again, it waits again: so for as long as the Commit is kept (up to the
/// commit window), no replay reaching this boundary runs the handler, even
/// once the lease has run out during an outage.
const COMMIT_WAIT: Duration = Duration::from_secs(5);
/// How long, by default, a Commit (or a Release) that cannot land yet is
/// kept after its handler returned ([`Builder::commit_window`]).
pub const DEFAULT_COMMIT_WINDOW: Duration = Duration::from_secs(60);
/// The most Commits and Releases one boundary runs (and keeps) at once
/// after their requests' answers, by default ([`Builder::max_pending`]).
pub const DEFAULT_MAX_PENDING: usize = 10_000;
/// The first pause before a kept Commit or Release is tried again, doubled
/// after each failure up to [`RETRY_CAP`]; each pause is drawn between half
/// and all of it, so that what an outage held back does not all go at once
/// when it ends.
const RETRY_FIRST: Duration = Duration::from_millis(50);
/// The longest pause between two tries of a kept Commit or Release.
const RETRY_CAP: Duration = Duration::from_millis(500);
/// The most waiting Commits one Open carries: the service decides 4 at a
/// time, and the Open's answer waits for them.
const CARRY_PER_OPEN: usize = 4;
/// How long, by default, a Commit waits for a durable Open of the same
/// boundary to carry it before it is sent on its own.
pub const DEFAULT_COMMIT_DELAY: Duration = Duration::from_millis(25);
/// The longest commit delay: below the 375 ms a replay on another replica
/// waits out IN_USE ([`BUSY_WAITS`]), so that it sees the Commit.
pub const MAX_COMMIT_DELAY: Duration = Duration::from_millis(250);
/// The pauses before an Open that found its token IN_USE is sent again (the
/// same attempt id): another replica's Commit may be on the way. 375 ms in
/// all, after which IN_USE is answered as such.
const BUSY_WAITS: [Duration; 4] = [
    Duration::from_millis(25),
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(200),
];

/// The verified principal of a request, put in the HTTP request's
/// extensions by the server's authentication layer (for example an axum
/// middleware after it verified an OAuth access token). rmcp hands the
/// request's `http::request::Parts` to the handler's context, where the
/// default principal function finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal(pub String);

/// A principal function's refusal: the request is refused with -32602
/// "Invalid or expired requestState" (deny on error, as the SDKs do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrincipalRefused;

/// Returns the verified principal of a request: `Ok(None)` on an
/// unauthenticated transport, `Err(PrincipalRefused)` to refuse the request.
pub type PrincipalFn =
    dyn Fn(&RequestContext<RoleServer>) -> Result<Option<String>, PrincipalRefused> + Send + Sync;

/// The default principal: a [`Principal`] in the HTTP request's extensions,
/// or none.
pub fn principal_from_extensions(
    ctx: &RequestContext<RoleServer>,
) -> Result<Option<String>, PrincipalRefused> {
    Ok(ctx
        .extensions
        .get::<http::request::Parts>()
        .and_then(|p| p.extensions.get::<Principal>())
        .map(|p| p.0.clone()))
}

/// How the boundary binds, consumes and answers. Built with
/// [`StatesealBoundary::builder`].
pub struct Options {
    audience: String,
    principal: Arc<PrincipalFn>,
    reusable: HashSet<String>,
    at_most_once: HashSet<String>,
    reask: bool,
    reask_on_invalid_answers: bool,
    on_replay: OnReplay,
    ttl_seconds: u32,
    lease_seconds: u32,
    max_request_state_bytes: usize,
    max_input_responses_bytes: usize,
    commit_delay: Duration,
    commit_window: Duration,
    max_pending: usize,
    steps: Option<Arc<Steps>>,
}

/// Builds a [`StatesealBoundary`].
pub struct Builder {
    client: RequestStateClient,
    options: Options,
}

impl Builder {
    /// The verified principal of a request (default:
    /// [`principal_from_extensions`]).
    pub fn principal(
        mut self,
        f: impl Fn(&RequestContext<RoleServer>) -> Result<Option<String>, PrincipalRefused>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        self.options.principal = Arc::new(f);
        self
    }
    /// Targets (tool or prompt names, resource URIs) whose tokens may open
    /// more than once; every other target is single-use.
    pub fn reusable<I: IntoIterator<Item = S>, S: Into<String>>(mut self, targets: I) -> Self {
        self.options.reusable = targets.into_iter().map(Into::into).collect();
        self
    }
    /// Targets consumed before their handler runs (at most once even if the
    /// handler crashes; a failure then costs the user's retry). Every other
    /// single-use target is reserved, then committed or released.
    pub fn at_most_once<I: IntoIterator<Item = S>, S: Into<String>>(mut self, targets: I) -> Self {
        self.options.at_most_once = targets.into_iter().map(Into::into).collect();
        self
    }
    /// On EXPIRED (and with [`OnReplay::Reask`] on REPLAYED and IN_USE), run
    /// the request again without its state so the handler asks afresh
    /// (default true), instead of -32602 "Invalid or expired requestState".
    pub fn reask(mut self, on: bool) -> Self {
        self.options.reask = on;
        self
    }
    /// When stateseal drops an answer to a question this server asked
    /// (KIND_MISMATCH, INVALID_CONTENT), ask afresh (default true) instead
    /// of handing the handler the answers with that key missing.
    pub fn reask_on_invalid_answers(mut self, on: bool) -> Self {
        self.options.reask_on_invalid_answers = on;
        self
    }
    /// What a replayed token gets (default [`OnReplay::Error`]).
    pub fn on_replay(mut self, on_replay: OnReplay) -> Self {
        self.options.on_replay = on_replay;
        self
    }
    /// A token's lifetime; 0 = the stateseal server's default.
    pub fn ttl_seconds(mut self, ttl: u32) -> Self {
        self.options.ttl_seconds = ttl;
        self
    }
    /// The lease asked for when reserving and renewing; 0 = the stateseal
    /// server's default.
    pub fn lease_seconds(mut self, lease: u32) -> Self {
        self.options.lease_seconds = lease;
        self
    }
    /// A `requestState` over this many UTF-8 bytes is refused before
    /// stateseal is called (default [`DEFAULT_MAX_REQUEST_STATE_BYTES`]).
    pub fn max_request_state_bytes(mut self, n: usize) -> Self {
        self.options.max_request_state_bytes = n.max(1);
        self
    }
    /// An `inputResponses` whose JSON is over this many bytes is refused
    /// before stateseal is called (default
    /// [`DEFAULT_MAX_INPUT_RESPONSES_BYTES`]).
    pub fn max_input_responses_bytes(mut self, n: usize) -> Self {
        self.options.max_input_responses_bytes = n.max(1);
        self
    }
    /// How long a Commit waits for the next durable Open of this boundary
    /// (an Open of a single-use target) to carry it
    /// (`OpenRequest.commit`) before it is sent on its own (default
    /// [`DEFAULT_COMMIT_DELAY`], 25 ms; at most [`MAX_COMMIT_DELAY`], 250 ms;
    /// zero sends each Commit on its own at once). The answer never waits
    /// for it; what it costs is the window after a handler has answered in
    /// which a crash of this process leaves the token reserved rather than
    /// used: until its lease ends, after which a retry may run the handler
    /// again. [`StatesealBoundary::drain`] sends what is waiting at once.
    pub fn commit_delay(mut self, delay: Duration) -> Self {
        self.options.commit_delay = delay.min(MAX_COMMIT_DELAY);
        self
    }
    /// How long a Commit that cannot land yet is kept after its handler
    /// returned (default [`DEFAULT_COMMIT_WINDOW`], 60 s; never less than
    /// [`Builder::lease_seconds`] nor, for each Commit, than the lease
    /// stateseal granted: a shorter one is raised to it). Kept, it is
    /// retried with capped backoff (50 ms doubling to at most 0.5 s between
    /// tries) while its lease is renewed, until stateseal gives a definite
    /// answer: landed; `LEASE_EXPIRED` or `REJECTED` (another attempt holds
    /// the token); or any other refusal that is not transient (logged at
    /// ERROR). An outage of stateseal, its ledger or its audit sink shorter
    /// than the window never runs a handler that returned a second time. A
    /// Release that cannot land is kept for as long. Past the window the
    /// Commit is given up (an ERROR log): the token opens again once its
    /// lease ends.
    pub fn commit_window(mut self, window: Duration) -> Self {
        self.options.commit_window = window;
        self
    }
    /// The most Commits and Releases running at once after their requests'
    /// answers, the kept ones included (default [`DEFAULT_MAX_PENDING`],
    /// 10,000; at least 1): what an outage can hold in memory. Past it a
    /// Commit is tried once and a Release is not retried, neither kept:
    /// each is an ERROR log, counted in [`StatesealBoundary::overflowed`].
    pub fn max_pending(mut self, n: usize) -> Self {
        self.options.max_pending = n.max(1);
        self
    }
    /// Records where the boundary's time goes into `steps` (for
    /// benchmarks; off by default).
    pub fn steps(mut self, steps: Arc<Steps>) -> Self {
        self.options.steps = Some(steps);
        self
    }
    pub fn build(mut self) -> StatesealBoundary {
        let o = &mut self.options;
        o.commit_window = o
            .commit_window
            .max(Duration::from_secs(o.lease_seconds.into()));
        let (inflight, _) = watch::channel(0usize);
        StatesealBoundary(Arc::new(Inner {
            client: self.client,
            options: self.options,
            pending: Mutex::new(HashMap::new()),
            opening: Mutex::new(HashMap::new()),
            inflight,
            overflowed: AtomicU64::new(0),
            carrier: Mutex::new(Carrier::default()),
        }))
    }
}

/// stateseal's boundary for one MCP service. Cheap to clone; every clone
/// (and every handler it wraps) shares one client and one record of the
/// Commits and Releases still running.
#[derive(Clone)]
pub struct StatesealBoundary(Arc<Inner>);

struct Inner {
    client: RequestStateClient,
    options: Options,
    /// The Commits running beside their answers, by the SHA-256 of their
    /// token: what an Open of the same token waits for.
    pending: Mutex<HashMap<[u8; 32], watch::Receiver<bool>>>,
    /// The Opens on their way, by the SHA-256 of their token: how many, and
    /// whether a handler of this boundary answered with that token
    /// meanwhile.
    opening: Mutex<HashMap<[u8; 32], (usize, bool)>>,
    /// How many Commits and Releases are running after their request's
    /// answer (for [`StatesealBoundary::drain`] and `max_pending`).
    inflight: watch::Sender<usize>,
    /// How many found `max_pending` kept already
    /// ([`StatesealBoundary::overflowed`]).
    overflowed: AtomicU64,
    /// The Commits waiting for a durable Open to carry them.
    carrier: Mutex<Carrier>,
}

/// A Commit waiting for a carrier, and where its outcome goes.
/// A Commit waiting for a carrier: its reservation, the deadline of its
/// try if it goes on its own, and where its outcome goes.
type Waiting = (
    String,
    Duration,
    oneshot::Sender<Result<(), StatesealError>>,
);

/// The Commits of one boundary waiting for a durable Open to carry them
/// (`OpenRequest.commit`, at most [`CARRY_PER_OPEN`] each), oldest
/// first. Whatever no Open has taken the commit delay after the first of
/// them was queued is sent on its own, one Commit each.
#[derive(Default)]
struct Carrier {
    waiting: Vec<Waiting>,
    /// The running timer, and its number: a timer that fires after it was
    /// stopped (it was already waiting for the lock) finds another number
    /// and does nothing.
    timer: Option<(u64, JoinHandle<()>)>,
    timers: u64,
    /// [`StatesealBoundary::drain`] calls under way: a Commit queued
    /// meanwhile goes at once.
    draining: usize,
}

impl Carrier {
    fn stop_timer(&mut self) {
        if let Some((_, t)) = self.timer.take() {
            t.abort();
        }
    }
}

impl std::fmt::Debug for StatesealBoundary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatesealBoundary")
            .field("audience", &self.0.options.audience)
            .finish_non_exhaustive()
    }
}

impl StatesealBoundary {
    /// A boundary with the defaults; `audience` is this MCP service's
    /// identity (a token minted by another service on the same stateseal
    /// tenant never opens here).
    pub fn new(client: RequestStateClient, audience: impl Into<String>) -> Self {
        Self::builder(client, audience).build()
    }

    pub fn builder(client: RequestStateClient, audience: impl Into<String>) -> Builder {
        Builder {
            client,
            options: Options {
                audience: audience.into(),
                principal: Arc::new(principal_from_extensions),
                reusable: HashSet::new(),
                at_most_once: HashSet::new(),
                reask: true,
                reask_on_invalid_answers: true,
                on_replay: OnReplay::Error,
                ttl_seconds: 0,
                lease_seconds: 0,
                max_request_state_bytes: DEFAULT_MAX_REQUEST_STATE_BYTES,
                max_input_responses_bytes: DEFAULT_MAX_INPUT_RESPONSES_BYTES,
                commit_delay: DEFAULT_COMMIT_DELAY,
                commit_window: DEFAULT_COMMIT_WINDOW,
                max_pending: DEFAULT_MAX_PENDING,
                steps: None,
            },
        }
    }

    /// `handler` behind this boundary: an rmcp `ServerHandler` whose
    /// `call_tool`, `get_prompt` and `read_resource` go through stateseal
    /// and whose every other method is the handler's own.
    pub fn wrap<H>(&self, handler: H) -> Sealed<H> {
        Sealed {
            inner: handler,
            boundary: self.clone(),
        }
    }

    /// Waits (at most `timeout`) for every Commit still running after its
    /// handler's answer went out, and every Release still kept; true when
    /// none is left. Call it before the runtime stops, with a timeout as
    /// long as the outage of stateseal you want a shutdown to ride out (at
    /// most the commit window): a Commit that never lands leaves its token
    /// reserved until the lease ends, after which a retry may run the
    /// handler again.
    pub async fn drain(&self, timeout: Duration) -> bool {
        // The Commits waiting for a carrier go now, each on its own, and so
        // does every Commit queued until drain() returns.
        struct Draining<'a>(&'a StatesealBoundary);
        impl Drop for Draining<'_> {
            fn drop(&mut self) {
                self.0.carrier().draining -= 1;
            }
        }
        self.carrier().draining += 1;
        let _draining = Draining(self);
        self.send_all();
        let mut rx = self.0.inflight.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|n| *n == 0))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// How many Commits and Releases found [`Builder::max_pending`] of them
    /// running already, and so were not kept themselves (each an ERROR
    /// log), since this boundary was built.
    pub fn overflowed(&self) -> u64 {
        self.0.overflowed.load(Ordering::Relaxed)
    }

    /// Counts one more Commit or Release running after its request's
    /// answer (until the [`Slot`] is dropped); true when it may be kept
    /// (fewer than `max_pending` are running). Otherwise an ERROR log,
    /// counted in [`StatesealBoundary::overflowed`].
    fn slot(&self, what: &'static str, method: &str) -> (Slot, bool) {
        let mut running = 0;
        self.0.inflight.send_modify(|n| {
            running = *n;
            *n += 1;
        });
        let slot = Slot(self.clone());
        if running < self.0.options.max_pending {
            return (slot, true);
        }
        let overflowed = self.0.overflowed.fetch_add(1, Ordering::Relaxed) + 1;
        error!(target: "stateseal_rmcp", method, running, overflowed, "stateseal {what} not kept: max_pending Commits and Releases are running already; if it does not land, the token opens again once its lease ends");
        (slot, false)
    }

    /// Whether no Commit of `token` is running in this boundary any more,
    /// after waiting up to [`COMMIT_WAIT`] for the one that is (sent out of
    /// its carrier first).
    async fn settled(&self, token: &[u8; 32]) -> bool {
        let pending = self
            .0
            .pending
            .lock()
            .map(|p| p.get(token).cloned())
            .unwrap_or(None);
        let Some(mut rx) = pending else {
            return true;
        };
        // That Commit may be waiting for a carrier: now.
        self.send_all();
        // The Commit sets `done` when it ends, even when its task is cut.
        let waited = tokio::time::timeout(COMMIT_WAIT, rx.wait_for(|done| *done)).await;
        waited.is_ok()
    }

    fn is_pending(&self, token: &[u8; 32]) -> bool {
        self.0
            .pending
            .lock()
            .map(|p| p.contains_key(token))
            .unwrap_or(false)
    }

    /// Queues a Commit for the next durable Open to carry; the receiver
    /// gets its outcome, as a Commit would answer.
    fn commit_later(
        &self,
        reservation: &str,
        deadline: Duration,
    ) -> oneshot::Receiver<Result<(), StatesealError>> {
        let (tx, rx) = oneshot::channel();
        let waiting = (reservation.to_owned(), deadline, tx);
        let alone = {
            let mut c = self.carrier();
            if c.draining > 0 {
                Some(waiting)
            } else {
                c.waiting.push(waiting);
                if c.timer.is_none() {
                    c.timers += 1;
                    let (b, delay, number) = (self.clone(), self.0.options.commit_delay, c.timers);
                    let timer = tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        b.send_waiting(Some(number));
                    });
                    c.timer = Some((number, timer));
                }
                None
            }
        };
        self.send(alone.into_iter().collect());
        rx
    }

    /// The carrier, even after a panic elsewhere held its lock (nothing
    /// under it leaves it inconsistent): a Commit never waits forever.
    fn carrier(&self) -> std::sync::MutexGuard<'_, Carrier> {
        self.0
            .carrier
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The oldest waiting Commits, for an Open to carry.
    fn take_carried(&self) -> Vec<Waiting> {
        let mut c = self.carrier();
        let n = c.waiting.len().min(CARRY_PER_OPEN);
        let taken: Vec<Waiting> = c.waiting.drain(..n).collect();
        if c.waiting.is_empty() {
            c.stop_timer();
        }
        taken
    }

    /// Ends each carried Commit with its outcome from the Open's answer;
    /// one the answer does not name (a server that does not know carried
    /// commits) is sent on its own.
    fn settle(&self, taken: Vec<Waiting>, outcomes: Vec<Option<StatesealError>>) {
        let mut rest = Vec::new();
        let mut outcomes = outcomes.into_iter();
        for (reservation, deadline, tx) in taken {
            match outcomes.next() {
                Some(None) => {
                    let _ = tx.send(Ok(()));
                }
                Some(Some(e)) => {
                    let _ = tx.send(Err(e));
                }
                None => rest.push((reservation, deadline, tx)),
            }
        }
        self.send(rest);
    }

    /// Sends every waiting Commit on its own, now.
    fn send_all(&self) {
        self.send_waiting(None);
    }

    /// Sends every waiting Commit on its own, and stops the timer; from
    /// the timer numbered `fired`, only while it is still the running one
    /// (it then ends by itself).
    fn send_waiting(&self, fired: Option<u64>) {
        let taken = {
            let mut c = self.carrier();
            match (fired, &c.timer) {
                (None, _) => c.stop_timer(),
                (Some(n), Some((running, _))) if *running == n => c.timer = None,
                // Stopped since: what waits now has a timer of its own.
                (Some(_), _) => return,
            }
            std::mem::take(&mut c.waiting)
        };
        self.send(taken);
    }

    /// Sends each of `taken` as a Commit of its own.
    fn send(&self, taken: Vec<Waiting>) {
        for (reservation, deadline, tx) in taken {
            let b = self.clone();
            tokio::spawn(async move {
                let t = Instant::now();
                let committed = b.0.client.commit_within(&reservation, deadline).await;
                b.lap(Step::RpcCommit, t);
                let _ = tx.send(committed);
            });
        }
    }

    /// Serves one MRTR-capable request: `call` is the handler. With
    /// [`Builder::steps`], the boundary's own time (without the handler's)
    /// is recorded as [`Step::Boundary`].
    pub(crate) async fn serve<P, R, F, Fut>(
        &self,
        params: P,
        ctx: RequestContext<RoleServer>,
        call: F,
    ) -> Result<R, ErrorData>
    where
        P: MrtrParams,
        R: MrtrResponse,
        F: FnOnce(P, RequestContext<RoleServer>) -> Fut,
        Fut: Future<Output = Result<R, ErrorData>>,
    {
        let Some(steps) = self.0.options.steps.clone() else {
            return self.serve_inner(params, ctx, call).await;
        };
        let handler = AtomicU64::new(0);
        let start = Instant::now();
        let timed = |p, c| {
            let (fut, handler) = (call(p, c), &handler);
            async move {
                let t = Instant::now();
                let r = fut.await;
                handler.fetch_add(nanos(t.elapsed()), Ordering::Relaxed);
                r
            }
        };
        let r = self.serve_inner(params, ctx, timed).await;
        let handled = Duration::from_nanos(handler.load(Ordering::Relaxed));
        steps.add(Step::Boundary, start.elapsed().saturating_sub(handled));
        r
    }

    fn lap(&self, step: Step, since: Instant) {
        if let Some(steps) = &self.0.options.steps {
            steps.add(step, since.elapsed());
        }
    }

    async fn serve_inner<P, R, F, Fut>(
        &self,
        mut params: P,
        ctx: RequestContext<RoleServer>,
        call: F,
    ) -> Result<R, ErrorData>
    where
        P: MrtrParams,
        R: MrtrResponse,
        F: FnOnce(P, RequestContext<RoleServer>) -> Fut,
        Fut: Future<Output = Result<R, ErrorData>>,
    {
        let o = &self.0.options;
        let method = P::METHOD;
        let target = params.target();
        let principal = (o.principal)(&ctx);
        let Some(wire) = params.take_state() else {
            if params.take_answers().is_some() {
                // Answers without a sealed token answer no question this
                // server asked: they never reach the handler.
                debug!(target: "stateseal_rmcp", method, "inputResponses without requestState: dropped");
            }
            let result = call(params, ctx).await?;
            return self.seal_if_asked(result, &target, &principal, None).await;
        };
        self.check_state(method, &wire)?;
        let answers = params.take_answers();
        let t = Instant::now();
        let answers_json = match &answers {
            Some(a) => Some(self.answers_json(method, a)?),
            None => None,
        };
        self.lap(Step::Manifest, t);
        let t = Instant::now();
        let subject = self.subject(method, &principal)?;
        let binding = Binding {
            subject,
            method: method.to_owned(),
            params_digest: digest(method, &target)?,
        };
        self.lap(Step::Binding, t);
        let reserve = !o.at_most_once.contains(target.name());
        let carry = !o.reusable.contains(target.name());
        let token: [u8; 32] = Sha256::digest(wire.as_bytes()).into();
        let opening = Opening::new(self, token);
        let opened = match self
            .open(
                &wire,
                &token,
                &binding,
                (reserve, carry),
                answers_json.unwrap_or_default(),
            )
            .await
            .and_then(|opened| self.not_answered_here(method, &opening, opened))
        {
            Ok(opened) => opened,
            Err(e) => {
                let r = open_refusal(&e, o.on_replay, o.reask);
                if r.kind == Kind::Reask {
                    info!(target: "stateseal_rmcp", method, reason = %e.reason, "requestState refused: asking again");
                    let result = call(params, ctx).await?;
                    return self
                        .seal_if_asked(result, &target, &principal, Some(&binding))
                        .await;
                }
                return Err(refuse(method, &e, &r));
            }
        };
        drop(opening);
        // From here a reservation is held: released unless committed, even
        // when this future is dropped (the request cancelled).
        let mut held = Held::new(self.clone(), method, &opened);
        let state = String::from_utf8(opened.state).map_err(|_| {
            error!(target: "stateseal_rmcp", method, "the opened requestState is not UTF-8 (sealed by another service?)");
            internal()
        })?;
        if !state.is_empty() {
            // Empty: minted here for a handler that asked without a state.
            params.set_state(Some(state));
        }
        if answers.is_some() {
            // The handler sees only answers to questions this server asked,
            // of the right shape.
            let t = Instant::now();
            let filtered: InputResponses = serde_json::from_str(&opened.input_responses_json).map_err(|_| {
                error!(target: "stateseal_rmcp", method, "stateseal's filtered inputResponses are not a JSON object");
                internal()
            })?;
            if !opened.dropped.is_empty() {
                // A count and the first few: a client can send thousands.
                let first: Vec<String> = opened
                    .dropped
                    .iter()
                    .take(8)
                    .map(|(k, why)| format!("{}: {why}", json!(k)))
                    .collect();
                info!(target: "stateseal_rmcp", method, dropped = opened.dropped.len(), first = %first.join(", "), "inputResponses entries dropped");
            }
            params.set_answers(Some(filtered));
            self.lap(Step::Manifest, t);
            let invalid = opened
                .dropped
                .iter()
                .any(|(_, why)| why == "KIND_MISMATCH" || why == "INVALID_CONTENT");
            if invalid && o.reask_on_invalid_answers {
                // An asked question got no usable answer: ask afresh rather
                // than hand the handler a state whose answers are missing.
                info!(target: "stateseal_rmcp", method, "invalid answers: asking again");
                params.set_state(None);
                params.set_answers(None);
            }
        }
        held.keep_renewing();
        let ran = AssertUnwindSafe(async {
            let result = call(params, ctx).await?;
            self.seal_if_asked(result, &target, &principal, Some(&binding))
                .await
        })
        .catch_unwind()
        .await;
        let result = match ran {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => {
                held.release().await;
                return Err(e);
            }
            Err(panic) => {
                held.release().await;
                std::panic::resume_unwind(panic);
            }
        };
        if result.is_error() {
            // The tool reported failure: give the token back for the
            // corrected retry.
            held.release().await;
        } else {
            // The handler ran: its answer goes out now and the Commit runs
            // beside it. Until the Commit lands the lease keeps the token
            // IN_USE, so no other attempt runs the handler meanwhile.
            held.commit_beside(token);
        }
        Ok(result)
    }

    /// `opened`, unless a handler of this boundary answered with its token
    /// while the Open was on its way, or that handler's Commit is still
    /// kept: then the Open was decided after that handler's lease ran out
    /// (an outage), and the handler, which ran, does not run again. What
    /// the Open reserved is committed in its stead (the token is used) and
    /// it is answered IN_USE (its retry: REPLAYED).
    fn not_answered_here(
        &self,
        method: &'static str,
        opening: &Opening<'_>,
        opened: Opened,
    ) -> Result<Opened, StatesealError> {
        let token = opening.token;
        if !opening.answered() && !self.is_pending(&token) {
            return Ok(opened);
        }
        warn!(target: "stateseal_rmcp", method, "requestState opened while this boundary still keeps the Commit of its handler's answer: not run again");
        // Its lease renewed until the Commit lands, as a handler's is.
        let mut held = Held::new(self.clone(), method, &opened);
        held.keep_renewing();
        held.commit_beside(token);
        Err(still_committing())
    }

    async fn open(
        &self,
        wire: &str,
        token: &[u8; 32],
        binding: &Binding,
        (reserve, carry): (bool, bool),
        answers_json: String,
    ) -> Result<Opened, StatesealError> {
        let o = &self.0.options;
        let attempt = attempt_id();
        let (mode, lease) = if reserve {
            (OpenMode::Reserve, o.lease_seconds)
        } else {
            (OpenMode::Consume, 0)
        };
        // A handler of this boundary answered with this token and its
        // Commit has not landed yet: wait for it, and while it is still kept
        // never open the token (its lease may have run out during an outage,
        // and this Open would take it over and run the handler again).
        if !self.settled(token).await {
            return Err(still_committing());
        }
        let (mut resent, mut busy, mut waited) = (0, 0, false);
        loop {
            // A durable Open (of a single-use token) carries the Commits
            // waiting here: its durable round is theirs too.
            let carried = if carry {
                self.take_carried()
            } else {
                Vec::new()
            };
            let reservations: Vec<String> = carried.iter().map(|(r, _, _)| r.clone()).collect();
            if let Some(steps) = &o.steps {
                steps.add_count(Step::CommitCarried, reservations.len() as u64);
            }
            let t = Instant::now();
            let opened = self
                .0
                .client
                .open_carrying(
                    wire,
                    binding,
                    mode,
                    lease,
                    &attempt,
                    answers_json.clone(),
                    &reservations,
                )
                .await;
            self.lap(Step::RpcOpen, t);
            let e = match opened {
                Ok(mut opened) => {
                    self.settle(carried, std::mem::take(&mut opened.commits));
                    return Ok(opened);
                }
                Err(e) => {
                    // Their outcome is unknown: each is sent on its own
                    // (Commit is idempotent).
                    self.send(carried);
                    e
                }
            };
            // Safe: the same attempt id gets the same success if the first
            // try was recorded.
            if resent < 2 && resend(&e) {
                resent += 1;
                warn!(target: "stateseal_rmcp", method = %binding.method, reason = %e.reason, "stateseal open failed; retrying");
                continue;
            }
            if e.from_stateseal && e.reason == "IN_USE" {
                // A handler that has answered holds the token until its
                // Commit lands. If that Commit is this boundary's (it
                // answered while this Open was on its way), wait for it
                // (once; still kept after that: in progress); else perhaps
                // another replica's: wait a little.
                if !waited && self.is_pending(token) {
                    waited = true;
                    if self.settled(token).await {
                        continue;
                    }
                    return Err(still_committing());
                }
                if let Some(pause) = BUSY_WAITS.get(busy) {
                    tokio::time::sleep(*pause).await;
                    busy += 1;
                    continue;
                }
            }
            return Err(e);
        }
    }

    async fn seal_if_asked<R: MrtrResponse>(
        &self,
        mut result: R,
        target: &Target,
        principal: &Result<Option<String>, PrincipalRefused>,
        binding: Option<&Binding>,
    ) -> Result<R, ErrorData> {
        let method = target.method();
        let Some(asked) = result.input_required_mut() else {
            return Ok(result);
        };
        let questions = asked.input_requests.as_ref().filter(|q| !q.is_empty());
        let state = match (&asked.request_state, questions) {
            (Some(s), _) => s.clone(),
            // The handler asked without a state of its own (the
            // specification allows it): one is minted, empty, so the retry's
            // answers come with a token like any other.
            (None, Some(_)) => String::new(),
            (None, None) => return Ok(result),
        };
        let t = Instant::now();
        let manifest = match questions {
            Some(q) => serde_json::to_string(q).map_err(|_| {
                error!(target: "stateseal_rmcp", method, "the handler's inputRequests cannot be serialized");
                internal()
            })?,
            // A round that asked nothing ("still working, call again") is
            // sealed with a manifest of no questions, never without one:
            // stateseal then drops every answer that comes with its token
            // (UNASKED), so none reaches the handler.
            None => "{}".to_owned(),
        };
        self.lap(Step::Manifest, t);
        let t = Instant::now();
        let owned;
        let binding = match binding {
            Some(b) => b,
            None => {
                owned = Binding {
                    subject: self.subject(method, principal)?,
                    method: method.to_owned(),
                    params_digest: digest(method, target)?,
                };
                &owned
            }
        };
        self.lap(Step::Binding, t);
        let o = &self.0.options;
        let single_use = !o.reusable.contains(target.name());
        let t = Instant::now();
        let sealed = self
            .0
            .client
            .seal(
                binding,
                state.into_bytes(),
                o.ttl_seconds,
                single_use,
                manifest,
            )
            .await;
        self.lap(Step::RpcSeal, t);
        match sealed {
            Ok(sealed) => {
                asked.request_state = Some(sealed.request_state);
                Ok(result)
            }
            Err(e) => Err(refuse(method, &e, &call_refusal(&e, true))),
        }
    }

    fn subject(
        &self,
        method: &str,
        principal: &Result<Option<String>, PrincipalRefused>,
    ) -> Result<String, ErrorData> {
        match principal {
            Ok(p) => Ok(subject_for(&self.0.options.audience, p.as_deref())),
            Err(PrincipalRefused) => {
                // Deny on error, as the SDKs do (and as the Python package
                // answers: no data, an ERROR for the operator).
                error!(target: "stateseal_rmcp", method, "the principal function refused the request");
                Err(ErrorData::new(
                    ErrorCode(INVALID_PARAMS),
                    "Invalid or expired requestState",
                    None,
                ))
            }
        }
    }

    /// Refuses, before stateseal, a `requestState` over the limit: the end
    /// user's doing, logged at debug only.
    fn check_state(&self, method: &str, wire: &str) -> Result<(), ErrorData> {
        if wire.len() > self.0.options.max_request_state_bytes {
            debug!(target: "stateseal_rmcp", method, "requestState rejected: TOO_LARGE (refused before stateseal)");
            return Err(rejected());
        }
        Ok(())
    }

    /// `inputResponses` as sent to stateseal; refused, before stateseal,
    /// over the limit.
    fn answers_json(&self, method: &str, answers: &InputResponses) -> Result<String, ErrorData> {
        let text = serde_json::to_string(answers).map_err(|_| invalid_params())?;
        if text.len() > self.0.options.max_input_responses_bytes {
            debug!(target: "stateseal_rmcp", method, "inputResponses rejected: TOO_LARGE (refused before stateseal)");
            return Err(ErrorData::new(
                ErrorCode(INVALID_PARAMS),
                "Invalid params: inputResponses too large",
                Some(json!({"reason": "input_responses_too_large"})),
            ));
        }
        Ok(text)
    }
}

/// An Open of `token` on its way, counted in [`Inner::opening`] until
/// dropped: a handler that answers with the token meanwhile marks it.
struct Opening<'a> {
    boundary: &'a StatesealBoundary,
    token: [u8; 32],
}

impl<'a> Opening<'a> {
    fn new(boundary: &'a StatesealBoundary, token: [u8; 32]) -> Self {
        if let Ok(mut o) = boundary.0.opening.lock() {
            o.entry(token).or_insert((0, false)).0 += 1;
        }
        Opening { boundary, token }
    }

    /// A handler of this boundary answered with the token since this Open
    /// (or another of it still on its way) set out.
    fn answered(&self) -> bool {
        self.boundary
            .0
            .opening
            .lock()
            .map(|o| o.get(&self.token).is_some_and(|e| e.1))
            .unwrap_or(true)
    }
}

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        if let Ok(mut o) = self.boundary.0.opening.lock() {
            if let Some(e) = o.get_mut(&self.token) {
                e.0 -= 1;
                if e.0 == 0 {
                    o.remove(&self.token);
                }
            }
        }
    }
}

/// A reservation held while its handler runs: renewed in the background,
/// and released when dropped before it was committed or released (a
/// cancelled request), so no token stays taken longer than its lease.
struct Held {
    pub(crate) boundary: StatesealBoundary,
    method: &'static str,
    reservation: String,
    granted: u32,
    keeper: Option<Keeper>,
    settled: bool,
}

impl Held {
    fn new(boundary: StatesealBoundary, method: &'static str, opened: &Opened) -> Self {
        Held {
            boundary,
            method,
            reservation: opened.reservation.clone(),
            granted: opened.lease_seconds,
            keeper: None,
            settled: opened.reservation.is_empty(),
        }
    }

    /// Renews the lease in the background while the handler runs.
    fn keep_renewing(&mut self) {
        if self.settled || self.granted == 0 {
            return;
        }
        self.keeper = Some(Keeper::start(Renewal::new(
            self.boundary.clone(),
            self.method,
            self.reservation.clone(),
            self.granted,
        )));
    }

    /// Stops renewing and waits until the keeper has ended, so no Renew is
    /// sent after.
    async fn stop(&mut self) {
        if let Some(k) = self.keeper.take() {
            k.stop().await;
        }
    }

    async fn release(mut self) {
        self.stop().await;
        if !self.settled {
            self.settled = true;
            let reservation = std::mem::take(&mut self.reservation);
            release(&self.boundary, self.method, reservation, self.granted).await;
        }
    }

    /// Commits after the answer went out, in a task of its own that an Open
    /// of the same token in this boundary waits for: kept, its lease still
    /// renewed, until stateseal gives a definite answer or the commit
    /// window has passed.
    fn commit_beside(mut self, token: [u8; 32]) {
        if self.settled {
            return;
        }
        self.settled = true;
        let b = self.boundary.clone();
        let (method, reservation, keeper) = (
            self.method,
            std::mem::take(&mut self.reservation),
            self.keeper.take(),
        );
        let granted = self.granted;
        let (slot, kept) = b.slot("commit", method);
        // Not kept (max_pending are): tried once.
        let window = if kept {
            b.0.options
                .commit_window
                .max(Duration::from_secs(self.granted.into()))
        } else {
            Duration::ZERO
        };
        let (done, rx) = watch::channel(false);
        if let Ok(mut p) = b.0.pending.lock() {
            p.insert(token, rx);
        }
        if let Some(o) =
            b.0.opening
                .lock()
                .ok()
                .as_mut()
                .and_then(|o| o.get_mut(&token))
        {
            o.1 = true;
        }
        let committing = Committing {
            boundary: b.clone(),
            token,
            done,
            _slot: slot,
        };
        tokio::spawn(async move {
            let _committing = committing;
            let until = tokio::time::Instant::now() + window;
            // Renewing goes on in this task, between the Commit's tries:
            // never beside one, so no Renew of ours finds the reservation
            // committed already (a false lost lease).
            let renewal = match keeper {
                Some(k) => k.hand_over().await,
                None => None,
            };
            let granted = renewal.as_ref().map_or(granted, |r| r.granted);
            let deadline = commit_try_deadline(granted, &b.0.client);
            commit(&b, method, &reservation, renewal, deadline, until).await;
        });
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(k) = self.keeper.take() {
            k.task.abort();
        }
        if !self.settled {
            // The request was cancelled (or its future dropped) while the
            // handler ran: give the token back.
            let (b, method, reservation, granted) = (
                self.boundary.clone(),
                self.method,
                std::mem::take(&mut self.reservation),
                self.granted,
            );
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move { release(&b, method, reservation, granted).await });
            }
        }
    }
}

/// A Commit or Release running after its request's answer, counted in
/// [`Inner::inflight`] until dropped.
struct Slot(StatesealBoundary);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0 .0.inflight.send_modify(|n| *n -= 1);
    }
}

/// A Commit in [`Inner::pending`]: when dropped (the Commit ended, or its
/// task was cut), it leaves the map and tells whoever waits for it.
struct Committing {
    boundary: StatesealBoundary,
    token: [u8; 32],
    done: watch::Sender<bool>,
    _slot: Slot,
}

impl Drop for Committing {
    fn drop(&mut self) {
        if let Ok(mut p) = self.boundary.0.pending.lock() {
            if p.get(&self.token)
                .is_some_and(|r| r.same_channel(&self.done.subscribe()))
            {
                p.remove(&self.token);
            }
        }
        self.done.send_replace(true);
    }
}

/// A lease kept alive: renewed every third of the length stateseal last
/// granted (at least every 0.5 s). Only the granted length is used, never
/// the ledger's time: this replica's clock is not the ledger's.
struct Renewal {
    boundary: StatesealBoundary,
    method: &'static str,
    reservation: String,
    /// The lease stateseal granted last, in seconds.
    granted: u32,
    every: Duration,
    next: tokio::time::Instant,
    /// stateseal answered `LEASE_EXPIRED`: renewing has stopped.
    lost: bool,
}

impl Renewal {
    fn new(
        boundary: StatesealBoundary,
        method: &'static str,
        reservation: String,
        granted: u32,
    ) -> Self {
        let every = renew_every(granted);
        Renewal {
            boundary,
            method,
            reservation,
            granted,
            every,
            next: tokio::time::Instant::now() + every,
            lost: false,
        }
    }

    /// One Renew, given up after a third of the lease (at least 0.25 s, at
    /// most the client's timeout): one that hangs would outlast the lease
    /// it extends. The next is due a third of the lease after this one was
    /// sent when it landed, and once its deadline has passed when it
    /// failed (at once after one that ran it out). `answered`: the handler
    /// has answered and its Commit is under way, which may have landed
    /// already (its answer not yet here), and a committed reservation
    /// renews as `LEASE_EXPIRED`: the Commit's answer decides, and reports
    /// a token taken over.
    async fn renew(&mut self, answered: bool) {
        let b = &self.boundary;
        let method = self.method;
        let t = Instant::now();
        let sent = tokio::time::Instant::now();
        let deadline = lease_rpc_deadline(self.granted).min(b.0.client.timeout());
        let renewed =
            b.0.client
                .renew_within(&self.reservation, b.0.options.lease_seconds, deadline)
                .await;
        b.lap(Step::RpcRenew, t);
        self.next = sent + deadline;
        match renewed {
            Ok(lease) => {
                if lease.lease_seconds > 0 {
                    self.granted = lease.lease_seconds;
                    self.every = renew_every(lease.lease_seconds);
                }
                self.next = sent + self.every;
            }
            Err(e) if renewal_lost(&e) => {
                self.lost = true;
                if answered {
                    debug!(target: "stateseal_rmcp", method, "stateseal renew: LEASE_EXPIRED while the Commit is under way; renewing stops (the Commit's answer decides)");
                } else {
                    error!(target: "stateseal_rmcp", method, "stateseal renew: reservation lost while the handler ran; another attempt may run it");
                }
            }
            // Unreachable or transient: the lease holds until it runs out,
            // and Commit still succeeds while no other attempt took the
            // token over.
            Err(e) if answered => {
                debug!(target: "stateseal_rmcp", method, reason = %e.reason, "stateseal renew failed while the Commit is kept; retrying")
            }
            Err(e) => {
                warn!(target: "stateseal_rmcp", method, reason = %e.reason, "stateseal renew failed; retrying")
            }
        }
    }
}

fn renew_every(granted: u32) -> Duration {
    MIN_RENEW_INTERVAL.max(Duration::from_secs(granted.into()) / 3)
}

/// The deadline of a Renew, and of each try of a Commit, under a lease of
/// `granted` seconds: a third of it, at least [`MIN_LEASE_RPC_DEADLINE`]
/// (the client's timeout caps it). Never longer than the renewal period,
/// so Renews never overlap, and a try that hangs leaves the lease two
/// thirds for the next.
fn lease_rpc_deadline(granted: u32) -> Duration {
    MIN_LEASE_RPC_DEADLINE.max(Duration::from_secs(granted.into()) / 3)
}

/// [`lease_rpc_deadline`] for a Commit's tries: the client's own timeout
/// when stateseal granted no lease length (a service older than Renew).
fn commit_try_deadline(granted: u32, client: &RequestStateClient) -> Duration {
    match granted {
        0 => client.timeout(),
        g => lease_rpc_deadline(g).min(client.timeout()),
    }
}

/// Sleeps until `until`, renewing the lease whenever a renewal falls due.
async fn sleep_renewing(renewal: &mut Option<Renewal>, until: tokio::time::Instant) {
    while let Some(r) = renewal.as_mut().filter(|r| !r.lost && r.next < until) {
        tokio::time::sleep_until(r.next).await;
        r.renew(true).await;
    }
    tokio::time::sleep_until(until).await;
}

/// The task renewing a lease while its handler runs.
struct Keeper {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Renewal>,
}

impl Keeper {
    fn start(renewal: Renewal) -> Self {
        let (stop, mut stopped) = oneshot::channel();
        let task = tokio::spawn(async move {
            let mut r = renewal;
            loop {
                tokio::select! {
                    _ = &mut stopped => return r,
                    _ = tokio::time::sleep_until(r.next) => {}
                }
                // Never cut by a hand-over: that waits for its answer.
                r.renew(false).await;
                if r.lost {
                    return r;
                }
            }
        });
        Keeper { stop, task }
    }

    /// Stops renewing here once the Renew in flight, if any, has its
    /// answer, and hands the lease over to the Commit (none once lost).
    async fn hand_over(self) -> Option<Renewal> {
        let _ = self.stop.send(());
        self.task.await.ok().filter(|r| !r.lost)
    }

    /// Stops renewing now (a Renew in flight is cut), and waits until the
    /// task has ended, so no Renew is sent after.
    async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// A pause of about `pause`: drawn between half and all of it.
fn jittered(pause: Duration) -> Duration {
    pause.mul_f64(0.5 + rand::random::<f64>() / 2.0)
}

/// IN_USE, answered without opening the token: its handler answered in
/// this boundary, and its Commit is still kept (has not landed).
fn still_committing() -> StatesealError {
    StatesealError {
        reason: "IN_USE".to_owned(),
        code: tonic::Code::Aborted,
        message: "its Commit is still kept in this process".to_owned(),
        from_stateseal: true,
    }
}

/// Commits a reservation whose handler returned, kept (retried with capped
/// backoff while the failure is transient, the lease renewed meanwhile)
/// until stateseal gives a definite answer or the clock passes `until`.
/// Each try is given up after `deadline` (a third of the lease; the first,
/// waiting for a carrier, after the commit delay and that), so a try that
/// hangs leaves the lease time to be renewed before the next.
/// The handler ran: its answer stands whatever Commit answers. Commit is
/// idempotent (a committed reservation commits again), and one that lands
/// after an outage still consumes the token: the lease was renewed
/// meanwhile, and even once it ended, as long as no other attempt took the
/// token over.
async fn commit(
    b: &StatesealBoundary,
    method: &str,
    reservation: &str,
    mut renewal: Option<Renewal>,
    deadline: Duration,
    until: tokio::time::Instant,
) {
    let mut pause = RETRY_FIRST;
    let mut tries = 0u32;
    loop {
        let committed = if tries == 0 && !b.0.options.commit_delay.is_zero() {
            // Carried by the next durable Open, or sent on its own after
            // the delay (a lost outcome: sent again, at once). An Open that
            // carries it may take the client's timeout: given up as a try
            // that ran out (the Commit is idempotent).
            let carried = b.commit_later(reservation, deadline);
            let wait = b.0.options.commit_delay.saturating_add(deadline);
            match tokio::time::timeout(wait, carried).await {
                Ok(Ok(outcome)) => outcome,
                Ok(Err(_)) => b.0.client.commit_within(reservation, deadline).await,
                Err(_) => Err(StatesealError::transport(
                    tonic::Code::DeadlineExceeded,
                    "timed out",
                )),
            }
        } else {
            let t = Instant::now();
            let committed = b.0.client.commit_within(reservation, deadline).await;
            b.lap(Step::RpcCommit, t);
            committed
        };
        tries += 1;
        let e = match committed {
            Ok(()) => {
                if tries > 1 {
                    info!(target: "stateseal_rmcp", method, tries, "stateseal commit landed after failed tries");
                }
                return;
            }
            Err(e) => e,
        };
        if retry_commit(&e) {
            let wait = jittered(pause);
            let now = tokio::time::Instant::now();
            if now + wait <= until {
                if tries == 1 {
                    let window_s = (until - now).as_secs();
                    warn!(target: "stateseal_rmcp", method, reason = %e.reason, window_s, "stateseal commit failed; kept and retried until it lands");
                } else {
                    debug!(target: "stateseal_rmcp", method, reason = %e.reason, tries, "stateseal commit failed; retrying");
                }
                sleep_renewing(&mut renewal, now + wait).await;
                pause = (pause * 2).min(RETRY_CAP);
                continue;
            }
            error!(target: "stateseal_rmcp", method, reason = %e.reason, tries, "stateseal commit did not land: the token opens again once its lease ends, and a retry after that may run the handler again");
        } else if e.from_stateseal && matches!(e.reason.as_str(), "LEASE_EXPIRED" | "REJECTED") {
            error!(target: "stateseal_rmcp", method, reason = %e.reason, "stateseal commit refused: the token was taken over by another attempt while this handler ran (this result stands; the other attempt may run it too)");
        } else {
            error!(target: "stateseal_rmcp", method, reason = %e.reason, "stateseal commit failed: the token may open again after its lease");
        }
        return;
    }
}

/// Gives a reservation back. Safe to repeat: a reservation names one lease,
/// so a late or repeated Release never frees a newer one. Sent again twice
/// after a short wait when the connection was lost (before the request's
/// answer); one that still cannot land (a transient failure: stateseal or
/// its ledger down) is kept and retried in the background, as a Commit is.
async fn release(b: &StatesealBoundary, method: &'static str, reservation: String, granted: u32) {
    let mut n = 0u32;
    let failed = loop {
        let t = Instant::now();
        let released = b.0.client.release(&reservation).await;
        b.lap(Step::RpcRelease, t);
        match released {
            Ok(()) => return,
            Err(e) if n < 2 && resend(&e) => {
                n += 1;
                tokio::time::sleep(Duration::from_millis(50 * u64::from(n))).await;
            }
            Err(e) => break e,
        }
    };
    if !failed.retryable() {
        // The lease ends by itself; the retry waits for it at worst.
        warn!(target: "stateseal_rmcp", method, reason = %failed.reason, "stateseal release failed");
        return;
    }
    let (slot, kept) = b.slot("release", method);
    if !kept {
        return;
    }
    warn!(target: "stateseal_rmcp", method, reason = %failed.reason, "stateseal release failed; kept and retried in the background");
    let until = tokio::time::Instant::now()
        + b.0
            .options
            .commit_window
            .max(Duration::from_secs(granted.into()));
    let b = b.clone();
    tokio::spawn(async move {
        let _slot = slot;
        release_kept(&b, method, &reservation, until).await;
    });
}

/// A Release that could not land before its request's answer, retried with
/// capped backoff while the failure is transient, until the clock passes
/// `until`.
async fn release_kept(
    b: &StatesealBoundary,
    method: &str,
    reservation: &str,
    until: tokio::time::Instant,
) {
    let mut pause = RETRY_FIRST;
    let mut tries = 1u32;
    loop {
        let wait = jittered(pause);
        if tokio::time::Instant::now() + wait > until {
            warn!(target: "stateseal_rmcp", method, tries, "stateseal release did not land: the token opens again once its lease ends");
            return;
        }
        tokio::time::sleep(wait).await;
        pause = (pause * 2).min(RETRY_CAP);
        let t = Instant::now();
        let released = b.0.client.release(reservation).await;
        b.lap(Step::RpcRelease, t);
        tries += 1;
        match released {
            Ok(()) => {
                info!(target: "stateseal_rmcp", method, tries, "stateseal release landed after failed tries");
                return;
            }
            Err(e) if e.retryable() => {
                debug!(target: "stateseal_rmcp", method, reason = %e.reason, "stateseal release failed; retrying");
            }
            Err(e) => {
                warn!(target: "stateseal_rmcp", method, reason = %e.reason, "stateseal release failed");
                return;
            }
        }
    }
}

fn attempt_id() -> String {
    let bytes: [u8; 16] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn digest(method: &str, target: &Target) -> Result<[u8; 32], ErrorData> {
    params_digest(target.bound()).map_err(|_| {
        warn!(target: "stateseal_rmcp", method, "params cannot be bound");
        invalid_params()
    })
}

/// The methods whose params may carry `requestState`.
pub(crate) fn is_mrtr_method(method: &str) -> bool {
    matches!(method, "tools/call" | "prompts/get" | "resources/read")
}

/// The answer to an MRTR request whose params rmcp could not parse: with a
/// `requestState`, the usual -32602 "Invalid or expired requestState";
/// otherwise -32602 "Invalid params". Logged at debug: the end user's doing.
pub(crate) fn malformed_mrtr(request: &rmcp::model::CustomRequest) -> ErrorData {
    let method = request.method.as_str();
    let has_state = request
        .params
        .as_ref()
        .and_then(|p| p.get("requestState"))
        .is_some();
    debug!(target: "stateseal_rmcp", method, has_state, "params that do not parse: refused");
    if has_state {
        rejected()
    } else {
        invalid_params()
    }
}

fn invalid_params() -> ErrorData {
    ErrorData::new(ErrorCode(INVALID_PARAMS), "Invalid params", None)
}

fn rejected() -> ErrorData {
    ErrorData::new(
        ErrorCode(INVALID_PARAMS),
        "Invalid or expired requestState",
        Some(json!({"reason": "invalid_request_state"})),
    )
}

fn internal() -> ErrorData {
    ErrorData::new(
        ErrorCode(crate::refusal::INTERNAL_ERROR),
        "Internal error",
        None,
    )
}

/// Logs a refusal at its level (never the token) and turns it into the MCP
/// error the table names.
fn refuse(method: &str, e: &StatesealError, r: &Refusal) -> ErrorData {
    let what = match r.kind {
        Kind::Replayed => "requestState REPLAYED: already used",
        Kind::InUse => "requestState IN_USE: in progress",
        Kind::Unavailable => "stateseal unavailable",
        Kind::Rejected if !e.from_stateseal => {
            "requestState rejected (stateseal refused the message as too large; are the boundary's limits above its --max-state-bytes / --max-input-bytes?)"
        }
        Kind::Rejected => "requestState rejected",
        _ => "stateseal call failed (check credentials and configuration)",
    };
    match r.log {
        Level::Info => info!(target: "stateseal_rmcp", method, reason = %e.reason, "{what}"),
        Level::Warn => warn!(target: "stateseal_rmcp", method, reason = %e.reason, "{what}"),
        Level::Error => error!(target: "stateseal_rmcp", method, reason = %e.reason, "{what}"),
    }
    ErrorData::new(
        ErrorCode(r.code),
        r.message,
        r.data_reason.map(|d| json!({ "reason": d })),
    )
}

/// What of a request is bound, kept (owned) for sealing after the handler
/// took the params.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    Named {
        method: &'static str,
        name: String,
        arguments: Option<JsonObject>,
    },
    Uri(String),
}

impl Target {
    fn name(&self) -> &str {
        match self {
            Target::Named { name, .. } => name,
            Target::Uri(uri) => uri,
        }
    }
    fn method(&self) -> &'static str {
        match self {
            Target::Named { method, .. } => method,
            Target::Uri(_) => "resources/read",
        }
    }
    fn bound(&self) -> Bound<'_> {
        match self {
            Target::Named {
                name, arguments, ..
            } => Bound::Named {
                name,
                arguments: arguments.as_ref(),
            },
            Target::Uri(uri) => Bound::Uri(uri),
        }
    }
}

/// The params of a request that may carry `requestState`.
pub(crate) trait MrtrParams {
    const METHOD: &'static str;
    fn target(&self) -> Target;
    fn take_state(&mut self) -> Option<String>;
    fn set_state(&mut self, s: Option<String>);
    fn take_answers(&mut self) -> Option<InputResponses>;
    fn set_answers(&mut self, a: Option<InputResponses>);
}

macro_rules! mrtr_params {
    ($t:ty, $method:literal, |$p:ident| $target:expr) => {
        impl MrtrParams for $t {
            const METHOD: &'static str = $method;
            fn target(&self) -> Target {
                let $p = self;
                $target
            }
            fn take_state(&mut self) -> Option<String> {
                self.request_state.take()
            }
            fn set_state(&mut self, s: Option<String>) {
                self.request_state = s;
            }
            fn take_answers(&mut self) -> Option<InputResponses> {
                self.input_responses.take()
            }
            fn set_answers(&mut self, a: Option<InputResponses>) {
                self.input_responses = a;
            }
        }
    };
}

mrtr_params!(CallToolRequestParams, "tools/call", |p| Target::Named {
    method: "tools/call",
    name: p.name.to_string(),
    arguments: p.arguments.clone()
});
mrtr_params!(GetPromptRequestParams, "prompts/get", |p| Target::Named {
    method: "prompts/get",
    name: p.name.clone(),
    arguments: p.arguments.clone()
});
mrtr_params!(
    ReadResourceRequestParams,
    "resources/read",
    |p| Target::Uri(p.uri.clone())
);

/// A result that may be `input_required`.
pub(crate) trait MrtrResponse {
    fn input_required_mut(&mut self) -> Option<&mut InputRequiredResult>;
    /// A tool result that reports failure (`isError`).
    fn is_error(&self) -> bool {
        false
    }
}

impl MrtrResponse for CallToolResponse {
    fn input_required_mut(&mut self) -> Option<&mut InputRequiredResult> {
        match self {
            CallToolResponse::InputRequired(r) => Some(r),
            _ => None,
        }
    }
    fn is_error(&self) -> bool {
        matches!(self, CallToolResponse::Complete(r) if r.is_error == Some(true))
    }
}

impl MrtrResponse for GetPromptResponse {
    fn input_required_mut(&mut self) -> Option<&mut InputRequiredResult> {
        match self {
            GetPromptResponse::InputRequired(r) => Some(r),
            _ => None,
        }
    }
}

impl MrtrResponse for ReadResourceResponse {
    fn input_required_mut(&mut self) -> Option<&mut InputRequiredResult> {
        match self {
            ReadResourceResponse::InputRequired(r) => Some(r),
            _ => None,
        }
    }
}

/// An rmcp `ServerHandler` behind a [`StatesealBoundary`] (made by
/// [`StatesealBoundary::wrap`]).
#[derive(Clone)]
pub struct Sealed<H> {
    pub(crate) inner: H,
    pub(crate) boundary: StatesealBoundary,
}

impl<H> Sealed<H> {
    /// The wrapped handler.
    pub fn handler(&self) -> &H {
        &self.inner
    }
}
