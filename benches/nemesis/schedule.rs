//! The nemesis schedule: seeded, random, up to three faults at once on
//! distinct targets (a replica or the database), each applied for a random
//! window and healed; every window is written to the faults file.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use super::cluster::{Cluster, CLOCK_SKEW_S, DB_TIMEOUT_MS, LEASE_S};
use super::history::{Fault, FaultLog};
use super::net::Chain;
use super::{Stop, Store};

/// Offsets "beyond" the skew reach this far.
pub const CLOCK_BEYOND_MAX_S: u64 = 60;
const MAX_ACTIVE: usize = 2;

const PG_KINDS: &[&str] = &[
    "partition-db",
    "partition-db-in",
    "partition-db-out",
    "partition-clients",
    "partition-clients-in",
    "partition-clients-out",
    "slow-db",
    "slow-clients",
    "clock-within",
    "clock-beyond",
    "pause",
    "kill",
    "pg-restart-fast",
    "pg-restart-immediate",
];
const SLED_KINDS: &[&str] = &["clock-within", "clock-beyond", "pause", "kill", "disk-full"];
/// On patroni the database's faults come twice as often as a replica's:
/// each is a failover (but the etcd member's) and then a heal, which take
/// tens of seconds, one at a time.
const PATRONI_KINDS: &[&str] = &[
    "kill-primary",
    "kill-primary",
    "partition-primary",
    "partition-primary",
    "switchover",
    "switchover",
    "kill-etcd-member",
    "pause",
    "kill",
];

/// A fault of the database (the last target) rather than of a replica.
fn on_database(kind: &str) -> bool {
    kind.starts_with("pg-") || REPLICATED.contains(&kind)
}
const REPLICATED: &[&str] = &[
    "kill-primary",
    "partition-primary",
    "switchover",
    "kill-etcd-member",
];

/// Runs until `stop`, then waits for every heal; returns the faults
/// injected by kind.
pub async fn run(
    cluster: Arc<Cluster>,
    log: Arc<FaultLog>,
    seed: u64,
    stop: Arc<Stop>,
) -> BTreeMap<String, usize> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let kinds = match cluster.store {
        Store::Postgres => PG_KINDS,
        Store::Sled => SLED_KINDS,
        Store::Patroni => PATRONI_KINDS,
    };
    let targets = cluster.replicas.len() + usize::from(cluster.store != Store::Sled);
    let busy = Arc::new(std::sync::Mutex::new(vec![false; targets]));
    let mut injected: BTreeMap<String, usize> = BTreeMap::new();
    let mut tasks = Vec::new();
    // The first seconds run clean, so that the history starts with a
    // baseline.
    tokio::time::sleep(Duration::from_secs(2)).await;
    while !stop.now() {
        cluster.supervise().await;
        tokio::time::sleep(Duration::from_millis(rng.gen_range(500..2500))).await;
        if stop.now() {
            break;
        }
        let kind = kinds[rng.gen_range(0..kinds.len())];
        // The database is the last target.
        let target = if on_database(kind) {
            targets - 1
        } else {
            rng.gen_range(0..cluster.replicas.len())
        };
        {
            let mut b = busy.lock().unwrap();
            if b.iter().filter(|x| **x).count() >= MAX_ACTIVE || b[target] {
                continue;
            }
            b[target] = true;
        }
        *injected.entry(kind.to_owned()).or_default() += 1;
        stop.faults
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let window = Duration::from_millis(rng.gen_range(1000..6000));
        let param: u64 = rng.gen();
        let (c, l, b, s) = (cluster.clone(), log.clone(), busy.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let start = l.now();
            let detail = if REPLICATED.contains(&kind) {
                let cl = c.clone();
                let (detail, failover) =
                    tokio::task::spawn_blocking(move || cl.replicated_fault(kind, window))
                        .await
                        .unwrap();
                if failover {
                    s.failovers
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                detail
            } else {
                apply(&c, kind, target, window, param).await
            };
            l.record(&Fault {
                kind: kind.to_owned(),
                target: if on_database(kind) {
                    "postgres".into()
                } else {
                    format!("replica{target}")
                },
                start,
                end: l.now(),
                detail,
            });
            b.lock().unwrap()[target] = false;
        }));
        tasks.retain(|t| !t.is_finished());
    }
    for t in tasks {
        t.await.unwrap();
    }
    injected
}

/// Applies one fault for `window` and heals it; returns its parameters.
async fn apply(c: &Cluster, kind: &str, target: usize, window: Duration, param: u64) -> String {
    let sleep = || tokio::time::sleep(window);
    let ms = window.as_millis();
    let r = c.replicas.get(target);
    match kind {
        "partition-db"
        | "partition-db-in"
        | "partition-db-out"
        | "partition-clients"
        | "partition-clients-in"
        | "partition-clients-out" => {
            let ns = r.and_then(|r| r.ns.as_ref()).unwrap();
            let chains: &[Chain] = match kind {
                "partition-db" => &[Chain::DbIn, Chain::DbOut],
                "partition-db-in" => &[Chain::DbIn],
                "partition-db-out" => &[Chain::DbOut],
                "partition-clients" => &[Chain::ClientsIn, Chain::ClientsOut],
                "partition-clients-in" => &[Chain::ClientsIn],
                _ => &[Chain::ClientsOut],
            };
            for ch in chains {
                ns.block(*ch).unwrap();
            }
            sleep().await;
            for ch in chains {
                ns.heal(*ch).unwrap();
            }
            format!("{ms} ms")
        }
        "slow-db" | "slow-clients" => {
            let r = r.unwrap();
            let p = if kind == "slow-db" {
                r.db_proxy.as_ref()
            } else {
                r.client_proxy.as_ref()
            }
            .unwrap();
            let delay = 5 + param % 250;
            let loss = (param >> 16) % 60;
            p.set(delay, loss);
            sleep().await;
            p.set(0, 0);
            format!("{ms} ms, delay {delay} ms, loss {loss}/1000")
        }
        "clock-within" | "clock-beyond" => {
            let r = r.unwrap();
            let sign = if param & 1 == 0 { 1 } else { -1 };
            let mag = if kind == "clock-within" {
                1 + (param >> 1) % (CLOCK_SKEW_S - 1)
            } else {
                CLOCK_SKEW_S + 1 + (param >> 1) % (CLOCK_BEYOND_MAX_S - CLOCK_SKEW_S)
            };
            // On sled a replica (re)started during a step anchors its lease
            // clock to the stepped wall clock: after a step forward beyond
            // the skew, the leases it inherits end early by more than the
            // grace (docs/operations.md, Clocks). Steps forward stay within
            // the skew there.
            let sign = if c.store == Store::Sled && kind == "clock-beyond" {
                -1
            } else {
                sign
            };
            let offset = sign * mag as i64;
            r.set_clock(offset);
            sleep().await;
            r.set_clock(0);
            format!("{ms} ms, offset {offset:+} s")
        }
        "pause" => {
            // Longer than a lease and than the database timeout.
            let d = Duration::from_millis(
                u64::from(LEASE_S) * 1000 + DB_TIMEOUT_MS + 500 + param % 4000,
            );
            r.unwrap().pause(d).await;
            format!("SIGSTOP {} ms", d.as_millis())
        }
        "kill" => {
            let down = Duration::from_millis(param % 3000);
            r.unwrap().kill_restart(down).await;
            format!("kill -9, down {} ms", down.as_millis())
        }
        "pg-restart-fast" | "pg-restart-immediate" => {
            let mode = kind.trim_start_matches("pg-restart-");
            let t = Instant::now();
            let m = mode.to_owned();
            // pg_ctl blocks: off the runtime's workers.
            tokio::task::block_in_place(|| c.pg_restart(&m));
            format!("pg_ctl restart -m {mode}, {} ms", t.elapsed().as_millis())
        }
        "disk-full" => {
            let filler = tokio::task::block_in_place(|| c.fill_disk());
            sleep().await;
            if let Some(f) = filler {
                let _ = std::fs::remove_file(f);
            }
            format!("{ms} ms")
        }
        other => unreachable!("fault kind {other}"),
    }
}
