//! What the sled ledger's records cost in memory and on disk, at a constant
//! live set, over many generations of churn.
//!
//! ```sh
//! cargo bench --bench ledger_memory -- [--records 200000] [--generations 10] [--consumers 32]
//! ```
//!
//! Time is simulated: each "second", `records / 60` tokens expiring 2 s later
//! are consumed through the real ledger (`consumers` callers at once, so
//! group commit works as in the server), and every 30 "seconds" records
//! past the 60 s skew are collected in batches of 1,000, as the server's
//! collector does. The live set therefore swings between `records` and
//! 1.5 × `records`; a generation is `records` consumptions. After each
//! generation it prints the ledger's record count, the process's RSS, the
//! data directory's size, and RSS above the empty ledger per record.
//! Without `--bench` (as `cargo test --all-targets` runs it) it does a tiny
//! run and checks the count.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Instant;

use stateseal::internals::ledger::sled::SledLedger;
use stateseal::internals::ledger::{Ledger, LedgerKey, TenantTag};

mod support;

/// The server's allocator (src/main.rs): the RSS measured is the server's.
#[global_allocator]
static ALLOCATOR: stateseal::Allocator = stateseal::Allocator;

fn rss_kib() -> u64 {
    support::status_kib("self", "VmRSS:").unwrap_or(0)
}

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bench = args.iter().any(|a| a == "--bench");
    let (records, generations) = if bench {
        (
            arg(&args, "--records", 200_000),
            arg(&args, "--generations", 10),
        )
    } else {
        (1_200, 2)
    };
    let consumers = arg(&args, "--consumers", 32).max(1);
    let per_second = (records / 60).max(1);
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ledger = Arc::new(SledLedger::open(dir.path()).unwrap());
    let empty = rss_kib();
    println!(
        "live set {records} records ({per_second} per simulated second, 60 s skew, collected every 30 s), {consumers} consumers"
    );
    println!("generation  records  rss_kib  dir_kib  bytes_per_record  secs");
    let started = Instant::now();
    let mut now: u64 = 1_000_000;
    let mut next_id: u64 = 0;
    let seconds_per_generation = records.div_ceil(per_second);
    for generation in 1..=generations {
        for _ in 0..seconds_per_generation {
            now += 1;
            let first = next_id;
            next_id += per_second;
            rt.block_on(async {
                let mut tasks = Vec::new();
                for c in 0..consumers {
                    let ledger = ledger.clone();
                    tasks.push(tokio::spawn(async move {
                        let mut i = first + c;
                        while i < first + per_second {
                            let mut id = [0u8; 32];
                            id[..8].copy_from_slice(&i.to_le_bytes());
                            // Spread ids like keyed hashes do.
                            id[8..16].copy_from_slice(
                                &i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes(),
                            );
                            let key = LedgerKey {
                                expires_at: now + 2,
                                id,
                                tenant: TenantTag::default(),
                            };
                            ledger.consume(&key).await.unwrap();
                            i += consumers;
                        }
                    }));
                }
                for t in tasks {
                    t.await.unwrap();
                }
                if now.is_multiple_of(30) {
                    while ledger.remove_expired(now - 60, 1000).await.unwrap() == 1000 {}
                }
            });
        }
        let (held, rss) = (ledger.records(), rss_kib());
        println!(
            "{generation:>10}  {held:>7}  {rss:>7}  {:>7}  {:>16.0}  {:>4.0}",
            support::disk_usage(dir.path()) / 1024,
            (rss.saturating_sub(empty) * 1024) as f64 / held.max(1) as f64,
            started.elapsed().as_secs_f64()
        );
    }
    // The count stays within the live set's swing.
    let held = ledger.records();
    assert!(held > 0 && held <= records * 3 / 2 + per_second, "{held}");
}
