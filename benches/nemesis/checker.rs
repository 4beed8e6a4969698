//! The checker: reads a history (one JSON object per line, see
//! [`super::history::Op`]) and proves, token by token, that
//!
//! 1. no token was acknowledged as used (an `ok` `open_consume` with
//!    `consumed: true`, or an `ok` `commit`) by more than one attempt;
//! 2. no two reservations of different attempts held acknowledged leases
//!    that overlapped. A reservation's window runs from the completion of
//!    its first `ok` `open_reserve` to the latest `invoke + lease` of its
//!    `ok` reserve and renew lines (the ledger decided after `invoke`, so
//!    the lease it granted lasts at least that long), or to the `invoke` of
//!    its first commit or release, when the holder stopped relying on it;
//! 3. no attempt was granted the token (an `ok` reserve or consume) after
//!    another attempt's use was acknowledged; no consume was acknowledged
//!    before the end of another attempt's lease window (whichever was
//!    decided first, one was granted while the other held the token); no
//!    commit was acknowledged after another attempt was granted the token
//!    since its own reserve, or while its own grant fell inside the other's
//!    window;
//! 4. no acknowledged use was lost: the final replay after recovery
//!    (process `final`, `open_consume` with one fresh attempt per token,
//!    resent with that attempt until definite) answers `REPLAYED` for every
//!    token with an acknowledged use, and no token whose every operation
//!    failed definitely turned out used;
//! 5. every `info` (indeterminate) outcome on a token is resolved by that
//!    final replay: the token is known used or known unused;
//! 6. where the callers model the packages (`handler` lines, patroni): no
//!    two attempts completed a handler of one token, whatever the ledger
//!    answered, and no token whose handler completed was still unused at
//!    the final replay (the user's retry would have run it again).
//!
//! `clock_steps`: the steps of the machine's own real-time clock, which
//! the database judges leases by (`clock-host` windows, which the harness
//! records when it sees one), and on sled the clock faults too (on
//! PostgreSQL a replica's clock judges no lease). The sled ledger judges leases
//! by a monotonic clock that a step does not move while the replica runs,
//! but a replica restarted during a step anchors that clock to the stepped
//! wall clock, which moves the leases it inherits or grants by up to the
//! step, beyond the grace (docs/operations.md, Clocks). A lease that a
//! clock fault touched is therefore not held to rules 2 and 3's lease
//! parts and is counted as excused instead. A fault touched a lease when it
//! met the lease's window or any of its grants (the ledger decided a
//! reserve or renew at some time between its `invoke` and its `complete`);
//! [`check_file`] lengthens each fault by the clock shim's reading period
//! (twice over), for which a replica may keep an offset after the harness
//! changed it.

use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;
use std::path::Path;

use super::history::Op;

#[derive(Debug, Default)]
pub struct Verdict {
    pub operations: u64,
    /// `op outcome` → count.
    pub by_outcome: BTreeMap<String, u64>,
    pub tokens: u64,
    pub acknowledged_uses: u64,
    pub violations: Vec<String>,
    /// `info` outcomes of opens, renews, commits and releases.
    pub indeterminate: u64,
    /// Those whose token the final replay resolved.
    pub resolved: u64,
    /// `info` outcomes of seals: no token came back, nothing was written.
    pub seal_info: u64,
    /// Tokens with an acknowledged use that the final replay could not
    /// confirm (it never got a definite answer).
    pub unconfirmed: u64,
    /// Lease overlaps not counted because a clock step met the window.
    pub excused: u64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Final {
    Used,
    Unused,
    Unresolved,
    NotReplayed,
}

/// Checks the history at `path`; with `clock_ledger` (sled) the clock
/// faults of `PATH.faults` are the clock steps.
pub fn check_file(path: &Path, clock_ledger: bool) -> Result<Verdict, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut ops = Vec::new();
    for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let op: Op = serde_json::from_str(&line)
            .map_err(|e| format!("{}:{}: not a history line: {e}", path.display(), n + 1))?;
        ops.push(op);
    }
    // The machine's own clock steps (`clock-host`) on both stores; a
    // replica's on sled only.
    let steps: Vec<(f64, f64)> = super::history::read_faults(&super::history::faults_path(path))
        .into_iter()
        .filter(|f| f.kind == "clock-host" || (clock_ledger && f.kind.starts_with("clock")))
        .map(|f| {
            (
                f.start,
                f.end + 2.0 * super::skew::READ_EVERY_MS as f64 / 1000.0,
            )
        })
        .collect();
    Ok(check(ops, &steps))
}

pub fn check(ops: Vec<Op>, clock_steps: &[(f64, f64)]) -> Verdict {
    let mut v = Verdict {
        operations: ops.len() as u64,
        ..Verdict::default()
    };
    let mut by_token: HashMap<String, Vec<Op>> = HashMap::new();
    for op in ops {
        *v.by_outcome
            .entry(format!("{} {}", op.op, op.outcome))
            .or_default() += 1;
        if op.op == "seal" {
            if op.outcome == "info" {
                v.seal_info += 1;
            }
            continue;
        }
        by_token.entry(op.token.clone()).or_default().push(op);
    }
    let mut tokens: Vec<_> = by_token.into_iter().collect();
    tokens.sort_by(|a, b| a.0.cmp(&b.0));
    v.tokens = tokens.len() as u64;
    for (token, mut ops) in tokens {
        ops.sort_by(|a, b| a.invoke.total_cmp(&b.invoke));
        check_token(&token, &ops, clock_steps, &mut v);
    }
    v
}

fn ok(o: &Op) -> bool {
    o.outcome == "ok"
}
fn is_use(o: &Op) -> bool {
    ok(o) && ((o.op == "open_consume" && o.consumed == Some(true)) || o.op == "commit")
}
fn is_grant(o: &Op) -> bool {
    ok(o) && (o.op == "open_reserve" || (o.op == "open_consume" && o.consumed == Some(true)))
}

struct Window {
    attempt: String,
    start: f64,
    end: f64,
    /// From the first `invoke` to the last `complete` of its grants (the
    /// reserve and the renewals): when the ledger read its clock for them.
    granted_from: f64,
    granted_to: f64,
}

fn check_token(token: &str, all: &[Op], steps: &[(f64, f64)], v: &mut Verdict) {
    let (finals, ops): (Vec<&Op>, Vec<&Op>) = all.iter().partition(|o| o.process == "final");
    // The final replay resends one attempt id: an indeterminate try that
    // consumed makes the next one answer `ok` again, so any `ok` means the
    // token was unused until then, and `REPLAYED` means another used it.
    let fin = if finals.iter().any(|o| ok(o) && o.consumed == Some(true)) {
        Final::Unused
    } else {
        match finals.last() {
            None => Final::NotReplayed,
            Some(o) if o.outcome == "fail" && o.reason.as_deref() == Some("REPLAYED") => {
                Final::Used
            }
            Some(_) => Final::Unresolved,
        }
    };
    let mut found = Vec::new();
    let mut violation = |what: String| found.push(format!("{token}: {what}"));

    // 1. One acknowledged use at most.
    let uses: Vec<&Op> = ops.iter().copied().filter(|o| is_use(o)).collect();
    let mut used_by: Vec<&str> = uses
        .iter()
        .map(|o| o.attempt.as_deref().unwrap_or(""))
        .collect();
    used_by.sort();
    used_by.dedup();
    if used_by.len() > 1 {
        violation(format!("used by {} attempts: {used_by:?}", used_by.len()));
    }

    // 2. Lease windows.
    let mut windows: BTreeMap<&str, Window> = BTreeMap::new();
    for o in ops
        .iter()
        .filter(|o| ok(o) && (o.op == "open_reserve" || o.op == "renew"))
    {
        let (Some(r), Some(lease)) = (o.reservation.as_deref(), o.lease) else {
            continue;
        };
        let w = windows.entry(r).or_insert(Window {
            attempt: o.attempt.clone().unwrap_or_default(),
            start: f64::INFINITY,
            end: f64::NEG_INFINITY,
            granted_from: f64::INFINITY,
            granted_to: f64::NEG_INFINITY,
        });
        if o.op == "open_reserve" {
            w.start = w.start.min(o.complete);
        }
        w.end = w.end.max(o.invoke + lease);
        w.granted_from = w.granted_from.min(o.invoke);
        w.granted_to = w.granted_to.max(o.complete);
    }
    // A holder that sends Commit or Release stops relying on its lease.
    for o in ops.iter().filter(|o| o.op == "commit" || o.op == "release") {
        if let Some(w) = o.reservation.as_deref().and_then(|r| windows.get_mut(r)) {
            w.end = w.end.min(o.invoke);
        }
    }
    let stepped = |w: &Window| {
        let (from, to) = (w.start.min(w.granted_from), w.end.max(w.granted_to));
        steps.iter().any(|(a, b)| *a <= to && *b >= from)
    };
    let mut excused = 0u64;
    let ws: Vec<(&str, &Window)> = windows.iter().map(|(r, w)| (*r, w)).collect();
    for (i, (r1, w1)) in ws.iter().enumerate() {
        for (r2, w2) in &ws[i + 1..] {
            if w1.attempt != w2.attempt && w1.start.max(w2.start) < w1.end.min(w2.end) {
                if stepped(w1) || stepped(w2) {
                    excused += 1;
                    continue;
                }
                violation(format!(
                    "leases {r1} ({}) and {r2} ({}) overlapped: [{:.3}, {:.3}] and [{:.3}, {:.3}]",
                    w1.attempt, w2.attempt, w1.start, w1.end, w2.start, w2.end
                ));
            }
        }
    }

    // 3. Grants after a use, consumes against a lease, commits after a
    // takeover.
    let end_of = |g: &Op| -> f64 {
        match g.op.as_str() {
            "open_reserve" => g
                .reservation
                .as_deref()
                .and_then(|r| windows.get(r))
                .map(|w| if stepped(w) { f64::NEG_INFINITY } else { w.end })
                .unwrap_or(f64::NEG_INFINITY),
            _ => f64::INFINITY,
        }
    };
    for u in &uses {
        let a = u.attempt.as_deref().unwrap_or("");
        for g in ops.iter().filter(|g| is_grant(g)) {
            if g.attempt.as_deref().unwrap_or("") != a && g.invoke > u.complete {
                violation(format!(
                    "granted to {:?} ({} at {:.3}) after the use by {a} acknowledged at {:.3}",
                    g.attempt, g.op, g.invoke, u.complete
                ));
            }
        }
        if u.op == "open_consume" {
            for (r, w) in &ws {
                if w.attempt != a && w.start < w.end && u.complete < w.end {
                    if stepped(w) {
                        excused += 1;
                        continue;
                    }
                    violation(format!(
                        "consumed by {a} against lease {r} of {}",
                        w.attempt
                    ));
                }
            }
        }
        if u.op == "commit" {
            let reserved_at = u
                .reservation
                .as_deref()
                .and_then(|r| windows.get(r))
                .map(|w| w.start)
                .unwrap_or(f64::NEG_INFINITY);
            for g in ops.iter().filter(|g| is_grant(g)) {
                if g.attempt.as_deref().unwrap_or("") != a
                    && g.complete < u.invoke
                    && (g.invoke > reserved_at || reserved_at < end_of(g))
                {
                    violation(format!(
                        "commit of {a} acknowledged after {:?} was granted the token",
                        g.attempt
                    ));
                }
            }
        }
    }

    // 4. Nothing lost, nothing used behind a definite failure.
    if !uses.is_empty() {
        v.acknowledged_uses += 1;
        match fin {
            Final::Unused => {
                violation("an acknowledged use was lost: the final replay consumed it".into())
            }
            Final::Used => {}
            Final::Unresolved | Final::NotReplayed => v.unconfirmed += 1,
        }
    }
    let uncertain = ops
        .iter()
        .any(|o| o.outcome == "info" || (ok(o) && o.op == "open_reserve"));
    if fin == Final::Used && uses.is_empty() && !uncertain {
        violation("used, yet every operation on it failed definitely".into());
    }

    // 6. Handlers.
    let mut handled: Vec<&str> = ops
        .iter()
        .filter(|o| o.op == "handler" && ok(o))
        .map(|o| o.attempt.as_deref().unwrap_or(""))
        .collect();
    handled.sort();
    handled.dedup();
    if handled.len() > 1 {
        violation(format!(
            "handlers of {} attempts completed: {handled:?}",
            handled.len()
        ));
    }
    if !handled.is_empty() && fin == Final::Unused {
        violation(format!(
            "the handler of {} completed, yet the final replay consumed the token",
            handled[0]
        ));
    }
    v.violations.extend(found);
    v.excused += excused;

    // 5. Indeterminate outcomes resolved.
    let infos = ops.iter().filter(|o| o.outcome == "info").count() as u64;
    v.indeterminate += infos;
    if matches!(fin, Final::Used | Final::Unused) {
        v.resolved += infos;
    }
}
