//! The scenarios (benches/load.rs lists them): what each measures, what
//! one op of each is, and the tokens each takes beforehand.

use std::sync::Arc;

use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use super::args::Args;
use super::clients::{json_binding, Ctx, Tokens};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scenario {
    Noop,
    Echo,
    Seal,
    SealJson,
    Open,
    Consume,
    Flow,
    Reserve,
    ReserveCarried,
    OpenReserve,
    Commit,
    EchoFsync,
    Fdatasync,
    Handoff,
    Redis,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Noop => "noop",
            Scenario::Seal => "seal",
            Scenario::SealJson => "seal_json",
            Scenario::Open => "open",
            Scenario::Consume => "consume",
            Scenario::Flow => "flow",
            Scenario::Reserve => "reserve",
            Scenario::ReserveCarried => "reserve_carried",
            Scenario::OpenReserve => "open_reserve",
            Scenario::Commit => "commit",
            Scenario::Fdatasync => "fdatasync",
            Scenario::Handoff => "handoff",
            Scenario::Echo => "echo",
            Scenario::EchoFsync => "echo_fsync",
            Scenario::Redis => "redis",
        }
    }
    /// Whether the calls go to stateseal (echo, echo_fsync and redis go to
    /// servers of their own, so stateseal's CPU says nothing about them).
    pub fn on_stateseal(self) -> bool {
        !matches!(
            self,
            Scenario::Echo
                | Scenario::EchoFsync
                | Scenario::Fdatasync
                | Scenario::Handoff
                | Scenario::Redis
        )
    }
    /// Whether every answer waits for an `fdatasync` of its own store.
    pub fn durable(self) -> bool {
        matches!(
            self,
            Scenario::Consume
                | Scenario::Flow
                | Scenario::Reserve
                | Scenario::ReserveCarried
                | Scenario::OpenReserve
                | Scenario::Commit
                | Scenario::EchoFsync
                | Scenario::Fdatasync
                | Scenario::Redis
        )
    }
    pub fn calls_per_op(self) -> f64 {
        if matches!(self, Scenario::Flow | Scenario::Reserve) {
            2.0
        } else {
            1.0
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim() {
            "noop" => Scenario::Noop,
            "seal" => Scenario::Seal,
            "seal_json" => Scenario::SealJson,
            "open" => Scenario::Open,
            "consume" => Scenario::Consume,
            "flow" => Scenario::Flow,
            "reserve" => Scenario::Reserve,
            "reserve_carried" => Scenario::ReserveCarried,
            "open_reserve" => Scenario::OpenReserve,
            "commit" => Scenario::Commit,
            "fdatasync" => Scenario::Fdatasync,
            "handoff" => Scenario::Handoff,
            "echo" => Scenario::Echo,
            "echo_fsync" => Scenario::EchoFsync,
            "redis" => Scenario::Redis,
            _ => return None,
        })
    }
}

/// The `--scenarios` list, in its order, without `noop` (the baseline
/// always runs) and without a name repeated next to itself.
pub fn list(names: &str) -> Vec<Scenario> {
    let mut scenarios: Vec<Scenario> = names
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| Scenario::parse(s).unwrap_or_else(|| panic!("unknown scenario {s:?}")))
        .filter(|s| *s != Scenario::Noop)
        .collect();
    scenarios.dedup();
    scenarios
}

impl Scenario {
    /// One op of caller `w`, which has `n` successful ops so far (redis
    /// makes its key of it), with the pre-sealed token (or pre-made
    /// reservation) the scenario takes, if any; reserve_carried keeps in
    /// `carried` the reservation its next Open carries.
    pub async fn op(
        self,
        ctx: &Ctx,
        w: usize,
        n: u64,
        token: Option<String>,
        carried: &mut Option<String>,
    ) -> Result<(), tonic::Status> {
        match self {
            Scenario::Noop => {
                let mut h = HealthClient::new(ctx.channels[w % ctx.channels.len()].clone());
                h.check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .map(|_| ())
            }
            Scenario::Seal => ctx.seal(w, false).await.map(|_| ()),
            Scenario::SealJson => ctx.seal_as(w, json_binding(), false).await.map(|_| ()),
            Scenario::Echo => ctx.echo(w).await,
            Scenario::EchoFsync => ctx.echo_fsync(w).await,
            Scenario::Redis => ctx.redis_set(w, n).await,
            Scenario::Open | Scenario::Consume => {
                ctx.open(w, token.expect("pre-sealed token")).await
            }
            Scenario::Flow => match ctx.seal(w, true).await {
                Ok(t) => ctx.open(w, t).await,
                Err(e) => Err(e),
            },
            Scenario::Reserve => {
                ctx.reserve_commit(w, token.expect("pre-sealed token"))
                    .await
            }
            Scenario::ReserveCarried => ctx
                .reserve_carrying(w, token.expect("pre-sealed token"), carried.take())
                .await
                .map(|r| *carried = Some(r)),
            Scenario::OpenReserve => ctx
                .reserve(w, token.expect("pre-sealed token"))
                .await
                .map(|_| ()),
            Scenario::Commit => ctx.commit(w, token.expect("pre-made reservation")).await,
            Scenario::Fdatasync => ctx.fdatasync(),
            Scenario::Handoff => {
                ctx.handoff
                    .as_ref()
                    .expect("the handoff scenario's thread")
                    .call()
                    .await
            }
        }
    }

    /// The tokens a round of this scenario takes, made before it (not
    /// measured): `open` shares `open_pool`'s reusable tokens; the
    /// consuming scenarios get single-use tokens of their own, and
    /// `commit` reservations of them.
    pub async fn tokens(
        self,
        ctx: &Arc<Ctx>,
        args: &Args,
        open_pool: &Arc<Vec<String>>,
    ) -> Option<Tokens> {
        match self {
            Scenario::Open => Some(Tokens::Reusable(open_pool.clone(), Arc::default())),
            Scenario::Consume
            | Scenario::Reserve
            | Scenario::ReserveCarried
            | Scenario::OpenReserve => {
                // Enough for the warm-up and the measured window at
                // up to 40k consumptions/s (a run that drains the
                // pool ends early and reports its true duration).
                let need = args
                    .requests
                    .map(|r| r as usize + (40_000.0 * args.warmup) as usize)
                    .unwrap_or((40_000.0 * (args.duration + args.warmup)) as usize);
                eprintln!("  (pre-sealing {need} single-use tokens)");
                let v = ctx.preseal(need, true, args.concurrency.max(64)).await;
                Some(Tokens::SingleUse(Arc::new(std::sync::Mutex::new(v))))
            }
            Scenario::Commit => {
                // Reservations cost a durable round each: enough
                // for 20k Commits/s, or for one caller 5k/s (a run
                // that drains the pool ends early and says so in
                // its duration).
                let rate = if args.concurrency == 1 {
                    5_000.0
                } else {
                    20_000.0
                };
                let need = args
                    .requests
                    .map(|r| r as usize + (rate * args.warmup) as usize)
                    .unwrap_or((rate * (args.duration + args.warmup)) as usize);
                eprintln!("  (pre-sealing and reserving {need} single-use tokens)");
                let v = ctx.preseal(need, true, args.concurrency.max(64)).await;
                let v = ctx.prereserve(v).await;
                Some(Tokens::SingleUse(Arc::new(std::sync::Mutex::new(v))))
            }
            _ => None,
        }
    }
}
