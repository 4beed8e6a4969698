//! The callers: each runs the MCP flow over and over against random
//! replicas — Seal, then Open RESERVE, renew, Commit (as an RPC, or carried
//! by an Open of another token) or Release, or Open
//! CONSUME — with concurrent duplicates, replays of completed tokens,
//! abandoned reservations that others take over after their lease (and
//! whose holders then try to Commit late), and retries with the same
//! attempt id after an indeterminate answer. Every call is one history
//! line.
//!
//! On patroni the callers model the packages (clients/*, "What at most
//! once means"): a reserved handler runs while its lease is renewed every
//! third of it, writes a `handler` line when it completes, and its Commit
//! is then kept — tried again with backoff (50 ms doubling to 500 ms, each
//! try's deadline a third of the lease) while the lease is renewed, until a
//! definite answer or [`COMMIT_WINDOW`]; a handler that fails has its
//! Release kept the same way. An Open of a token whose Commit is kept
//! waits for it (5 s at most) and otherwise is not sent, as a package's
//! in-process replay does; one on its way as a handler of its token
//! completed, or that finds its Commit kept once answered, runs no handler
//! (and commits what it reserved). An
//! Open CONSUME that consumed runs its handler too.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sha2::Digest;
use stateseal::proto::request_state_client::RequestStateClient;
use stateseal::proto::{
    binding, Binding, CommitRequest, OpenMode, OpenRequest, OpenResponse, ReleaseRequest,
    RenewRequest, SealRequest,
};
use tonic::transport::{Channel, Endpoint};

use super::cluster::{Cluster, COMMIT_WINDOW, LEASE_S};
use super::history::{Op, Writer};
use super::{Config, Stop, Store};

/// A deadline the client sets on every call (sent as `grpc-timeout`), and
/// the harness's own bound above it.
const CALL_TIMEOUT: Duration = Duration::from_millis(1500);
const HARD_TIMEOUT: Duration = Duration::from_millis(2500);
/// The packages' deadline on each Renew and Commit try: a third of the
/// lease.
const TRY_DEADLINE: Duration = Duration::from_millis(LEASE_S as u64 * 1000 / 3);
/// How long a package's in-process replay waits for a kept Commit.
const KEPT_WAIT: Duration = Duration::from_secs(5);

/// The reasons that mean nothing happened.
const DEFINITE: &[&str] = &[
    "REPLAYED",
    "IN_USE",
    "LEASE_EXPIRED",
    "CLOCK_UNSYNCED",
    "OVERLOADED",
    "MALFORMED",
    "TOO_LARGE",
];

struct Abandoned {
    ready: Instant,
    n: u64,
    token: String,
    /// The abandoned reservation, its attempt and stable id.
    held: Option<(String, String, String)>,
}

pub struct Workload {
    clients: Vec<RequestStateClient<Channel>>,
    hist: Arc<Writer>,
    ttl: u32,
    next_token: AtomicU64,
    next_attempt: AtomicU64,
    reservations: Mutex<HashMap<String, String>>,
    /// Every token sealed, for the final replay.
    tokens: Mutex<Vec<(u64, String)>>,
    later: Mutex<VecDeque<Abandoned>>,
    /// The callers model the packages (patroni).
    packaged: bool,
    /// Tokens whose handler returned and whose Commit is kept, with how
    /// many such Commits are.
    kept: Mutex<HashMap<u64, usize>>,
    /// Tokens with Opens on their way: how many, and whether a handler of
    /// the token completed (its Commit kept) meanwhile.
    opening: Mutex<HashMap<u64, (usize, bool)>>,
}

enum Answer<T> {
    Ok(T),
    Fail(String),
    Info(String),
}

/// A refusal with stateseal's reason `r`. Refusals decided before anything
/// is written are definite. Any other reason may come after the ledger
/// acted (LEDGER_UNAVAILABLE: it could not confirm; EXPIRED: decided after
/// the token expired), so it is indeterminate.
fn refused<T>(r: String) -> Answer<T> {
    if DEFINITE.contains(&r.as_str()) {
        Answer::Fail(r)
    } else {
        Answer::Info(r)
    }
}

impl Workload {
    pub async fn new(cfg: &Config, cluster: &Cluster, hist: Arc<Writer>) -> Arc<Workload> {
        let clients = cluster
            .replicas
            .iter()
            .map(|r| {
                let ch = Endpoint::from_shared(format!("http://{}", r.client_addr))
                    .unwrap()
                    .connect_timeout(Duration::from_secs(1))
                    .timeout(CALL_TIMEOUT)
                    .connect_lazy();
                RequestStateClient::new(ch)
            })
            .collect();
        Arc::new(Workload {
            clients,
            hist,
            ttl: (cfg.duration.as_secs() + 1800) as u32,
            next_token: AtomicU64::new(0),
            next_attempt: AtomicU64::new(0),
            reservations: Mutex::new(HashMap::new()),
            tokens: Mutex::new(Vec::new()),
            later: Mutex::new(VecDeque::new()),
            packaged: cfg.store == Store::Patroni,
            kept: Mutex::new(HashMap::new()),
            opening: Mutex::new(HashMap::new()),
        })
    }

    pub fn spawn_callers(
        self: Arc<Self>,
        n: usize,
        seed: u64,
        stop: Arc<Stop>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        (0..n)
            .map(|i| {
                let (w, stop) = (self.clone(), stop.clone());
                tokio::spawn(async move { w.caller(i, seed, &stop).await })
            })
            .collect()
    }

    fn binding(n: u64) -> Binding {
        Binding {
            subject: "nemesis-user".into(),
            method: "tools/call".into(),
            params: Some(binding::Params::ParamsDigest(
                sha2::Sha256::digest(n.to_be_bytes()).to_vec(),
            )),
            binding_version: 2,
        }
    }

    fn attempt(&self) -> String {
        format!("a{}", self.next_attempt.fetch_add(1, Ordering::Relaxed))
    }

    fn reservation_id(&self, r: &str) -> String {
        let mut m = self.reservations.lock().unwrap();
        let next = m.len();
        m.entry(r.to_owned())
            .or_insert_with(|| format!("r{next}"))
            .clone()
    }

    #[allow(clippy::too_many_arguments)]
    fn record<T>(
        &self,
        process: &str,
        op: &str,
        n: u64,
        attempt: Option<&str>,
        reservation: Option<String>,
        invoke: f64,
        replica: usize,
        answer: &Answer<T>,
        consumed: Option<bool>,
        lease: Option<f64>,
    ) {
        let (outcome, reason) = match answer {
            Answer::Ok(_) => ("ok", None),
            Answer::Fail(r) => ("fail", Some(r.clone())),
            Answer::Info(r) => ("info", Some(r.clone())),
        };
        self.hist.record(&Op {
            process: process.into(),
            op: op.into(),
            token: format!("t{n}"),
            attempt: attempt.map(String::from),
            reservation,
            invoke,
            complete: self.hist.now(),
            outcome: outcome.into(),
            reason,
            consumed,
            replica: Some(replica),
            lease,
        });
    }

    async fn call<T, F>(&self, f: F) -> Answer<T>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(HARD_TIMEOUT, f).await {
            Err(_) => Answer::Info("timeout".into()),
            Ok(Ok(r)) => Answer::Ok(r.into_inner()),
            Ok(Err(s)) => match stateseal::internals::status::reason_of(&s) {
                Some(r) => refused(r),
                None => Answer::Info(format!("{:?}", s.code())),
            },
        }
    }

    async fn seal(&self, p: &str, n: u64, replica: usize) -> Option<String> {
        let req = SealRequest {
            binding: Some(Self::binding(n)),
            state: b"nemesis".to_vec(),
            ttl_seconds: self.ttl,
            single_use: true,
            input_requests_json: String::new(),
        };
        let t0 = self.hist.now();
        let a = self.call(self.clients[replica].clone().seal(req)).await;
        self.record(p, "seal", n, None, None, t0, replica, &a, None, None);
        match a {
            Answer::Ok(r) => Some(r.request_state),
            _ => None,
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn open_once(
        &self,
        p: &str,
        n: u64,
        token: &str,
        mode: OpenMode,
        attempt: &str,
        replica: usize,
    ) -> Answer<OpenResponse> {
        let req = OpenRequest {
            request_state: token.to_owned(),
            binding: Some(Self::binding(n)),
            mode: mode as i32,
            lease_seconds: LEASE_S,
            attempt_id: attempt.to_owned(),
            input_responses_json: String::new(),
            commit: String::new(),
        };
        let t0 = self.hist.now();
        let a = self.call(self.clients[replica].clone().open(req)).await;
        let (op, rid, consumed, lease) = match (&a, mode) {
            (Answer::Ok(r), OpenMode::Reserve) => (
                "open_reserve",
                (!r.reservation.is_empty()).then(|| self.reservation_id(&r.reservation)),
                Some(r.consumed),
                Some(f64::from(r.lease_seconds)),
            ),
            (Answer::Ok(r), OpenMode::Consume) => ("open_consume", None, Some(r.consumed), None),
            (_, OpenMode::Reserve) => ("open_reserve", None, Some(false), None),
            (_, OpenMode::Consume) => ("open_consume", None, Some(false), None),
        };
        self.record(
            p,
            op,
            n,
            Some(attempt),
            rid,
            t0,
            replica,
            &a,
            consumed,
            lease,
        );
        a
    }

    /// Opens, resending the same attempt id (to any replica) while the
    /// answer is indeterminate, three times at most.
    async fn open(
        &self,
        p: &str,
        n: u64,
        token: &str,
        mode: OpenMode,
        attempt: &str,
        rng: &mut StdRng,
    ) -> Option<OpenResponse> {
        for _ in 0..3 {
            let replica = rng.gen_range(0..self.clients.len());
            match self.open_once(p, n, token, mode, attempt, replica).await {
                Answer::Ok(r) => return Some(r),
                Answer::Fail(_) => return None,
                Answer::Info(_) => {}
            }
        }
        None
    }

    /// Commit, Renew or Release of `reservation`, resent while
    /// indeterminate, three times at most; true when acknowledged.
    #[allow(clippy::too_many_arguments)]
    async fn settle(
        &self,
        p: &str,
        op: &str,
        n: u64,
        attempt: &str,
        rid: &str,
        reservation: &str,
        rng: &mut StdRng,
    ) -> bool {
        for _ in 0..3 {
            match self
                .settle_once(p, op, n, attempt, rid, reservation, rng, None)
                .await
            {
                Answer::Ok(()) => return true,
                Answer::Fail(_) => return false,
                Answer::Info(_) => {}
            }
        }
        false
    }

    /// One Commit (an RPC, or carried by an Open), Renew or Release of
    /// `reservation` on a random replica, with `deadline` as the call's
    /// `grpc-timeout` (the channel's otherwise); one history line.
    #[allow(clippy::too_many_arguments)]
    async fn settle_once(
        &self,
        p: &str,
        op: &str,
        n: u64,
        attempt: &str,
        rid: &str,
        reservation: &str,
        rng: &mut StdRng,
        deadline: Option<Duration>,
    ) -> Answer<()> {
        let replica = rng.gen_range(0..self.clients.len());
        let mut c = self.clients[replica].clone();
        let r = reservation.to_owned();
        let t0 = self.hist.now();
        let (a, lease): (Answer<()>, Option<f64>) = match op {
            "commit" if rng.gen_bool(0.5) => (self.carried_commit(&mut c, r, deadline).await, None),
            "commit" => {
                let a = self
                    .call(c.commit(timed(CommitRequest { reservation: r }, deadline)))
                    .await;
                (map(a, |_| ()), None)
            }
            "release" => {
                let a = self
                    .call(c.release(timed(ReleaseRequest { reservation: r }, deadline)))
                    .await;
                (map(a, |_| ()), None)
            }
            _ => {
                let req = RenewRequest {
                    reservation: r,
                    lease_seconds: LEASE_S,
                };
                let a = self.call(c.renew(timed(req, deadline))).await;
                let lease = match &a {
                    Answer::Ok(x) => Some(f64::from(x.lease_seconds)),
                    _ => None,
                };
                (map(a, |_| ()), lease)
            }
        };
        self.record(
            p,
            op,
            n,
            Some(attempt),
            Some(rid.to_owned()),
            t0,
            replica,
            &a,
            None,
            lease,
        );
        a
    }

    /// A Commit carried by an Open (`OpenRequest.commit`) of a reusable
    /// token sealed for it on the same replica; judged as the Commit RPC's
    /// answer would be. Indeterminate when the carrier fails.
    async fn carried_commit(
        &self,
        c: &mut RequestStateClient<tonic::transport::Channel>,
        reservation: String,
        deadline: Option<Duration>,
    ) -> Answer<()> {
        let seal = SealRequest {
            binding: Some(Self::binding(u64::MAX)),
            state: b"carrier".to_vec(),
            ttl_seconds: self.ttl,
            single_use: false,
            input_requests_json: String::new(),
        };
        let Answer::Ok(carrier) = self.call(c.seal(seal)).await else {
            return Answer::Info("carrier not sealed".into());
        };
        let open = timed(
            OpenRequest {
                request_state: carrier.request_state,
                binding: Some(Self::binding(u64::MAX)),
                commit: reservation,
                ..OpenRequest::default()
            },
            deadline,
        );
        let outcome = match self.call(c.open(open)).await {
            Answer::Ok(r) => r.commits.into_iter().next(),
            // The carried commit was decided or not: unknown.
            _ => return Answer::Info("carrier open refused".into()),
        };
        match outcome {
            Some(o) if o.reason.is_empty() => Answer::Ok(()),
            Some(o) => refused(o.reason),
            None => Answer::Info("no outcome".into()),
        }
    }

    /// Reserve, maybe renew, then commit (most often) or release.
    async fn reserve_flow(&self, p: &str, n: u64, token: &str, rng: &mut StdRng) {
        let a = self.attempt();
        let Some(r) = self.open(p, n, token, OpenMode::Reserve, &a, rng).await else {
            return;
        };
        if r.reservation.is_empty() {
            return;
        }
        let rid = self.reservation_id(&r.reservation);
        if rng.gen_bool(0.4) {
            tokio::time::sleep(Duration::from_millis(rng.gen_range(0..700))).await;
            self.settle(p, "renew", n, &a, &rid, &r.reservation, rng)
                .await;
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..50))).await;
        let op = if rng.gen_bool(0.85) {
            "commit"
        } else {
            "release"
        };
        self.settle(p, op, n, &a, &rid, &r.reservation, rng).await;
    }

    /// Two attempts at once on two replicas.
    async fn duplicates(&self, p: &str, n: u64, token: &str, rng: &mut StdRng) {
        let (a1, a2) = (self.attempt(), self.attempt());
        let r1 = rng.gen_range(0..self.clients.len());
        let r2 = (r1 + 1) % self.clients.len();
        let m1 = if rng.gen_bool(0.5) {
            OpenMode::Reserve
        } else {
            OpenMode::Consume
        };
        let m2 = if rng.gen_bool(0.5) {
            OpenMode::Reserve
        } else {
            OpenMode::Consume
        };
        let (x1, x2) = tokio::join!(
            self.open_once(p, n, token, m1, &a1, r1),
            self.open_once(p, n, token, m2, &a2, r2)
        );
        for ((a, x), m) in [(a1, x1), (a2, x2)].into_iter().zip([m1, m2]) {
            let x = match x {
                // Indeterminate: resent with the same attempt id.
                Answer::Info(_) => self.open(p, n, token, m, &a, rng).await,
                Answer::Ok(r) => Some(r),
                Answer::Fail(_) => None,
            };
            if let Some(r) = x {
                if !r.reservation.is_empty() {
                    let rid = self.reservation_id(&r.reservation);
                    self.settle(p, "commit", n, &a, &rid, &r.reservation, rng)
                        .await;
                }
            }
        }
    }

    /// Reserve, then walk away (or release); another caller takes the token
    /// over after the lease.
    async fn abandon(&self, p: &str, n: u64, token: &str, rng: &mut StdRng) {
        let a = self.attempt();
        let held = match self.open(p, n, token, OpenMode::Reserve, &a, rng).await {
            Some(r) if !r.reservation.is_empty() => {
                let rid = self.reservation_id(&r.reservation);
                if rng.gen_bool(0.3) {
                    self.settle(p, "release", n, &a, &rid, &r.reservation, rng)
                        .await;
                    None
                } else {
                    Some((r.reservation, a, rid))
                }
            }
            _ => None,
        };
        self.later.lock().unwrap().push_back(Abandoned {
            ready: Instant::now() + Duration::from_millis(u64::from(LEASE_S) * 1000 + 300),
            n,
            token: token.to_owned(),
            held,
        });
    }

    /// Takes over an abandoned token; then the old holder tries to commit.
    async fn take_over(&self, p: &str, t: Abandoned, rng: &mut StdRng) {
        let b = self.attempt();
        let Some(r) = self
            .open(p, t.n, &t.token, OpenMode::Reserve, &b, rng)
            .await
        else {
            return;
        };
        if r.reservation.is_empty() {
            return;
        }
        let rid = self.reservation_id(&r.reservation);
        if let Some((old, a, old_rid)) = &t.held {
            self.settle(p, "commit", t.n, a, old_rid, old, rng).await;
        }
        let op = if rng.gen_bool(0.8) {
            "commit"
        } else {
            "release"
        };
        self.settle(p, op, t.n, &b, &rid, &r.reservation, rng).await;
    }

    /// A package's in-process replay: waits while the token's Commit is
    /// kept (5 s at most); false when it still is (the Open is not sent).
    async fn gate(&self, n: u64) -> bool {
        let until = Instant::now() + KEPT_WAIT;
        while self.kept.lock().unwrap().contains_key(&n) {
            if Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    }

    /// The handler of `attempt` completed (invoked at `invoke`).
    fn handler(&self, p: &str, n: u64, attempt: &str, rid: Option<String>, invoke: f64) {
        self.hist.record(&Op {
            process: p.into(),
            op: "handler".into(),
            token: format!("t{n}"),
            attempt: Some(attempt.into()),
            reservation: rid,
            invoke,
            complete: self.hist.now(),
            outcome: "ok".into(),
            reason: None,
            consumed: None,
            replica: None,
            lease: None,
        });
    }

    /// The MCP flow as a package runs it (patroni): Open (CONSUME, or
    /// RESERVE and a handler renewed while it runs, then its Commit or, when
    /// it fails, its Release kept). `late`: an abandoned reservation of the
    /// token whose holder tries to Commit once this Open took it over.
    async fn packaged(
        &self,
        p: &str,
        n: u64,
        token: &str,
        mode: OpenMode,
        late: Option<&(String, String, String)>,
        rng: &mut StdRng,
    ) {
        if !self.gate(n).await {
            return;
        }
        let a = self.attempt();
        self.opening.lock().unwrap().entry(n).or_default().0 += 1;
        let opened = self.open(p, n, token, mode, &a, rng).await;
        let answered = {
            let mut o = self.opening.lock().unwrap();
            let e = o.get_mut(&n).expect("registered above");
            e.0 -= 1;
            let answered = e.1;
            if e.0 == 0 {
                o.remove(&n);
            }
            answered
        };
        let Some(r) = opened else {
            return;
        };
        if answered || self.kept.lock().unwrap().contains_key(&n) {
            // On its way as this process's handler of the token answered,
            // decided after its lease ran out (an outage): the handler ran
            // here, so it does not run again, and a reservation this Open
            // took is committed for it (the package answers IN_USE).
            if !r.reservation.is_empty() {
                let rid = self.reservation_id(&r.reservation);
                self.keep(p, "commit", n, &a, &rid, &r.reservation, true, rng)
                    .await;
            }
            return;
        }
        if mode == OpenMode::Consume {
            if r.consumed {
                let t0 = self.hist.now();
                tokio::time::sleep(Duration::from_millis(rng.gen_range(0..50))).await;
                self.handler(p, n, &a, None, t0);
            }
            return;
        }
        if r.reservation.is_empty() {
            return;
        }
        let rid = self.reservation_id(&r.reservation);
        if let Some((old, old_a, old_rid)) = late {
            self.settle(p, "commit", n, old_a, old_rid, old, rng).await;
        }
        // The handler runs, its lease renewed every third of it.
        let t0 = self.hist.now();
        let done = Instant::now() + Duration::from_millis(rng.gen_range(0..1500));
        let mut renewed = Instant::now();
        let mut renewing = true;
        while Instant::now() < done {
            let next = (renewed + TRY_DEADLINE).min(done);
            tokio::time::sleep_until(next.into()).await;
            if renewing && renewed.elapsed() >= TRY_DEADLINE {
                renewing = self.renew_kept(p, n, &a, &rid, &r.reservation, rng).await;
                renewed = Instant::now();
            }
        }
        let op = if rng.gen_bool(0.85) {
            self.handler(p, n, &a, Some(rid.clone()), t0);
            "commit"
        } else {
            "release"
        };
        self.keep(p, op, n, &a, &rid, &r.reservation, renewing, rng)
            .await;
    }

    /// One Renew; false once the ledger says the lease is lost.
    async fn renew_kept(
        &self,
        p: &str,
        n: u64,
        a: &str,
        rid: &str,
        reservation: &str,
        rng: &mut StdRng,
    ) -> bool {
        !matches!(
            self.settle_once(p, "renew", n, a, rid, reservation, rng, Some(TRY_DEADLINE))
                .await,
            Answer::Fail(_)
        )
    }

    /// A Commit (the token marked kept meanwhile) or Release tried until a
    /// definite answer or [`COMMIT_WINDOW`], 50 ms doubling to 500 ms
    /// apart; a Commit's lease renewed meanwhile.
    #[allow(clippy::too_many_arguments)]
    async fn keep(
        &self,
        p: &str,
        op: &str,
        n: u64,
        a: &str,
        rid: &str,
        reservation: &str,
        mut renewing: bool,
        rng: &mut StdRng,
    ) {
        let commit = op == "commit";
        if commit {
            *self.kept.lock().unwrap().entry(n).or_default() += 1;
            if let Some(e) = self.opening.lock().unwrap().get_mut(&n) {
                e.1 = true;
            }
        }
        let until = Instant::now() + COMMIT_WINDOW;
        let (mut pause, mut renewed) = (Duration::from_millis(50), Instant::now());
        loop {
            let x = self
                .settle_once(p, op, n, a, rid, reservation, rng, Some(TRY_DEADLINE))
                .await;
            if !matches!(x, Answer::Info(_)) || Instant::now() + pause > until {
                break;
            }
            if commit && renewing && renewed.elapsed() >= TRY_DEADLINE {
                renewing = self.renew_kept(p, n, a, rid, reservation, rng).await;
                renewed = Instant::now();
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
        if commit {
            let mut kept = self.kept.lock().unwrap();
            if let Some(k) = kept.get_mut(&n) {
                *k -= 1;
                if *k == 0 {
                    kept.remove(&n);
                }
            }
        }
    }

    /// One round of a caller as a package runs it (patroni).
    async fn packaged_round(&self, p: &str, n: u64, token: &str, rng: &mut StdRng) {
        let mode = |rng: &mut StdRng| {
            if rng.gen_bool(0.5) {
                OpenMode::Reserve
            } else {
                OpenMode::Consume
            }
        };
        match rng.gen_range(0..100) {
            0..=49 => {
                self.packaged(p, n, token, OpenMode::Reserve, None, rng)
                    .await
            }
            50..=69 => {
                self.packaged(p, n, token, OpenMode::Consume, None, rng)
                    .await
            }
            70..=84 => {
                // Two attempts at once.
                let (mut r1, mut r2) = (
                    StdRng::seed_from_u64(rng.gen()),
                    StdRng::seed_from_u64(rng.gen()),
                );
                let (m1, m2) = (mode(rng), mode(rng));
                tokio::join!(
                    self.packaged(p, n, token, m1, None, &mut r1),
                    self.packaged(p, n, token, m2, None, &mut r2)
                );
            }
            _ => self.abandon(p, n, token, rng).await,
        }
        if rng.gen_bool(0.25) {
            // The user's (or an attacker's) replay through the package.
            let m = mode(rng);
            self.packaged(p, n, token, m, None, rng).await;
        }
    }

    async fn caller(&self, id: usize, seed: u64, stop: &Stop) {
        let p = format!("c{id}");
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add((id as u64 + 1) * 7919));
        while !stop.now() {
            let ready = {
                let mut l = self.later.lock().unwrap();
                match l.front() {
                    Some(t) if t.ready <= Instant::now() => l.pop_front(),
                    _ => None,
                }
            };
            if let Some(t) = ready {
                if self.packaged {
                    let (n, token) = (t.n, t.token.clone());
                    self.packaged(&p, n, &token, OpenMode::Reserve, t.held.as_ref(), &mut rng)
                        .await;
                } else {
                    self.take_over(&p, t, &mut rng).await;
                }
                continue;
            }
            let n = self.next_token.fetch_add(1, Ordering::Relaxed);
            let replica = rng.gen_range(0..self.clients.len());
            let Some(token) = self.seal(&p, n, replica).await else {
                // A replica down or refusing: back off a little.
                tokio::time::sleep(Duration::from_millis(250)).await;
                continue;
            };
            self.tokens.lock().unwrap().push((n, token.clone()));
            if self.packaged {
                self.packaged_round(&p, n, &token, &mut rng).await;
                continue;
            }
            match rng.gen_range(0..100) {
                0..=44 => self.reserve_flow(&p, n, &token, &mut rng).await,
                45..=69 => {
                    let a = self.attempt();
                    self.open(&p, n, &token, OpenMode::Consume, &a, &mut rng)
                        .await;
                }
                70..=84 => self.duplicates(&p, n, &token, &mut rng).await,
                _ => self.abandon(&p, n, &token, &mut rng).await,
            }
            if rng.gen_bool(0.25) {
                // A replay of a completed token, as an attacker would send.
                let a = self.attempt();
                let m = if rng.gen_bool(0.5) {
                    OpenMode::Reserve
                } else {
                    OpenMode::Consume
                };
                self.open(&p, n, &token, m, &a, &mut rng).await;
            }
        }
    }

    /// After recovery: every token sealed is opened once more with a fresh
    /// attempt (resent with the same id), until a definite answer (leases still held run out first;
    /// two minutes at most per token).
    pub async fn final_replay(self: &Arc<Self>) {
        let tokens = std::mem::take(&mut *self.tokens.lock().unwrap());
        let queue = Arc::new(Mutex::new(tokens));
        let mut workers = Vec::new();
        for w in 0..32usize {
            let (me, q) = (self.clone(), queue.clone());
            workers.push(tokio::spawn(async move {
                loop {
                    let Some((n, token)) = q.lock().unwrap().pop() else {
                        return;
                    };
                    let deadline = Instant::now() + Duration::from_secs(120);
                    let mut i = w;
                    // One attempt id, resent: a try that consumed before its
                    // answer was lost gets the same success again.
                    let a = me.attempt();
                    loop {
                        i += 1;
                        let x = me
                            .open_once(
                                "final",
                                n,
                                &token,
                                OpenMode::Consume,
                                &a,
                                i % me.clients.len(),
                            )
                            .await;
                        let done = match &x {
                            Answer::Ok(_) => true,
                            Answer::Fail(r) => r == "REPLAYED",
                            Answer::Info(_) => false,
                        };
                        if done || Instant::now() > deadline {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                }
            }));
        }
        for w in workers {
            w.await.unwrap();
        }
    }
}

/// A request with `deadline` as its `grpc-timeout`, when given.
fn timed<M>(m: M, deadline: Option<Duration>) -> tonic::Request<M> {
    let mut req = tonic::Request::new(m);
    if let Some(d) = deadline {
        req.set_timeout(d);
    }
    req
}

fn map<T, U>(a: Answer<T>, f: impl FnOnce(T) -> U) -> Answer<U> {
    match a {
        Answer::Ok(t) => Answer::Ok(f(t)),
        Answer::Fail(r) => Answer::Fail(r),
        Answer::Info(r) => Answer::Info(r),
    }
}
