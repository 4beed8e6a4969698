//! One window of one scenario: its callers, their pacing, the latency of
//! every op, and its failures (the first five of each reason printed).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use super::args::Args;
use super::clients::{reason, Ctx, Tokens};
use super::scenarios::Scenario;

/// Successful ops over the whole process (for the sampler).
pub static OPS_DONE: AtomicU64 = AtomicU64::new(0);
/// Failures printed so far, by reason (the first 5 of each are).
static ERRORS_SHOWN: std::sync::LazyLock<std::sync::Mutex<BTreeMap<String, u64>>> =
    std::sync::LazyLock::new(Default::default);
/// When the process started: a failure printed says how long after.
pub static PROCESS_START: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

pub struct RunResult {
    pub ops: u64,
    pub secs: f64,
    pub hist: Histogram<u64>,
    pub errors: BTreeMap<String, u64>,
}

/// Runs `scenario` with `--concurrency` callers for `measure` (or until
/// `limit` ops, or until its token pool runs dry), each paced by its share
/// of `--rate`; with `progress`, prints the ops per second each second.
pub async fn run(
    ctx: &Arc<Ctx>,
    scenario: Scenario,
    args: &Args,
    measure: Duration,
    limit: Option<u64>,
    tokens: Option<Tokens>,
    progress: bool,
) -> RunResult {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let ticker = progress.then(|| {
        let (stop, done) = (stop.clone(), done.clone());
        let name = scenario.name();
        tokio::spawn(async move {
            let mut last = 0;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let now = done.load(Ordering::Relaxed);
                eprintln!("  {name:>8}: {:>8} ops/s", now - last);
                last = now;
            }
        })
    });
    let (args_rate, concurrency) = (args.rate, args.concurrency);
    let workers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let (ctx, stop, done, tokens) =
                (ctx.clone(), stop.clone(), done.clone(), tokens.clone());
            tokio::spawn(async move {
                let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
                let mut errors: BTreeMap<String, u64> = BTreeMap::new();
                let mut ops = 0u64;
                // reserve_carried: the reservation the next Open carries.
                let mut carried: Option<String> = None;
                // Each caller takes its share of --rate.
                let mut pace = (args_rate > 0.0).then(|| {
                    let mut i = tokio::time::interval(Duration::from_secs_f64(
                        concurrency as f64 / args_rate,
                    ));
                    i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    i
                });
                while !stop.load(Ordering::Relaxed) && started.elapsed() < measure {
                    if let Some(p) = pace.as_mut() {
                        p.tick().await;
                    }
                    if let Some(l) = limit {
                        if done.fetch_add(1, Ordering::Relaxed) >= l {
                            break;
                        }
                    }
                    let token = match &tokens {
                        Some(Tokens::Reusable(pool, next)) => Some(
                            pool[next.fetch_add(1, Ordering::Relaxed) as usize % pool.len()]
                                .clone(),
                        ),
                        Some(Tokens::SingleUse(pool)) => match pool.lock().expect("pool").pop() {
                            Some(t) => Some(t),
                            None => break, // pool exhausted: the run ends early
                        },
                        None => None,
                    };
                    let t0 = Instant::now();
                    let r = scenario.op(&ctx, w, ops, token, &mut carried).await;
                    let us = t0.elapsed().as_micros().max(1) as u64;
                    hist.saturating_record(us);
                    match r {
                        Ok(()) => {
                            ops += 1;
                            OPS_DONE.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            // The first few failures of each reason, with
                            // when and what, so a long run's rare errors can
                            // be placed.
                            let shown = {
                                let mut m = ERRORS_SHOWN.lock().expect("lock");
                                let n = m.entry(reason(&e)).or_default();
                                *n += 1;
                                *n
                            };
                            if shown <= 5 {
                                eprintln!(
                                    "error at {:.1}s into {}: {} ({:?}: {})",
                                    PROCESS_START.elapsed().as_secs_f64(),
                                    scenario.name(),
                                    reason(&e),
                                    e.code(),
                                    e.message()
                                );
                            }
                            *errors.entry(reason(&e)).or_default() += 1;
                        }
                    }
                    if limit.is_none() {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
                (ops, hist, errors)
            })
        })
        .collect();
    let mut total = RunResult {
        ops: 0,
        secs: 0.0,
        hist: Histogram::new_with_bounds(1, 60_000_000, 3).expect("bounds"),
        errors: BTreeMap::new(),
    };
    for w in workers {
        let (ops, hist, errors) = w.await.expect("worker");
        total.ops += ops;
        total.hist.add(&hist).expect("same bounds");
        for (k, v) in errors {
            *total.errors.entry(k).or_default() += v;
        }
    }
    total.secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = ticker {
        let _ = t.await;
    }
    total
}
