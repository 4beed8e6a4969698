//! The callers: each runs the MCP flow over and over against random
//! replicas — Seal, then Open RESERVE, renew, Commit (as an RPC, or carried
//! by an Open of another token) or Release, or Open
//! CONSUME — with concurrent duplicates, replays of completed tokens,
//! abandoned reservations that others take over after their lease (and
//! whose holders then try to Commit late), and retries with the same
//! attempt id after an indeterminate answer. Every call is one history
//! line.

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

use super::cluster::{Cluster, LEASE_S};
use super::history::{Op, Writer};
use super::{Config, Stop};

/// A deadline the client sets on every call (sent as `grpc-timeout`), and
/// the harness's own bound above it.
const CALL_TIMEOUT: Duration = Duration::from_millis(1500);
const HARD_TIMEOUT: Duration = Duration::from_millis(2500);

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
            let replica = rng.gen_range(0..self.clients.len());
            let mut c = self.clients[replica].clone();
            let r = reservation.to_owned();
            let t0 = self.hist.now();
            let (a, lease): (Answer<()>, Option<f64>) = match op {
                "commit" if rng.gen_bool(0.5) => (self.carried_commit(&mut c, r).await, None),
                "commit" => {
                    let a = self.call(c.commit(CommitRequest { reservation: r })).await;
                    (map(a, |_| ()), None)
                }
                "release" => {
                    let a = self
                        .call(c.release(ReleaseRequest { reservation: r }))
                        .await;
                    (map(a, |_| ()), None)
                }
                _ => {
                    let a = self
                        .call(c.renew(RenewRequest {
                            reservation: r,
                            lease_seconds: LEASE_S,
                        }))
                        .await;
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
            match a {
                Answer::Ok(()) => return true,
                Answer::Fail(_) => return false,
                Answer::Info(_) => {}
            }
        }
        false
    }

    /// A Commit carried by an Open (`OpenRequest.commit`) of a reusable
    /// token sealed for it on the same replica; judged as the Commit RPC's
    /// answer would be. Indeterminate when the carrier fails.
    async fn carried_commit(
        &self,
        c: &mut RequestStateClient<tonic::transport::Channel>,
        reservation: String,
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
        let open = OpenRequest {
            request_state: carrier.request_state,
            binding: Some(Self::binding(u64::MAX)),
            commit: reservation,
            ..OpenRequest::default()
        };
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
                self.take_over(&p, t, &mut rng).await;
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

fn map<T, U>(a: Answer<T>, f: impl FnOnce(T) -> U) -> Answer<U> {
    match a {
        Answer::Ok(t) => Answer::Ok(f(t)),
        Answer::Fail(r) => Answer::Fail(r),
        Answer::Info(r) => Answer::Info(r),
    }
}
