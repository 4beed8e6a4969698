//! The nemesis in its short mode (docs/testing.md, "The nemesis: combined
//! faults"): three replicas on PostgreSQL for two minutes, then one on sled,
//! then three on replicated PostgreSQL (Patroni) through at least three
//! failovers, under combined faults; the checker must find no violation and resolve
//! every indeterminate outcome. And the checker itself, on histories that
//! break each of its rules.
#![allow(clippy::unwrap_used)]

#[path = "../benches/nemesis/mod.rs"]
mod nemesis;

use std::time::Duration;

use nemesis::checker::check;
use nemesis::history::Op;

fn short(store: nemesis::Store, secs: u64, min_ops: u64, min_faults: usize, min_failovers: usize) {
    // `STATESEAL_NEMESIS_STORES=patroni` (comma-separated) runs only those.
    if let Ok(only) = std::env::var("STATESEAL_NEMESIS_STORES") {
        if !only.split(',').any(|s| s.trim() == store.name()) {
            return;
        }
    }
    if let Some(why) = nemesis::unavailable(store) {
        nemesis::skip::skipped(&format!("nemesis-{}", store.name()), &why);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let history = dir.path().join("history.jsonl");
    let seed = std::env::var("STATESEAL_NEMESIS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    // Two minutes at least, and then until the floors are reached (on a
    // slow machine the faults stall more of the callers), five at most.
    let cfg = nemesis::Config {
        min_operations: min_ops,
        min_faults,
        min_failovers,
        max_duration: Duration::from_secs(300),
        ..nemesis::Config::timed(Duration::from_secs(secs), history.clone(), seed, store, 128)
    };
    let s = nemesis::run(&cfg);
    let v = &s.verdict;
    println!(
        "nemesis ({}, seed {seed}): by outcome {:?}; faults {:?}; failovers {}; replicas that exited on their own {}",
        store.name(),
        v.by_outcome,
        s.faults_by_kind,
        s.failovers,
        s.replica_exits
    );
    println!("{}", s.line());
    // CI prints these (.ci/run).
    if let Ok(path) = std::env::var("STATESEAL_NEMESIS_REPORT") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        writeln!(
            f,
            "{} (seed {seed}): {} faults by kind {:?}, failovers {}; by outcome {:?}; tokens {}, acknowledged uses {}, unconfirmed {}, seal timeouts {}, lease overlaps excused by clock steps {}, replicas that exited on their own {}, clock drift {:.3} s, steps of the machine's clock {}\n{}",
            store.name(),
            s.faults(),
            s.faults_by_kind,
            s.failovers,
            v.by_outcome,
            v.tokens,
            v.acknowledged_uses,
            v.unconfirmed,
            v.seal_info,
            v.excused,
            s.replica_exits,
            s.clock_drift,
            s.host_clock_steps,
            s.line()
        )
        .unwrap();
    }
    if !v.violations.is_empty() {
        // Kept for whoever reads the failure.
        let kept = dir.keep();
        panic!(
            "seed {seed}: {} violations (history kept in {}): {:#?}",
            v.violations.len(),
            kept.display(),
            &v.violations[..v.violations.len().min(20)]
        );
    }
    assert_eq!(
        v.unconfirmed, 0,
        "seed {seed}: acknowledged uses the final replay could not confirm"
    );
    assert_eq!(
        v.resolved, v.indeterminate,
        "seed {seed}: indeterminate outcomes left unresolved"
    );
    assert!(
        v.operations >= min_ops,
        "seed {seed}: {} operations, want {min_ops}",
        v.operations
    );
    assert!(
        s.faults() >= min_faults,
        "seed {seed}: {} faults, want {min_faults}",
        s.faults()
    );
    assert!(
        v.acknowledged_uses > 0,
        "seed {seed}: nothing was ever used"
    );
    assert!(
        s.failovers >= min_failovers,
        "seed {seed}: {} failovers, want {min_failovers}",
        s.failovers
    );
}

/// The stores one after the other: each run wants the machine to itself.
#[test]
fn nemesis_short_runs() {
    short(nemesis::Store::Postgres, 120, 50_000, 20, 0);
    short(nemesis::Store::Sled, 60, 25_000, 10, 0);
    short(nemesis::Store::Patroni, 90, 10_000, 4, 3);
}

fn op(process: &str, op: &str, token: &str, attempt: &str, t: (f64, f64), outcome: &str) -> Op {
    Op {
        process: process.into(),
        op: op.into(),
        token: token.into(),
        attempt: Some(attempt.into()),
        reservation: None,
        invoke: t.0,
        complete: t.1,
        outcome: outcome.into(),
        reason: None,
        consumed: None,
        replica: Some(0),
        lease: None,
    }
}
fn consume(attempt: &str, t: (f64, f64), consumed: bool) -> Op {
    Op {
        consumed: Some(consumed),
        ..op("c0", "open_consume", "t1", attempt, t, "ok")
    }
}
fn reserve(attempt: &str, r: &str, t: (f64, f64), lease: f64) -> Op {
    Op {
        reservation: Some(r.into()),
        consumed: Some(false),
        lease: Some(lease),
        ..op("c0", "open_reserve", "t1", attempt, t, "ok")
    }
}
fn settle(what: &str, attempt: &str, r: &str, t: (f64, f64), outcome: &str) -> Op {
    Op {
        reservation: Some(r.into()),
        ..op("c0", what, "t1", attempt, t, outcome)
    }
}
fn replayed(t: (f64, f64)) -> Op {
    Op {
        reason: Some("REPLAYED".into()),
        consumed: Some(false),
        ..op("final", "open_consume", "t1", "z", t, "fail")
    }
}
fn info(mut o: Op) -> Op {
    o.outcome = "info".into();
    o.reason = Some("timeout".into());
    o
}

#[test]
fn checker_passes_a_clean_history_and_resolves_what_was_indeterminate() {
    let v = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 2.0),
            Op {
                lease: Some(2.0),
                ..settle("renew", "a1", "r1", (1.5, 1.6), "ok")
            },
            settle("commit", "a1", "r1", (1.7, 1.8), "ok"),
            // A commit resent after a timeout is the same use.
            settle("commit", "a1", "r1", (1.8, 1.85), "ok"),
            Op {
                reason: Some("REPLAYED".into()),
                ..consume("a2", (2.1, 2.2), false)
            },
            info(consume("a3", (2.3, 5.0), false)),
            replayed((10.0, 10.1)),
        ],
        &[],
    );
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    assert_eq!(
        (v.indeterminate, v.resolved, v.acknowledged_uses),
        (1, 1, 1)
    );
}

#[test]
fn checker_finds_two_uses() {
    let v = check(
        vec![
            consume("a1", (1.0, 1.1), true),
            settle("commit", "a2", "r2", (0.5, 1.2), "ok"),
            replayed((10.0, 10.1)),
        ],
        &[],
    );
    assert!(
        v.violations
            .iter()
            .any(|x| x.contains("used by 2 attempts")),
        "{:?}",
        v.violations
    );
}

#[test]
fn checker_finds_overlapping_leases_but_not_successive_ones() {
    let overlap = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 2.0),
            reserve("a2", "r2", (2.0, 2.1), 2.0),
        ],
        &[],
    );
    assert!(
        overlap.violations.iter().any(|x| x.contains("overlapped")),
        "{:?}",
        overlap.violations
    );
    // A renew extends the window.
    let renewed = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 2.0),
            Op {
                lease: Some(2.0),
                ..settle("renew", "a1", "r1", (2.5, 2.6), "ok")
            },
            reserve("a2", "r2", (3.5, 3.6), 2.0),
        ],
        &[],
    );
    assert!(
        renewed.violations.iter().any(|x| x.contains("overlapped")),
        "{:?}",
        renewed.violations
    );
    let after = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 2.0),
            reserve("a2", "r2", (3.2, 3.3), 2.0),
        ],
        &[],
    );
    assert!(after.violations.is_empty(), "{:?}", after.violations);
    // A release ends the window.
    let released = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 2.0),
            settle("release", "a1", "r1", (1.2, 1.3), "ok"),
            reserve("a2", "r2", (1.4, 1.5), 2.0),
        ],
        &[],
    );
    assert!(released.violations.is_empty(), "{:?}", released.violations);
    assert!(after.violations.is_empty(), "{:?}", after.violations);
    // On sled a clock step that meets a window excuses its overlap, and
    // only that one.
    let history = vec![
        reserve("a1", "r1", (1.0, 1.1), 2.0),
        reserve("a2", "r2", (2.0, 2.1), 2.0),
    ];
    let stepped = check(history.clone(), &[(1.5, 1.6)]);
    assert!(stepped.violations.is_empty(), "{:?}", stepped.violations);
    assert_eq!(stepped.excused, 1);
    let elsewhere = check(history, &[(10.0, 11.0)]);
    assert!(
        elsewhere
            .violations
            .iter()
            .any(|x| x.contains("overlapped")),
        "{:?}",
        elsewhere.violations
    );
}

/// On sled the heal of a step back ends early every lease granted during
/// it. The ledger read its clock somewhere between a reserve's invoke and
/// its complete, so a reserve that began before a step's end and
/// completed after it may hold such a lease (a CI run flagged one: seed
/// 9725421584709082701, `consumed by … against lease …`); a replica also
/// keeps an offset for the shim's reading period after the harness
/// changed it. Both are excused; a lease granted after both still is not.
#[test]
fn checker_excuses_leases_granted_while_a_step_lasted() {
    let history = |reserved: (f64, f64)| {
        vec![
            reserve("a1", "r1", reserved, 2.0),
            consume("a2", (reserved.1 + 0.2, reserved.1 + 0.3), true),
            replayed((20.0, 20.1)),
        ]
    };
    let step = [(1.0, 3.0)];
    let straddling = check(history((2.9, 3.2)), &step);
    assert!(
        straddling.violations.is_empty(),
        "{:?}",
        straddling.violations
    );
    assert_eq!(straddling.excused, 1);
    let after = check(history((3.5, 3.6)), &step);
    assert!(
        after.violations.iter().any(|x| x.contains("against lease")),
        "{:?}",
        after.violations
    );

    // Through the files: a grant within the shim's reading period after
    // the recorded end is excused, one well after it is not.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("history.jsonl");
    let fault = nemesis::history::Fault {
        kind: "clock-within".into(),
        target: "replica0".into(),
        start: 1.0,
        end: 3.0,
        detail: "offset -4 s".into(),
    };
    std::fs::write(
        nemesis::history::faults_path(&path),
        serde_json::to_string(&fault).unwrap() + "\n",
    )
    .unwrap();
    let lag = nemesis::skew::READ_EVERY_MS as f64 / 1000.0;
    for (invoke, excused) in [(3.0 + lag / 2.0, true), (3.0 + 5.0 * lag, false)] {
        let lines: Vec<String> = history((invoke, invoke + 0.01))
            .iter()
            .map(|o| serde_json::to_string(o).unwrap())
            .collect();
        std::fs::write(&path, lines.join("\n")).unwrap();
        let v = nemesis::checker::check_file(&path, true).unwrap();
        assert_eq!(
            v.violations.is_empty(),
            excused,
            "at {invoke}: {:?}",
            v.violations
        );
        let unchecked = nemesis::checker::check_file(&path, false).unwrap();
        assert!(!unchecked.violations.is_empty(), "no steps on PostgreSQL");
    }
    // A step of the machine's own clock (the database's) excuses on
    // PostgreSQL too.
    let host = nemesis::history::Fault {
        kind: "clock-host".into(),
        target: "host".into(),
        ..fault
    };
    std::fs::write(
        nemesis::history::faults_path(&path),
        serde_json::to_string(&host).unwrap() + "\n",
    )
    .unwrap();
    let lines: Vec<String> = history((2.9, 3.2))
        .iter()
        .map(|o| serde_json::to_string(o).unwrap())
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    let v = nemesis::checker::check_file(&path, false).unwrap();
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    assert_eq!(v.excused, 1);
}

#[test]
fn checker_finds_a_grant_after_a_use_and_a_commit_after_a_takeover() {
    let grant = check(
        vec![
            consume("a1", (1.0, 1.1), true),
            reserve("a2", "r2", (5.0, 5.1), 2.0),
            settle("release", "a2", "r2", (5.2, 5.3), "ok"),
            replayed((10.0, 10.1)),
        ],
        &[],
    );
    assert!(
        grant.violations.iter().any(|x| x.contains("after the use")),
        "{:?}",
        grant.violations
    );
    let takeover = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 2.0),
            reserve("a2", "r2", (3.5, 3.6), 2.0),
            settle("release", "a2", "r2", (3.7, 3.8), "ok"),
            settle("commit", "a1", "r1", (4.0, 4.1), "ok"),
            replayed((10.0, 10.1)),
        ],
        &[],
    );
    assert!(
        takeover
            .violations
            .iter()
            .any(|x| x.contains("was granted the token")),
        "{:?}",
        takeover.violations
    );
    let inside = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 5.0),
            consume("a2", (2.0, 2.1), true),
            replayed((10.0, 10.1)),
        ],
        &[],
    );
    assert!(
        inside
            .violations
            .iter()
            .any(|x| x.contains("against lease")),
        "{:?}",
        inside.violations
    );
}

#[test]
fn checker_finds_a_consume_and_a_reserve_granted_at_once() {
    let v = check(
        vec![
            consume("a1", (1.0, 1.05), true),
            reserve("a2", "r1", (1.0, 1.05), 2.0),
            settle("commit", "a2", "r1", (1.06, 1.07), "fail"),
            replayed((10.0, 10.1)),
        ],
        &[],
    );
    assert!(
        v.violations.iter().any(|x| x.contains("against lease")),
        "{:?}",
        v.violations
    );
}

#[test]
fn checker_finds_a_commit_after_a_concurrent_takeover() {
    // a2's reserve overlapped a1's in time and came back after a1's lease
    // window began; then a1's commit was acknowledged.
    let v = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 2.0),
            reserve("a2", "r2", (1.05, 3.3), 2.0),
            settle("commit", "a1", "r1", (3.4, 3.5), "ok"),
            Op {
                reason: Some("LEASE_EXPIRED".into()),
                ..settle("commit", "a2", "r2", (3.6, 3.7), "fail")
            },
            replayed((10.0, 10.1)),
        ],
        &[],
    );
    assert!(
        v.violations
            .iter()
            .any(|x| x.contains("was granted the token")),
        "{:?}",
        v.violations
    );
}

#[test]
fn checker_reads_the_final_replay_by_its_one_attempt() {
    // The final replay's first try was indeterminate and consumed; its
    // resend (same attempt) answers ok again: unused until then.
    let v = check(
        vec![
            settle("commit", "a1", "r1", (1.0, 1.1), "ok"),
            info(Op {
                consumed: Some(false),
                ..op("final", "open_consume", "t1", "z", (10.0, 12.0), "ok")
            }),
            Op {
                consumed: Some(true),
                ..op("final", "open_consume", "t1", "z", (12.1, 12.2), "ok")
            },
        ],
        &[],
    );
    assert!(
        v.violations.iter().any(|x| x.contains("lost")),
        "{:?}",
        v.violations
    );
}

#[test]
fn checker_finds_a_lost_use_and_a_phantom_one() {
    let lost = check(
        vec![
            consume("a1", (1.0, 1.1), true),
            Op {
                consumed: Some(true),
                ..op("final", "open_consume", "t1", "z", (10.0, 10.1), "ok")
            },
        ],
        &[],
    );
    assert!(
        lost.violations.iter().any(|x| x.contains("lost")),
        "{:?}",
        lost.violations
    );
    let phantom = check(
        vec![
            Op {
                reason: Some("IN_USE".into()),
                ..op("c0", "open_consume", "t1", "a1", (1.0, 1.1), "fail")
            },
            replayed((10.0, 10.1)),
        ],
        &[],
    );
    assert!(
        phantom
            .violations
            .iter()
            .any(|x| x.contains("failed definitely")),
        "{:?}",
        phantom.violations
    );
    let unresolved = check(
        vec![
            info(consume("a1", (1.0, 5.0), false)),
            info(replayed((10.0, 14.0))),
        ],
        &[],
    );
    assert_eq!((unresolved.indeterminate, unresolved.resolved), (1, 0));
}

fn handler(attempt: &str, t: (f64, f64)) -> Op {
    Op {
        replica: None,
        ..op("c0", "handler", "t1", attempt, t, "ok")
    }
}

#[test]
fn checker_finds_two_completed_handlers_whatever_the_ledger_answered() {
    // The ledger granted two reservations one after the other (the first
    // lease over): no rule of the ledger's is broken, yet two handlers ran.
    let v = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 2.0),
            handler("a1", (1.1, 1.3)),
            info(settle("commit", "a1", "r1", (1.3, 3.5), "info")),
            reserve("a2", "r2", (4.0, 4.1), 2.0),
            handler("a2", (4.1, 4.3)),
            settle("commit", "a2", "r2", (4.3, 4.4), "ok"),
            replayed((10.0, 10.1)),
        ],
        &[],
    );
    assert!(
        v.violations
            .iter()
            .any(|x| x.contains("handlers of 2 attempts completed")),
        "{:?}",
        v.violations
    );
    // One handler, its commit landed: clean.
    let v = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 2.0),
            handler("a1", (1.1, 1.3)),
            settle("commit", "a1", "r1", (1.3, 1.4), "ok"),
            replayed((10.0, 10.1)),
        ],
        &[],
    );
    assert!(v.violations.is_empty(), "{:?}", v.violations);
}

#[test]
fn checker_finds_a_completed_handler_whose_token_stayed_unused() {
    // The Commit never landed (given up, or lost by the database): the
    // final replay consumed the token, so a user's retry would have run the
    // handler again.
    let v = check(
        vec![
            reserve("a1", "r1", (1.0, 1.1), 2.0),
            handler("a1", (1.1, 1.3)),
            info(settle("commit", "a1", "r1", (1.3, 3.5), "info")),
            Op {
                consumed: Some(true),
                ..op("final", "open_consume", "t1", "z", (10.0, 10.1), "ok")
            },
        ],
        &[],
    );
    assert!(
        v.violations
            .iter()
            .any(|x| x.contains("yet the final replay consumed the token")),
        "{:?}",
        v.violations
    );
}
