//! The nemesis run (docs/testing.md, "The nemesis: combined faults"):
//!
//!     cargo bench --bench nemesis -- --duration SECS --history FILE [--seed N]
//!         [--store postgres|sled] [--callers N] [--svg FILE]
//!     cargo bench --bench nemesis -- --check FILE [--sled]
//!
//! The first runs three replicas on PostgreSQL (or one on sled) under the
//! nemesis, writes the history to FILE and the fault windows to
//! FILE.faults, checks it and ends with
//! `nemesis: operations=N faults=F violations=V indeterminate=I resolved=R`.
//! The second checks a history written before. Without `--bench` (as
//! `cargo test --all-targets` runs it) it only says how to run it: the short
//! mode is `cargo test --test nemesis`.

#[path = "nemesis/mod.rs"]
mod nemesis;

use std::path::PathBuf;
use std::time::Duration;

fn usage() -> ! {
    eprintln!(
        "usage: cargo bench --bench nemesis -- --duration SECS --history FILE [--seed N] \
         [--store postgres|sled|patroni] [--async-replication] [--callers N] [--svg FILE]\n       \
         cargo bench --bench nemesis -- --check FILE [--sled] [--svg FILE]"
    );
    std::process::exit(2)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut duration, mut history, mut seed, mut store, mut callers) =
        (None, None, None, nemesis::Store::Postgres, 192usize);
    let (mut check, mut sled, mut svg, mut bench) = (None, false, None, false);
    let mut asynchronous = false;
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--bench" => bench = true,
            "--duration" => duration = Some(val().parse::<u64>().unwrap_or_else(|_| usage())),
            "--history" => history = Some(PathBuf::from(val())),
            "--seed" => seed = Some(val().parse::<u64>().unwrap_or_else(|_| usage())),
            "--store" => store = nemesis::Store::parse(&val()).unwrap_or_else(|| usage()),
            "--callers" => callers = val().parse().unwrap_or_else(|_| usage()),
            "--check" => check = Some(PathBuf::from(val())),
            "--sled" => sled = true,
            "--async-replication" => asynchronous = true,
            "--svg" => svg = Some(PathBuf::from(val())),
            _ => usage(),
        }
    }
    if !bench {
        println!(
            "nemesis: not run without --bench; `cargo bench --bench nemesis -- --duration SECS \
             --history FILE` runs it, `cargo test --test nemesis` runs the short mode"
        );
        return;
    }
    if let Some(file) = check {
        let v = nemesis::checker::check_file(&file, sled).unwrap_or_else(|e| {
            eprintln!("nemesis: {e}");
            std::process::exit(2)
        });
        if let Some(out) = svg {
            nemesis::svg::write(&file, &out).expect("write the SVG");
        }
        report(&v);
        println!(
            "nemesis: operations={} violations={} indeterminate={} resolved={}",
            v.operations,
            v.violations.len(),
            v.indeterminate,
            v.resolved
        );
        std::process::exit(i32::from(!v.violations.is_empty()));
    }
    let (Some(duration), Some(history)) = (duration, history) else {
        usage()
    };
    if let Some(why) = nemesis::unavailable(store) {
        eprintln!("\n*** SKIPPED: nemesis: {why} ***\n");
        std::process::exit(1);
    }
    let seed = seed.unwrap_or_else(rand::random);
    let cfg = nemesis::Config {
        asynchronous,
        ..nemesis::Config::timed(
            Duration::from_secs(duration),
            history.clone(),
            seed,
            store,
            callers,
        )
    };
    let s = nemesis::run(&cfg);
    if let Some(out) = svg {
        nemesis::svg::write(&history, &out).expect("write the SVG");
    }
    report(&s.verdict);
    println!("faults by kind: {:?}", s.faults_by_kind);
    if store == nemesis::Store::Patroni {
        println!(
            "failovers (another leader after a fault): {}; replication: {}",
            s.failovers,
            if asynchronous {
                "asynchronous"
            } else {
                "synchronous"
            }
        );
    }
    println!("replicas that exited on their own: {}", s.replica_exits);
    println!(
        "clock drift (real time against the monotonic clock): {:.3} s, in {} step(s) of at least {} s",
        s.clock_drift, s.host_clock_steps, nemesis::HOST_STEP_S
    );
    println!(
        "seed: {seed}; history: {}; faults: {}",
        history.display(),
        s.faults_file.display()
    );
    println!("{}", s.line());
    std::process::exit(i32::from(!s.verdict.violations.is_empty()));
}

fn report(v: &nemesis::checker::Verdict) {
    println!("operations by kind and outcome:");
    for (k, n) in &v.by_outcome {
        println!("  {k:<24} {n}");
    }
    println!(
        "tokens opened: {}; acknowledged uses: {}; unconfirmed by the final replay: {}; seal timeouts: {}; lease overlaps excused by clock steps: {}",
        v.tokens, v.acknowledged_uses, v.unconfirmed, v.seal_info, v.excused
    );
    for x in v.violations.iter().take(50) {
        println!("VIOLATION {x}");
    }
}
