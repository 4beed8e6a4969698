//! The audit log: one JSON line per decision (Seal, Open, Renew, Commit,
//! Release) and per key lifecycle event, each carrying an HMAC chained over
//! the line before it, under a key derived from the primary root key.
//!
//! Lines hold who asked (tenant, caller identity), what was decided
//! (method, outcome, reason) and keyed digests of what it was about
//! (subject, ledger id, attempt id) — never a state, token, answers,
//! params or key material. The format, and how `stateseal audit verify`
//! checks it, are in docs/security.md ("Audit log").
//!
//! One holder of the writer at a time numbers the lines, computes the
//! chain, writes each batch with one `write(2)` and rotates by size: for a
//! file, the request's own task that finds the writer free (group commit
//! with no hand-off to another thread: the lines queued while it writes are
//! the next round's); for standard output, and to retry a failing sink, a
//! thread of its own. With [`OnFailure::Closed`] a decision's answer waits
//! until its line is written; a sink that cannot be written refuses new Seals and Opens
//! (`AUDIT_UNAVAILABLE`) until it can. Lines that could not be written are
//! kept and written first once it can, so the chain has no gap.
//!
//! A Commit, Renew or Release that succeeds is never refused for the sink:
//! it finishes work a handler has already done, and refusing it would let
//! the lease lapse under a handler that ran, so that the user's retry runs
//! it again (an audit outage turned into a second execution). While the
//! sink fails, their lines are kept (up to [`MAX_PENDING`] bytes; past it a
//! `dropped` line counts them) and their answers do not wait for the write;
//! one refused on its own is refused `AUDIT_UNAVAILABLE`, with no line.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::binding::Tenant;
use crate::domain::error::Reject;
use crate::domain::keyring::{KeyId, Keyring, KeyringHandle};
use crate::domain::sealer::Trail;

pub mod verify;

/// Where the lines go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sink {
    /// A file, rotated by size.
    File(PathBuf),
    /// Standard output (for a container's log collector); never rotated.
    Stdout,
}

/// What a sink that cannot be written does to requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnFailure {
    /// Refuse requests (`AUDIT_UNAVAILABLE`) and hold each answer until its
    /// line is written.
    Closed,
    /// Serve on; lines that cannot be kept are dropped and counted, and a
    /// `dropped` line records how many once the sink writes again.
    Open,
}

#[derive(Clone, Debug)]
pub struct AuditConfig {
    pub sink: Sink,
    /// A file is rotated when a batch would take it past this size.
    pub max_bytes: u64,
    /// One successful Seal in this many is logged (refusals always are).
    pub sample_seals: u32,
    pub on_failure: OnFailure,
    /// This replica's name in every line.
    pub replica: String,
    /// Where the chain's head is kept, outside the log's directory (in the
    /// data directory): the last line written at each start, rotation and
    /// stop and, while lines are written, every [`HEAD_EVERY`],
    /// authenticated. A restart never goes on below it, whatever
    /// files were removed, renamed or planted beside the log. `None`: not
    /// kept.
    pub head: Option<PathBuf>,
}

/// Why the audit log could not start.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("audit log {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "audit log {0}: no complete audit line to chain from; move the file aside to start \
         a new chain"
    )]
    NoChain(PathBuf),
    #[error(
        "audit log {0}: no line verifies under this keyset, though lines name its keys \
         (changed or planted?); check it with `stateseal audit verify`, then move the file \
         aside to start a new chain"
    )]
    Unverified(PathBuf),
    #[error("--audit-sample-seals must be at least 1")]
    Sampling,
    #[error("audit log {0}: another process is writing it")]
    InUse(PathBuf),
}

/// The RPC a decision answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Seal,
    Open,
    Renew,
    Commit,
    Release,
}

impl Method {
    /// Finishes what an earlier Open started (Renew, Commit, Release):
    /// admitted, and answered, while a closed-mode sink fails.
    pub const fn completes(self) -> bool {
        matches!(self, Method::Renew | Method::Commit | Method::Release)
    }

    pub const fn name(self) -> &'static str {
        match self {
            Method::Seal => "seal",
            Method::Open => "open",
            Method::Renew => "renew",
            Method::Commit => "commit",
            Method::Release => "release",
        }
    }
}

/// One decision, as the service saw it. The subject and attempt id are
/// digested on the writer thread and dropped.
#[derive(Clone)]
pub struct Decision {
    pub method: Method,
    pub tenant: Tenant,
    pub caller: Arc<str>,
    /// `consume` or `reserve`, for an Open.
    pub mode: Option<&'static str>,
    pub subject: Option<String>,
    pub attempt: Option<String>,
    pub trail: Trail,
    /// `None` for an acceptance; the reason of a refusal.
    pub refused: Option<Reject>,
}

impl std::fmt::Debug for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decision")
            .field("method", &self.method)
            .field("tenant", &self.tenant.as_str())
            .field("refused", &self.refused)
            .finish_non_exhaustive()
    }
}

/// A key lifecycle event, as a reload applies or refuses it.
#[derive(Clone, Debug)]
pub enum KeyEvent {
    /// A key new to this replica, in its state.
    Added(KeyId, &'static str),
    Promoted(KeyId),
    Demoted(KeyId),
    /// Gone from the keys in force (retired, or removed from the file).
    Retired(KeyId),
    /// A new keyset version is in force.
    ReloadApplied,
    /// A new keyset version was refused; the reason is the loader's error
    /// class (no key bytes: keyset errors never hold them).
    ReloadRefused(String),
}

/// What is queued for the log: made into a line, chained and written by
/// whoever holds the writer.
enum Entry {
    Decision(Decision, u32),
    Key(KeyEvent),
}

/// What the maintenance thread is asked to do.
enum Msg {
    /// Write what is queued (a sink not written inline, or a leader that
    /// went its rounds).
    Drain,
    Stop,
}

/// The figures of the audit log, for the metrics port.
#[derive(Debug, Default)]
pub struct AuditStats {
    pub lines: AtomicU64,
    pub dropped: AtomicU64,
    pub write_failures: AtomicU64,
}

/// Entries queued, not yet made into lines, before `Open` drops and
/// `Closed` refuses.
const QUEUE: usize = 16_384;
/// Most entries made into lines and written with one `write(2)`.
const BATCH: usize = 512;
/// Rounds a request's task writes as the leader (what queued while its
/// previous round was written) before it leaves the rest to the thread.
const LEAD_ROUNDS: u32 = 4;
/// Bytes kept while the sink fails, before lines are dropped.
const MAX_PENDING: usize = 64 * 1024 * 1024;
/// How often a failing sink is tried again.
const RETRY: Duration = Duration::from_millis(500);
/// A write that has not returned after this long (a hung disk or a log
/// reader that stopped reading) counts as failing: closed refuses.
const STALL_MS: u64 = 2_000;
/// The longest a closed-mode answer waits for its line.
const ACK_WAIT: Duration = Duration::from_secs(5);
/// How often a completion waiting for its line looks at the sink's health.
const KEEP_POLL: Duration = Duration::from_millis(50);
/// How often the head is kept while lines are written: lines written
/// since, and only those, can be cut from the log's end unseen.
pub const HEAD_EVERY: Duration = Duration::from_secs(1);
/// The longest a shutdown waits for the writer's `stop` line.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// What the writer tells the request path.
#[derive(Debug, Default)]
struct Health {
    /// The last write (or flush) succeeded.
    failing: AtomicBool,
    /// When the write in progress started (ms since the epoch), or 0.
    writing_since: AtomicU64,
    /// The writer has ended (stopped, or its thread or a leader panicked):
    /// nothing is written any more.
    ended: AtomicBool,
}

/// Marks the writer ended when dropped: the thread's at its end, however
/// it ends (`always`); a leader's only when it unwinds holding the writer
/// (which is then lost).
struct Ended<'a> {
    health: &'a Health,
    always: bool,
}

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        if self.always || std::thread::panicking() {
            self.health.ended.store(true, Ordering::Release);
        }
    }
}

impl Health {
    fn stalled(&self) -> bool {
        let t = self.writing_since.load(Ordering::Acquire);
        t != 0 && now_ms().saturating_sub(t) > STALL_MS
    }
    fn ok(&self) -> bool {
        !self.failing.load(Ordering::Acquire)
            && !self.stalled()
            && !self.ended.load(Ordering::Acquire)
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The queue, and the writer while nobody holds it.
struct Queue {
    entries: Vec<Entry>,
    /// The ticket of the next entry queued (entries are numbered in order).
    next: u64,
    /// `None` while a leader or the thread holds it, and after the stop.
    writer: Option<Box<Writer>>,
    /// The `stop` line is written: nothing more is queued.
    ended: bool,
    /// The writer waits for the thread (a rotation, or a retry of a
    /// failing sink): no request's task takes it.
    reserved: bool,
}

/// Group commit without a hand-off: a request's task that queues an entry
/// while nobody holds the writer takes it and writes, itself, every entry
/// queued (its own and those that came while it wrote), for up to
/// [`LEAD_ROUNDS`] rounds; entries queued while another holds it wait for
/// that holder's next round. The thread rotates, retries a failing sink
/// (every [`RETRY`]), writes a sink whose writes can block for long
/// (standard output, a pipe), keeps the head and stops; it holds the writer
/// the same way. A task never rotates nor retries: it leaves the writer
/// reserved for the thread.
struct Shared {
    q: Mutex<Queue>,
    health: Health,
    /// Every entry whose ticket is below it had its round, and its line is
    /// written unless the round is in `failed`.
    written: AtomicU64,
    /// The rounds that failed (not written, or a line of them dropped).
    failed: Mutex<Failed>,
    /// The end of the last round that failed: `failed` is looked at only
    /// for a ticket below it.
    failed_end: AtomicU64,
    /// The tasks waiting for their line, each woken by its own round only.
    waiters: Arc<Waiters>,
    tx: SyncSender<Msg>,
    /// A request's task writes (a file); else only the thread does.
    inline: bool,
    /// A `Drain` is on its way to the thread.
    drain_asked: AtomicBool,
    on_failure: OnFailure,
    stats: Arc<AuditStats>,
    head: Option<Head>,
    /// The thread's turns of its loop (each a wake-up).
    turns: AtomicU64,
}

/// The ticket ranges of the rounds that failed, the latest
/// [`FAILED_KEPT`]; a ticket below `forgotten` may be in one no longer kept.
#[derive(Default)]
struct Failed {
    ranges: std::collections::VecDeque<(u64, u64)>,
    forgotten: u64,
}

/// Failed rounds remembered, so that each waiter learns its own round's fate.
const FAILED_KEPT: usize = 4096;

impl Failed {
    fn holds(&self, ticket: u64) -> bool {
        ticket < self.forgotten || self.ranges.iter().any(|&(a, b)| (a..b).contains(&ticket))
    }
}

/// The tasks waiting for their entry's round, by ticket (one task per
/// ticket: each call waits for its own entry only). A round wakes the
/// tasks of its own tickets, not every waiter (a wake-up is a poll of the
/// whole request, and most waiters' lines are in a later round); a thread
/// of its own wakes those whose wait is over, so that no answer needs a
/// timer of its own.
#[derive(Default)]
struct Waiters {
    list: Mutex<WaitList>,
    /// Tells the watcher that a waiter came with an earlier deadline than
    /// it sleeps until, or that the log closed.
    watch: std::sync::Condvar,
}

#[derive(Default)]
struct WaitList {
    entries: std::collections::BTreeMap<u64, Waiting>,
    /// The watcher sleeps until `until` (and, with no entry, until told).
    armed: bool,
    until: Option<std::time::Instant>,
    closed: bool,
}

struct Waiting {
    deadline: std::time::Instant,
    waker: std::task::Waker,
}

/// The watcher wakes at most this often: the waits that end close
/// together are ended at once.
const WATCH_STEP: Duration = Duration::from_millis(10);

impl Waiters {
    fn list(&self) -> std::sync::MutexGuard<'_, WaitList> {
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes (and forgets) the waiters of the tickets below `end`, after
    /// their outcome is set.
    fn wake_below(&self, end: u64) {
        let mut ready = Vec::new();
        {
            let mut list = self.list();
            while let Some(e) = list.entries.first_entry() {
                if *e.key() >= end {
                    break;
                }
                ready.push(e.remove().waker);
            }
        }
        for w in ready {
            w.wake();
        }
    }

    /// The watcher's thread: wakes each waiter whose deadline has passed
    /// (it then answers that its line was not written in time), and every
    /// waiter once the log is closed.
    fn watch(&self) {
        let mut list = self.list();
        loop {
            let now = std::time::Instant::now();
            let mut due: Vec<std::task::Waker> = Vec::new();
            let closed = list.closed;
            list.entries.retain(|_, w| {
                let over = closed || w.deadline <= now;
                if over {
                    due.push(w.waker.clone());
                }
                !over
            });
            if !due.is_empty() || closed {
                drop(list);
                for w in due {
                    w.wake();
                }
                if closed {
                    return;
                }
                list = self.list();
            }
            let Some(earliest) = list.entries.values().map(|w| w.deadline).min() else {
                list.armed = false;
                list.until = None;
                list = self.watch.wait(list).unwrap_or_else(|p| p.into_inner());
                continue;
            };
            list.armed = true;
            list.until = Some(earliest);
            let sleep = earliest.saturating_duration_since(now).max(WATCH_STEP);
            list = match self.watch.wait_timeout(list, sleep) {
                Ok((l, _)) => l,
                Err(p) => p.into_inner().0,
            };
        }
    }

    fn close(&self) {
        self.list().closed = true;
        self.watch.notify_one();
    }
}

/// The future of [`Shared::settled`]: registered in [`Waiters`] while its
/// outcome is not known, and taken out when dropped before it is.
struct Settled<'a> {
    shared: &'a Shared,
    ticket: u64,
    /// The longest it waits, from its first wait on.
    wait: Duration,
    deadline: Option<std::time::Instant>,
    registered: bool,
}

impl std::future::Future for Settled<'_> {
    type Output = bool;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<bool> {
        use std::collections::btree_map::Entry as Slot;
        use std::task::Poll;
        if let Some(ok) = self.shared.outcome(self.ticket) {
            // The round that answered it forgets its waker.
            self.registered = false;
            return Poll::Ready(ok);
        }
        let now = std::time::Instant::now();
        if self.deadline.is_some_and(|d| d <= now) {
            return Poll::Ready(false); // not written in time: dropped, it goes
        }
        let wait = self.wait;
        let deadline = *self.deadline.get_or_insert_with(|| {
            let capped = now.checked_add(ACK_WAIT).unwrap_or(now);
            now.checked_add(wait).unwrap_or(capped)
        });
        let (shared, ticket) = (self.shared, self.ticket);
        let mut list = shared.waiters.list();
        // Looked at again under the lock: a round sets its outcome before
        // it takes the lock to wake, so either its end is seen here or the
        // round finds this waker. The failed rounds, set before that end,
        // are looked at after the lock.
        let done = shared.written.load(Ordering::Acquire) > ticket;
        if done || list.closed {
            if self.registered {
                list.entries.remove(&ticket);
            }
            drop(list);
            self.registered = false;
            return Poll::Ready(done && shared.outcome(ticket).unwrap_or(false));
        }
        match list.entries.entry(ticket) {
            Slot::Occupied(mut e) => {
                if !e.get().waker.will_wake(cx.waker()) {
                    e.get_mut().waker.clone_from(cx.waker());
                }
            }
            Slot::Vacant(e) => {
                e.insert(Waiting {
                    deadline,
                    waker: cx.waker().clone(),
                });
            }
        }
        let tell = !list.armed || list.until.is_some_and(|u| deadline < u);
        if tell {
            list.armed = true;
            list.until = Some(deadline);
        }
        drop(list);
        if tell {
            shared.waiters.watch.notify_one();
        }
        self.registered = true;
        Poll::Pending
    }
}

impl Drop for Settled<'_> {
    fn drop(&mut self) {
        if self.registered {
            self.shared.waiters.list().entries.remove(&self.ticket);
        }
    }
}

/// The head checkpoint: written in seq order only, by whoever keeps it (a
/// rotation's or the stop's holder of the writer, or the thread every
/// [`HEAD_EVERY`]).
struct Head {
    path: PathBuf,
    keys: Arc<KeyringHandle>,
    /// The last line written (its seq and MAC), after each round.
    latest: Mutex<Option<(u64, [u8; 32])>>,
    /// The seq of the line kept in the file.
    kept: Mutex<Option<u64>>,
}

impl Head {
    /// Keeps `line` unless a later one is kept; a failure is logged, not
    /// fatal.
    fn keep(&self, line: (u64, [u8; 32])) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.is_some_and(|k| k >= line.0) {
            return;
        }
        match write_head(&self.path, &self.keys.current(), line.0, &line.1) {
            Ok(()) => *kept = Some(line.0),
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "audit log: the head could not be kept");
            }
        }
    }

    /// The last line written, and whether the file keeps an earlier one.
    fn behind(&self) -> Option<(u64, [u8; 32])> {
        let latest = *self.latest.lock().unwrap_or_else(|p| p.into_inner());
        let kept = *self.kept.lock().unwrap_or_else(|p| p.into_inner());
        latest.filter(|l| kept.is_none_or(|k| k < l.0))
    }
}

impl Queue {
    /// The next batch of entries (at most [`BATCH`]) and its tickets.
    fn batch(&mut self) -> (Vec<Entry>, (u64, u64)) {
        let n = self.entries.len().min(BATCH);
        let start = self.next - self.entries.len() as u64;
        (self.entries.drain(..n).collect(), (start, start + n as u64))
    }
}

fn lock(q: &Mutex<Queue>) -> std::sync::MutexGuard<'_, Queue> {
    q.lock().unwrap_or_else(|p| p.into_inner())
}

/// The writer, taken by a task that has not written yet: given back (and
/// the thread told) if the task is dropped first (its caller cancelled).
struct Held<'a>(&'a Shared, Option<Box<Writer>>);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.1.take() {
            lock(&self.0.q).writer = Some(w);
            self.0.ask_drain();
        }
    }
}

impl Shared {
    /// Queues an entry and, inline, writes it if nobody holds the writer.
    /// Its ticket, or `None` when not queued (the queue is full, or the log
    /// has stopped): counted as dropped.
    fn submit(&self, e: Entry) -> Option<u64> {
        let (ticket, held) = self.queue(e);
        if let Some(w) = held {
            self.lead(w, false);
        }
        ticket
    }

    /// [`Shared::submit`] from a request's task: one that takes the writer
    /// first lets the other tasks ready on its worker run (they queue their
    /// lines meanwhile), then writes them all with its own in one round.
    async fn submit_async(&self, e: Entry) -> Option<u64> {
        let (ticket, held) = self.queue(e);
        if let Some(w) = held {
            let mut held = Held(self, Some(w));
            tokio::task::yield_now().await;
            if let Some(w) = held.1.take() {
                self.lead(w, false);
            }
        }
        ticket
    }

    /// Queues an entry; the writer too, when a task may take it.
    fn queue(&self, e: Entry) -> (Option<u64>, Option<Box<Writer>>) {
        let mut q = lock(&self.q);
        let ended = q.ended || self.health.ended.load(Ordering::Acquire);
        if ended || q.entries.len() >= QUEUE {
            drop(q);
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return (None, None);
        }
        q.entries.push(e);
        let ticket = q.next;
        q.next += 1;
        let held = if self.inline && !q.reserved {
            q.writer.take()
        } else {
            None
        };
        drop(q);
        if held.is_none() && !self.inline {
            self.ask_drain();
        }
        // Else held by another (who writes what is queued), or reserved:
        // the thread was told when it was.
        (Some(ticket), held)
    }

    fn ask_drain(&self) {
        if !self.drain_asked.swap(true, Ordering::AcqRel) && self.tx.try_send(Msg::Drain).is_err() {
            // The channel holds a message already: the thread comes round.
            self.drain_asked.store(false, Ordering::Release);
        }
    }

    /// Written (`Some(true)`), failed (`Some(false)`), or not yet.
    fn outcome(&self, ticket: u64) -> Option<bool> {
        let written = self.written.load(Ordering::Acquire);
        if ticket < self.failed_end.load(Ordering::Acquire)
            && self
                .failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .holds(ticket)
        {
            return Some(false);
        }
        (written > ticket).then_some(true)
    }

    /// Until the entry's round is written (`true`) or fails, or `wait` is
    /// over (`false`).
    fn settled(&self, ticket: u64, wait: Duration) -> Settled<'_> {
        Settled {
            shared: self,
            ticket,
            wait,
            deadline: None,
            registered: false,
        }
    }

    /// After a round of the tickets `start..end`: their answers, and every
    /// waiter woken; the last line written is the head's to keep (at once
    /// with `keep_head`, or after a rotation).
    fn settle(&self, w: &mut Writer, ok: bool, (start, end): (u64, u64), keep_head: bool) {
        if let (Some(h), Some(line)) = (&self.head, w.last_written()) {
            *h.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(line);
            if keep_head || w.head_due {
                w.head_due = false;
                h.keep(line);
            }
        }
        self.answered(ok, (start, end));
    }

    /// The tickets `start..end` had their round: written (`ok`) or not.
    /// Each waiter learns its own round's fate, whatever rounds came
    /// before or after it.
    fn answered(&self, ok: bool, (start, end): (u64, u64)) {
        if !ok && start < end {
            let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
            if f.ranges.len() >= FAILED_KEPT {
                if let Some((_, b)) = f.ranges.pop_front() {
                    f.forgotten = b;
                }
            }
            // Rounds that fail one after the other (an outage) are one range.
            match f.ranges.back_mut() {
                Some(last) if last.1 == start => last.1 = end,
                _ => f.ranges.push_back((start, end)),
            }
            self.failed_end.fetch_max(end, Ordering::AcqRel);
        }
        self.written.fetch_max(end, Ordering::AcqRel);
        self.waiters.wake_below(end);
    }

    /// Writes, holding the writer, round after round, the entries queued,
    /// then gives the writer back; whether entries are left. A request's
    /// task goes at most [`LEAD_ROUNDS`] rounds and stops after a round
    /// that failed or filled the file: it leaves the writer reserved for
    /// the thread (which rotates, and retries a failing sink at its pace)
    /// and tells it. The thread goes as many rounds, rotating as it goes.
    fn lead(&self, mut w: Box<Writer>, thread: bool) -> bool {
        let _unwinding = Ended {
            health: &self.health,
            always: false,
        };
        let mut rounds = 0;
        let mut ok = true;
        loop {
            let (batch, tickets) = {
                let mut q = lock(&self.q);
                // The writer goes back while the queue is locked: an entry
                // queued meanwhile was seen here, so none is left with
                // nobody to write it. Lines pending (kept while the sink
                // failed, or a rotation's) are written too, but not tried
                // again at once after a round that failed.
                let more = !q.entries.is_empty() || (ok && !w.pending.is_empty());
                // A rotation is the thread's (its first try at once, a
                // retry at RETRY's pace); meanwhile the lines are written
                // on into the current file.
                let rotation = !thread && w.rotation_due() && !w.rotation_failing;
                if !more || rounds >= LEAD_ROUNDS || rotation {
                    q.writer = Some(w);
                    q.reserved = rotation;
                    drop(q);
                    if !thread && (rotation || more) {
                        self.ask_drain();
                    }
                    return more;
                }
                q.batch()
            };
            rounds += 1;
            ok = w.round(batch, false, !thread, &self.health, self.on_failure);
            self.settle(&mut w, ok, tickets, false);
            if thread && ok && w.rotation_due() && !w.rotation_failing {
                w.rotate_now(&self.health, self.on_failure);
            }
        }
    }

    /// The writer, if nobody holds it (reserved or not); for the stop,
    /// waits while a leader holds it. `None` once the log has ended.
    fn take_writer(&self, wait: bool) -> Option<Box<Writer>> {
        loop {
            {
                let mut q = lock(&self.q);
                if let Some(w) = q.writer.take() {
                    q.reserved = false;
                    return Some(w);
                }
                if q.ended || self.health.ended.load(Ordering::Acquire) || !wait {
                    return None;
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The maintenance thread: rotation, retries of a failing sink (or
    /// rotation) every [`RETRY`], draining for a sink not written inline
    /// (and after a leader's last round), the head every [`HEAD_EVERY`],
    /// and the stop.
    fn run(&self, rx: &Receiver<Msg>) {
        let mut head_kept = std::time::Instant::now();
        let mut tried = head_kept.checked_sub(RETRY).unwrap_or(head_kept);
        let mut more = false;
        loop {
            self.turns.fetch_add(1, Ordering::Relaxed);
            // A leader unwound holding the writer: nothing can be written.
            if self.health.ended.load(Ordering::Acquire) {
                return;
            }
            let failing = self.health.failing.load(Ordering::Acquire);
            let wait = if failing {
                RETRY.saturating_sub(tried.elapsed())
            } else if more {
                Duration::ZERO
            } else {
                HEAD_EVERY.saturating_sub(head_kept.elapsed())
            };
            let msg = match rx.recv_timeout(wait) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => Some(Msg::Stop),
            };
            if matches!(msg, Some(Msg::Stop)) {
                if let Some(w) = self.take_writer(true) {
                    self.stop(w);
                }
                return;
            }
            if matches!(msg, Some(Msg::Drain)) {
                self.drain_asked.store(false, Ordering::Release);
            }
            // The head, every HEAD_EVERY while lines are written, without
            // the writer (a round goes on meanwhile).
            if head_kept.elapsed() >= HEAD_EVERY {
                head_kept = std::time::Instant::now();
                if let Some((h, line)) = self.head.as_ref().and_then(|h| Some((h, h.behind()?))) {
                    h.keep(line);
                }
            }
            // A failing sink is tried again at RETRY's pace, whoever asks.
            if failing && tried.elapsed() < RETRY {
                continue;
            }
            // Held by a leader: it writes what is queued.
            let Some(mut w) = self.take_writer(false) else {
                more = false;
                // A task holds the writer (and tries the sink itself): the
                // next look is RETRY away, not at once.
                if failing {
                    tried = std::time::Instant::now();
                }
                continue;
            };
            if failing {
                tried = std::time::Instant::now();
            }
            if w.rotation_due() {
                w.rotate_now(&self.health, self.on_failure);
            }
            more = self.lead(w, true);
        }
    }

    /// Writes what is queued and the `stop` line, keeps the head, and ends
    /// the log: what is queued later is refused.
    fn stop(&self, mut w: Box<Writer>) {
        lock(&self.q).ended = true;
        loop {
            let (batch, tickets, last) = {
                let mut q = lock(&self.q);
                let (batch, tickets) = q.batch();
                (batch, tickets, q.entries.is_empty())
            };
            let ok = w.round(batch, last, false, &self.health, self.on_failure);
            self.settle(&mut w, ok, tickets, last);
            if last {
                break;
            }
        }
        if let Out::File(f) = &w.out {
            let _ = f.sync_all();
            // Let go of the lock now, not only at close: a child process
            // forked meanwhile shares the descriptor until it execs.
            let _ = rustix::fs::flock(f, rustix::fs::FlockOperation::Unlock);
        }
    }
}

/// The audit log of a running server.
pub struct Audit {
    shared: Arc<Shared>,
    on_failure: OnFailure,
    sample_seals: u32,
    seals: AtomicU64,
    stats: Arc<AuditStats>,
    /// Signalled when the writer thread ends.
    done: Mutex<Option<Receiver<()>>>,
}

impl std::fmt::Debug for Audit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Audit")
            .field("on_failure", &self.on_failure)
            .field("healthy", &self.shared.health.ok())
            .finish_non_exhaustive()
    }
}

/// Dropped without `close`: the thread writes the `stop` line and ends.
impl Drop for Audit {
    fn drop(&mut self) {
        let _ = self.shared.tx.try_send(Msg::Stop);
        self.shared.waiters.close();
    }
}
impl Audit {
    /// Opens the sink, chains on from its last line (a file that exists),
    /// writes a `start` line listing the keys in force, and starts the
    /// writer. Fails if that first line cannot be written.
    pub fn start(cfg: AuditConfig, keys: Arc<KeyringHandle>) -> Result<Arc<Audit>, AuditError> {
        if cfg.sample_seals == 0 {
            return Err(AuditError::Sampling);
        }
        let stats = Arc::new(AuditStats::default());
        let mut w = Writer::open(&cfg, keys, stats.clone())?;
        let ring = w.keys.current();
        let mut line = Line::new("start");
        line.keys = Some(key_list(&ring));
        line.prev = Some(hex(&w.prev));
        w.push(line, &ring);
        if let Some(Skipped { count, before, seq }) = w.skipped {
            tracing::warn!(
                path = %w.path.display(),
                count,
                before_the_chain = before,
                seq,
                "audit log: lines do not verify (planted or changed); chained on from the \
                 last line in the chain, and recorded what was skipped"
            );
            let mut line = Line::new("skipped");
            line.count = Some(count);
            // Going on from the head instead (the next line says why), the
            // files' chain ending at `seq` is not what this one goes on from.
            let from = if w.below_head.is_some() {
                format!("lines of the log's files not in its chain (which ends at seq {seq})")
            } else {
                format!("chained on from seq {seq}")
            };
            line.reason = Some(if before > 0 {
                format!("{from}; {before} before the chain's first line")
            } else {
                from
            });
            w.push(line, &ring);
        }
        if let Some((ended, head, holds)) = w.below_head {
            let mut line = Line::new("skipped");
            // Lines of this log missing below the head (all of 0..=head when
            // no line of the files is in the chain), or of the other chain
            // past it.
            line.count = Some(ended.map_or(head.saturating_add(1), |e| e.abs_diff(head)));
            line.reason = Some(match ended {
                Some(e) if !holds => format!(
                    "the chain the log's files end with (seq {e}) does not hold the head kept in \
                     the data directory (seq {head}): another log's lines; chained on from the head"
                ),
                Some(e) => format!(
                    "the log's files end at seq {e}, below the head kept in the data directory \
                     (seq {head}): chained on from the head"
                ),
                None => format!(
                    "no line of the log's files is in the chain; chained on from the head kept \
                     in the data directory (seq {head})"
                ),
            });
            w.push(line, &ring);
        }
        w.flush().map_err(|source| AuditError::Io {
            path: w.path.clone(),
            source,
        })?;
        let head = cfg.head.clone().map(|path| Head {
            path,
            keys: w.keys.clone(),
            latest: Mutex::new(None),
            kept: Mutex::new(None),
        });
        if let (Some(h), Some(line)) = (&head, w.last_written()) {
            h.keep(line);
        }
        let (tx, rx) = mpsc::sync_channel(16);
        let (done_tx, done) = mpsc::channel();
        let shared = Arc::new(Shared {
            q: Mutex::new(Queue {
                entries: Vec::new(),
                next: 0,
                writer: Some(Box::new(w)),
                ended: false,
                reserved: false,
            }),
            health: Health::default(),
            written: AtomicU64::new(0),
            failed: Mutex::new(Failed::default()),
            failed_end: AtomicU64::new(0),
            waiters: Arc::new(Waiters::default()),
            tx,
            inline: matches!(cfg.sink, Sink::File(_)),
            drain_asked: AtomicBool::new(false),
            on_failure: cfg.on_failure,
            stats: stats.clone(),
            head,
            turns: AtomicU64::new(0),
        });
        let waiters = shared.waiters.clone();
        std::thread::Builder::new()
            .name("stateseal-audit-watch".into())
            .spawn(move || waiters.watch())
            .map_err(|source| AuditError::Io {
                path: PathBuf::from("(watcher thread)"),
                source,
            })?;
        let s = shared.clone();
        std::thread::Builder::new()
            .name("stateseal-audit".into())
            .spawn(move || {
                let ended = Ended {
                    health: &s.health,
                    always: true,
                };
                s.run(&rx);
                // Ended before `close` returns: a closed sink refuses at once.
                drop(ended);
                let _ = done_tx.send(());
            })
            .map_err(|source| {
                shared.waiters.close();
                AuditError::Io {
                    path: PathBuf::from("(writer thread)"),
                    source,
                }
            })?;
        Ok(Arc::new(Audit {
            shared,
            on_failure: cfg.on_failure,
            sample_seals: cfg.sample_seals,
            seals: AtomicU64::new(0),
            stats,
            done: Mutex::new(Some(done)),
        }))
    }

    pub fn stats(&self) -> &Arc<AuditStats> {
        &self.stats
    }

    /// Before acting: `AUDIT_UNAVAILABLE` while a closed sink cannot write
    /// (its last write failed, the one in progress has hung, or the writer
    /// has ended).
    pub fn admit(&self) -> Result<(), Reject> {
        if self.on_failure == OnFailure::Closed && !self.shared.health.ok() {
            return Err(Reject::AuditUnavailable);
        }
        Ok(())
    }

    /// For readiness: a closed sink that can write, or an open one whose
    /// writer still runs.
    pub fn ready(&self) -> bool {
        self.admit().is_ok() && !self.shared.health.ended.load(Ordering::Acquire)
    }

    /// Records a decision. With `Closed`, returns once its line is written
    /// (or `AUDIT_UNAVAILABLE` if it could not be); with `Open`, at once.
    /// A successful Seal outside the sample is not recorded. A completion
    /// (Commit, Renew, Release) that succeeded is never refused: see
    /// [`Audit::keep`].
    pub async fn record(&self, d: Decision) -> Result<(), Reject> {
        let sampled = if d.method == Method::Seal && d.refused.is_none() && self.sample_seals > 1 {
            let n = self.seals.fetch_add(1, Ordering::Relaxed);
            if !n.is_multiple_of(u64::from(self.sample_seals)) {
                return Ok(());
            }
            self.sample_seals
        } else {
            1
        };
        let shared = &self.shared;
        match self.on_failure {
            OnFailure::Open => {
                shared.submit_async(Entry::Decision(d, sampled)).await;
                Ok(())
            }
            // A refused completion while the sink fails finishes no
            // handler's work: refused, with no line, as a Seal or an Open
            // is at admission (kept, its lines would let a caller's garbage
            // Renews push other tenants' Commits past the bound).
            OnFailure::Closed
                if d.method.completes() && d.refused.is_some() && !shared.health.ok() =>
            {
                Err(Reject::AuditUnavailable)
            }
            OnFailure::Closed if d.method.completes() && d.refused.is_none() => {
                self.keep(d).await;
                Ok(())
            }
            OnFailure::Closed => {
                // Decided, with no line when not queued: a `dropped` line
                // counts it.
                let ticket = shared
                    .submit_async(Entry::Decision(d, sampled))
                    .await
                    .ok_or(Reject::AuditUnavailable)?;
                // Written by this task as the leader: answered at once.
                // Else bounded: a write that hangs must not hold the answer
                // (or the caller's connection) forever.
                let ok = match shared.outcome(ticket) {
                    Some(ok) => ok,
                    None => shared.settled(ticket, ACK_WAIT).await,
                };
                if ok {
                    Ok(())
                } else {
                    Err(Reject::AuditUnavailable)
                }
            }
        }
    }

    /// A completion's line under `Closed`: while the sink writes, the
    /// answer waits for its line as any other; while it fails (or hangs,
    /// or the queue is full) the line is kept for later (or, past the
    /// bound, counted in a `dropped` line) and the answer goes at once.
    async fn keep(&self, d: Decision) {
        let shared = &self.shared;
        let healthy = shared.health.ok();
        let Some(ticket) = shared.submit_async(Entry::Decision(d, 1)).await else {
            return;
        };
        if !healthy || shared.outcome(ticket).is_some() {
            return;
        }
        // Until written, or until the sink is seen failing (a write that
        // fails keeps the line; one that hangs past its bound counts as
        // failing), or the longest an answer waits (the watcher ends it).
        let written = shared.settled(ticket, ACK_WAIT);
        tokio::pin!(written);
        loop {
            let tick = tokio::time::sleep(KEEP_POLL);
            tokio::select! {
                _ = &mut written => return,
                () = tick => {
                    if !shared.health.ok() {
                        return;
                    }
                }
            }
        }
    }

    /// Records a key lifecycle event; never waits for its line.
    pub fn key_event(&self, e: KeyEvent) {
        self.shared.submit(Entry::Key(e));
    }

    /// Writes the `stop` line and waits for the writer to finish, for at
    /// most a few seconds (a hung sink must not hold the shutdown).
    pub fn close(&self) {
        let done = self.done.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(done) = done else { return };
        let deadline = std::time::Instant::now() + CLOSE_WAIT;
        let mut msg = Msg::Stop;
        loop {
            match self.shared.tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) if std::time::Instant::now() < deadline => {
                    msg = m;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(_) => break,
            }
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if done
            .recv_timeout(left.max(Duration::from_millis(100)))
            .is_err()
        {
            tracing::error!(
                "audit log writer did not finish in time; its stop line may be missing"
            );
        }
    }
}

pub fn key_changes(before: &Keyring, after: &Keyring) -> Vec<KeyEvent> {
    let old: std::collections::HashMap<_, _> = before.summary().into_iter().collect();
    let new: std::collections::HashMap<_, _> = after.summary().into_iter().collect();
    let mut events = Vec::new();
    for (id, state) in after.summary() {
        use crate::domain::keyring::KeyState::{Primary, Staged};
        match (old.get(&id), state) {
            (None, s) => events.push(KeyEvent::Added(id, state_name(s))),
            (Some(Staged), Primary) => events.push(KeyEvent::Promoted(id)),
            (Some(Primary), Staged) => events.push(KeyEvent::Demoted(id)),
            _ => {}
        }
    }
    for (id, _) in before.summary() {
        if !new.contains_key(&id) {
            events.push(KeyEvent::Retired(id));
        }
    }
    events
}

fn state_name(s: crate::domain::keyring::KeyState) -> &'static str {
    use crate::domain::keyring::KeyState;
    match s {
        KeyState::Staged => "staged",
        KeyState::Primary => "primary",
        KeyState::Retired => "retired",
    }
}

fn key_list(ring: &Keyring) -> Vec<ListedKey> {
    ring.summary()
        .into_iter()
        .map(|(id, s)| ListedKey {
            id: id.0,
            state: state_name(s).to_owned(),
        })
        .collect()
}

/// One key of a `start` line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListedKey {
    pub id: u32,
    pub state: String,
}

/// One audit line, before its MAC. Member order is the written order;
/// absent members are left out. `verify` reads it back with the same type.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Line {
    pub seq: u64,
    pub time: String,
    pub replica: String,
    pub event: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ledger: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampled: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<Vec<ListedKey>>,
    /// The chain's previous MAC, on the first line of a run or a file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev: Option<String>,
    /// The root key whose audit chain key made `mac`.
    pub mac_key: u32,
    #[serde(default, skip_serializing)]
    pub mac: String,
}

impl Line {
    fn new(event: &str) -> Line {
        Line {
            event: event.to_owned(),
            ..Line::default()
        }
    }
}

/// The end of every line: `,"mac":"` 64 hex digits `"}`.
pub const MAC_SUFFIX_LEN: usize = 8 + 64 + 2;

pub(crate) fn hex(b: &[u8]) -> String {
    let mut out = Vec::with_capacity(b.len() * 2);
    push_hex(&mut out, b);
    // Hex digits are ASCII.
    String::from_utf8(out).unwrap_or_default()
}

/// Lowercase hex of `b`, appended.
fn push_hex(out: &mut Vec<u8>, b: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for chunk in b.chunks(32) {
        let mut digits = [0u8; 64];
        for (pair, x) in digits.chunks_exact_mut(2).zip(chunk) {
            pair[0] = DIGITS[usize::from(x >> 4)];
            pair[1] = DIGITS[usize::from(x & 15)];
        }
        out.extend_from_slice(&digits[..chunk.len() * 2]);
    }
}

/// `n` in decimal, appended.
fn push_int(out: &mut Vec<u8>, n: impl itoa::Integer) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// `s` as a JSON string (quoted and escaped as serde_json does), appended.
fn json_str(out: &mut Vec<u8>, s: &str) {
    // What serde_json writes as it is (all but the control characters, the
    // quote and the backslash), copied: the names, tenants and reasons of
    // nearly every line.
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
        return;
    }
    // Writing into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// RFC 3339 UTC times with microseconds; the date and time of day are
/// formatted once per second.
#[derive(Default)]
struct Clock {
    second: u64,
    prefix: String,
}

impl Clock {
    fn now(&mut self) -> String {
        let mut t = Vec::with_capacity(32);
        self.write(&mut t);
        String::from_utf8(t).unwrap_or_default()
    }

    /// The time, appended.
    fn write(&mut self, out: &mut Vec<u8>) {
        let d = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        if self.prefix.is_empty() || d.as_secs() != self.second {
            self.second = d.as_secs();
            self.prefix = crate::domain::keyring::rfc3339(self.second);
            self.prefix.pop(); // the Z
        }
        out.extend_from_slice(self.prefix.as_bytes());
        out.push(b'.');
        let us = d.subsec_micros();
        for div in [100_000, 10_000, 1_000, 100, 10, 1] {
            out.push(b'0' + (us / div % 10) as u8);
        }
        out.push(b'Z');
    }
}

enum Out {
    File(File),
    Stdout(std::io::Stdout),
}

struct Writer {
    out: Out,
    path: PathBuf,
    /// Bytes in the current file.
    size: u64,
    /// Names the current file when rotated: the seq of its first line, or of
    /// this writer's `start` line in it.
    first_seq: u64,
    /// The next line's seq, and the chain's last MAC.
    seq: u64,
    prev: [u8; 32],
    replica: String,
    max_bytes: u64,
    keys: Arc<KeyringHandle>,
    /// Lines made but not yet written (all of them, in order).
    pending: Vec<u8>,
    /// Lines given up (queue full, or too much pending) that a `dropped`
    /// line has counted.
    reported: u64,
    stats: Arc<AuditStats>,
    clock: Clock,
    /// Lines of the log that did not verify, which the restart chained on
    /// past.
    skipped: Option<Skipped>,
    /// The seq has reached its largest value: no line can be numbered, the
    /// sink fails for good.
    exhausted: bool,
    /// The head is to be kept after the next write (a rotation happened).
    head_due: bool,
    /// The last rotation failed (tried again by the thread).
    rotation_failing: bool,
    /// When the last write failed, if the last write failed.
    failed_at: Option<std::time::Instant>,
    /// At the start: the log's files ended at this seq (if any line), below
    /// the head's seq.
    below_head: Option<(Option<u64>, u64, bool)>,
}

impl Writer {
    fn open(
        cfg: &AuditConfig,
        keys: Arc<KeyringHandle>,
        stats: Arc<AuditStats>,
    ) -> Result<Writer, AuditError> {
        let mut w = Writer {
            out: Out::Stdout(std::io::stdout()),
            path: PathBuf::from("-"),
            size: 0,
            first_seq: 0,
            seq: 0,
            prev: [0u8; 32],
            replica: cfg.replica.clone(),
            max_bytes: cfg.max_bytes.max(4096),
            keys,
            pending: Vec::new(),
            reported: 0,
            stats,
            clock: Clock::default(),
            skipped: None,
            exhausted: false,
            head_due: false,
            rotation_failing: false,
            failed_at: None,
            below_head: None,
        };
        if let Sink::File(path) = &cfg.sink {
            let io = |source| AuditError::Io {
                path: path.clone(),
                source,
            };
            let mut f = open_private(path, false).map_err(io)?;
            // One writer per file: a second process would fork the chain.
            if rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err()
            {
                return Err(AuditError::InUse(path.clone()));
            }
            let size = f.metadata().map_err(io)?.len();
            // Chain on from the live file's last line in the chain, or
            // (when a crash cut a rotation short and left it empty or
            // missing) from the chain of the rotated files.
            let ring = w.keys.current();
            let limit = w.max_bytes.saturating_mul(2).saturating_add(16 << 20);
            let head = cfg.head.as_deref().and_then(|h| read_head(h, &ring));
            let own = if size > 0 {
                Some(ends(&mut f, size, &ring, None, head).map_err(io)?)
            } else {
                None
            };
            // A live file whose own chain holds the head is this log's, up to
            // its end (the usual restart): the rotated files, up to twice a
            // rotation's size, are read only when it does not.
            let rotated = if own.as_ref().is_some_and(|e| e.holds_probe && !e.unverified) {
                RotatedChain::none()
            } else {
                rotated_chain(path, &ring, limit, limit.saturating_mul(2), head).map_err(io)?
            };
            if size > 0 && !ends_with_newline(&mut f, size).map_err(io)? {
                // A line cut by a crash mid-write stays (verify reports it);
                // the chain goes on on a line of its own.
                f.write_all(b"\n").map_err(io)?;
            }
            let found = files_chain(path, &mut f, size, &ring, &rotated, head, own);
            // Never below the head kept in the data directory, and only on a
            // chain that holds it: else the files that held the lines up to
            // it were removed, renamed or crowded out, or what is there is
            // another log's.
            let Found {
                clean_first,
                first,
                last,
                skipped,
                ..
            } = match (found, head) {
                (Ok(fd), Some(h)) if !fd.holds || fd.last.is_none_or(|(seq, _)| seq < h.0) => {
                    let ended = fd.last.map(|(seq, _)| seq);
                    tracing::warn!(path = %path.display(), files_end = ?ended, head = h.0, holds = fd.holds,
                        "audit log: the log's files do not reach the head kept in the data \
                         directory on its chain (lines removed, renamed or hidden, or another \
                         log's); chained on from the head");
                    w.below_head = Some((ended, h.0, fd.holds));
                    Found::from_head(h, fd.skipped)
                }
                (Err(AuditError::NoChain(_) | AuditError::Unverified(_)), Some(h)) => {
                    tracing::warn!(path = %path.display(), head = h.0,
                        "audit log: no chain in the log's files; chained on from the head kept in \
                         the data directory");
                    w.below_head = Some((None, h.0, false));
                    Found::from_head(h, None)
                }
                (found, _) => found?,
            };
            w.skipped = skipped;
            if let Some((seq, mac)) = last {
                w.seq = seq
                    .checked_add(1)
                    .ok_or_else(|| AuditError::NoChain(path.clone()))?;
                w.prev = mac;
            }
            // The name this file gets when rotated: its first line's seq
            // when every line of it is in the chain (or when a crash cut its
            // rotation short after the link, the name it has); else, past
            // lines that failed (the first line, though it anchors, may be
            // a replayed one), the seq this writer goes on with.
            w.first_seq = clean_first
                .or(first.filter(|&s| same_file(path, &rotated_name(path, s))))
                .unwrap_or(w.seq);
            w.size = f.metadata().map_err(io)?.len();
            w.out = Out::File(f);
            w.path = path.clone();
        }
        Ok(w)
    }

    /// The next line's seq; `None` when it would have no successor: the
    /// line is not made, it is counted as dropped and the sink fails.
    fn number(&mut self) -> Option<u64> {
        if self.seq.checked_add(1).is_none() {
            self.exhausted = true;
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            self.reported += 1; // no `dropped` line can count it
            return None;
        }
        Some(self.seq)
    }

    /// Ends the line made from `start` on (its members, without the
    /// closing brace): its MAC over the chain's last, and the newline.
    fn chain(&mut self, start: usize, key: &crate::domain::keyring::RootKey) {
        let mac = key
            .audit_keys()
            .chain_mac(&self.prev, &self.pending[start..]);
        self.pending.extend_from_slice(b",\"mac\":\"");
        push_hex(&mut self.pending, &mac);
        self.pending.extend_from_slice(b"\"}\n");
        self.prev = mac;
        self.seq += 1;
        self.stats.lines.fetch_add(1, Ordering::Relaxed);
    }

    /// Numbers, chains and queues one line.
    fn push(&mut self, mut line: Line, ring: &Keyring) {
        let Some(seq) = self.number() else { return };
        let key = ring.primary();
        line.seq = seq;
        line.time = self.clock.now();
        line.replica.clone_from(&self.replica);
        line.mac_key = key.id().0;
        let start = self.pending.len();
        // A `Line` always serializes (strings, numbers and lists only).
        if serde_json::to_writer(&mut self.pending, &line).is_err() {
            self.pending.truncate(start);
            return;
        }
        self.pending.pop(); // the closing brace
        self.chain(start, key);
    }

    /// A decision's line, written straight into the pending bytes: the
    /// members of [`Line`] in its order, as serde writes them (a test holds
    /// the two equal), with no allocation of its own.
    fn decision(&mut self, d: Decision, sampled: u32, ring: &Keyring) {
        let Some(seq) = self.number() else { return };
        let key = ring.primary();
        let digests = key.audit_keys();
        let tenant = d.tenant.as_str();
        let start = self.pending.len();
        let p = &mut self.pending;
        p.extend_from_slice(b"{\"seq\":");
        push_int(p, seq);
        p.extend_from_slice(b",\"time\":\"");
        self.clock.write(p);
        p.extend_from_slice(b"\",\"replica\":");
        json_str(p, &self.replica);
        p.extend_from_slice(b",\"event\":");
        json_str(p, d.method.name());
        p.extend_from_slice(b",\"tenant\":");
        json_str(p, tenant);
        p.extend_from_slice(b",\"caller\":");
        json_str(p, &d.caller);
        if let Some(k) = d.trail.key_id {
            p.extend_from_slice(b",\"key_id\":");
            push_int(p, k.0);
        }
        if let Some(m) = d.mode {
            p.extend_from_slice(b",\"mode\":");
            json_str(p, m);
        }
        let t = tenant.as_bytes();
        let digested = [
            (
                "subject",
                d.subject
                    .as_deref()
                    .map(|s| digests.digest("subject", &[t, s.as_bytes()])),
            ),
            (
                "ledger",
                d.trail
                    .ledger_id
                    .map(|id| digests.digest("ledger", &[t, &id])),
            ),
            (
                "attempt",
                d.attempt
                    .as_deref()
                    .filter(|a| !a.is_empty())
                    .map(|a| digests.digest("attempt", &[t, a.as_bytes()])),
            ),
        ];
        for (name, digest) in digested {
            if let Some(dg) = digest {
                p.extend_from_slice(b",\"");
                p.extend_from_slice(name.as_bytes());
                p.extend_from_slice(b"\":\"");
                push_hex(p, &dg);
                p.push(b'"');
            }
        }
        match d.refused {
            None => p.extend_from_slice(b",\"outcome\":\"ok\""),
            Some(r) => {
                p.extend_from_slice(b",\"outcome\":\"refused\",\"reason\":");
                json_str(p, r.reason());
            }
        }
        if sampled > 1 {
            p.extend_from_slice(b",\"sampled\":");
            push_int(p, sampled);
        }
        p.extend_from_slice(b",\"mac_key\":");
        push_int(p, key.id().0);
        self.chain(start, key);
    }

    fn key_event(&mut self, e: KeyEvent, ring: &Keyring) {
        let (event, id, state, reason) = match e {
            KeyEvent::Added(id, s) => ("key_added", Some(id), Some(s), None),
            KeyEvent::Promoted(id) => ("key_promoted", Some(id), None, None),
            KeyEvent::Demoted(id) => ("key_demoted", Some(id), None, None),
            KeyEvent::Retired(id) => ("key_retired", Some(id), None, None),
            KeyEvent::ReloadApplied => ("reload_applied", None, None, None),
            KeyEvent::ReloadRefused(why) => ("reload_refused", None, None, Some(why)),
        };
        let mut line = Line::new(event);
        line.key_id = id.map(|k| k.0);
        line.mode = state.map(str::to_owned);
        line.reason = reason;
        if event == "reload_applied" {
            line.keys = Some(key_list(ring));
        }
        self.push(line, ring);
    }

    /// Writes what is pending; what could not be written stays, in order.
    fn flush(&mut self) -> std::io::Result<()> {
        let mut done = 0;
        let result = loop {
            if done == self.pending.len() {
                break Ok(());
            }
            let n = match &mut self.out {
                Out::File(f) => f.write(&self.pending[done..]),
                Out::Stdout(s) => s.write(&self.pending[done..]),
            };
            match n {
                Ok(0) => break Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        self.pending.drain(..done);
        self.size += done as u64;
        match (&result, &mut self.out) {
            (Ok(()), Out::Stdout(s)) => s.flush(),
            _ => result,
        }
    }

    /// The last line written, its seq and MAC, when every line made is
    /// written.
    fn last_written(&self) -> Option<(u64, [u8; 32])> {
        let seq = self.seq.checked_sub(1)?;
        self.pending.is_empty().then_some((seq, self.prev))
    }

    /// The current file is full, and every line is written to it.
    fn rotation_due(&self) -> bool {
        matches!(self.out, Out::File(_)) && self.pending.is_empty() && self.size >= self.max_bytes
    }

    /// Once the file has reached its size (and nothing is pending): gives
    /// it the name `PATH.<first_seq, 20 digits>` (a hard link, so an
    /// existing file of that name is never replaced: another file's name
    /// gets a `.N` suffix), starts a new one and
    /// writes its first line, `rotate`, with the name and the chain's
    /// previous MAC.
    fn rotate(&mut self, ring: &Keyring) -> std::io::Result<()> {
        let Out::File(cur) = &self.out else {
            return Ok(());
        };
        let ours = |p: &Path| is_open_file(cur, p);
        let mut to = rotated_name(&self.path, self.first_seq);
        let mut tries = 0u32;
        loop {
            match link_open_file(cur, &self.path, &to) {
                Ok(()) => {}
                // Linked before (a crash, or an earlier try that could not
                // create the new file): the same file.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && ours(&to) => {}
                // Another file has the name (planted, or a chain that went
                // back): never replaced, a free `.N` suffix instead, found
                // in one read of the directory however many are taken.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 8 => {
                    tries += 1;
                    to = free_suffix(&self.path, self.first_seq, &ours)?;
                    if !ours(&to) {
                        continue;
                    }
                }
                Err(e) => return Err(e),
            }
            break;
        }
        // The live name goes only while it is this file: renamed away or
        // replaced meanwhile (logrotate, or a hand), it is left as it is,
        // and this file's lines are kept under the rotated name.
        if ours(&self.path) {
            std::fs::remove_file(&self.path)?;
        }
        // A crash from here on leaves the live name missing or empty: the
        // next start chains on from the newest rotated file.
        let f = open_private(&self.path, true)?;
        let made = (|| {
            rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive)?;
            if let Some(dir) = self.path.parent() {
                let dir = if dir.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    dir
                };
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok::<(), std::io::Error>(())
        })();
        if let Err(e) = made {
            // The new file goes while it is still the one made here: left,
            // its name would refuse every retry (EEXIST).
            if is_open_file(&f, &self.path) {
                let _ = std::fs::remove_file(&self.path);
            }
            return Err(e);
        }
        self.out = Out::File(f);
        self.size = 0;
        self.first_seq = self.seq;
        self.head_due = true;
        let mut line = Line::new("rotate");
        line.prev = Some(hex(&self.prev));
        line.reason = to.file_name().map(|n| n.to_string_lossy().into_owned());
        self.push(line, ring);
        Ok(())
    }

    /// One round: makes each entry into a line (or, past the bound of
    /// what is kept, drops it), then the `stop` line if `stop`, and writes
    /// everything pending with one `write(2)`. Whether every entry's line
    /// is written.
    fn round(
        &mut self,
        batch: Vec<Entry>,
        stop: bool,
        paced: bool,
        health: &Health,
        on_failure: OnFailure,
    ) -> bool {
        let ring = self.keys.current();
        let mut dropped = false;
        for e in batch {
            if self.pending.len() > MAX_PENDING {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                dropped = true;
                continue;
            }
            self.note_lost(&ring);
            match e {
                Entry::Decision(d, sampled) => self.decision(d, sampled, &ring),
                Entry::Key(e) => self.key_event(e, &ring),
            }
        }
        if stop {
            self.note_lost(&ring);
            self.push(Line::new("stop"), &ring);
        }
        // A sink that failed is tried again at RETRY's pace by a task
        // (`paced`; the lines meanwhile kept, up to MAX_PENDING); the
        // thread paces its own tries, the stop tries at once.
        if paced && self.failed_at.is_some_and(|t| t.elapsed() < RETRY) {
            return false;
        }
        health
            .writing_since
            .store(now_ms().max(1), Ordering::Release);
        let written = self.flush();
        health.writing_since.store(0, Ordering::Release);
        self.failed_at = written.is_err().then(std::time::Instant::now);
        let written = match written {
            Ok(()) if self.exhausted => Err(std::io::Error::other(
                "its seq has reached its largest value: start a new log",
            )),
            w => w,
        };
        let ok = match written {
            Ok(()) => true,
            Err(e) => {
                self.stats.write_failures.fetch_add(1, Ordering::Relaxed);
                if !health.failing.swap(true, Ordering::AcqRel) {
                    tracing::error!(path = %self.path.display(), error = %e, ?on_failure,
                        "audit log cannot be written; lines are kept and written once it can");
                }
                false
            }
        };
        if ok && self.rotation_failing {
            health.failing.store(true, Ordering::Release);
        } else if ok && health.failing.swap(false, Ordering::AcqRel) {
            tracing::info!(path = %self.path.display(), "audit log writes again");
        }
        if stop && !ok {
            tracing::error!(path = %self.path.display(), "audit log: the last lines could not be written");
        }
        ok && !dropped
    }

    /// Rotates the file that has reached its size. One that fails is a
    /// failing sink (closed refuses Seal and Open, the replica is not
    /// ready) until a retry succeeds; meanwhile the lines are written on
    /// into the current file. One that hangs (its link or fsync) is a
    /// stalled write.
    fn rotate_now(&mut self, health: &Health, on_failure: OnFailure) {
        let ring = self.keys.current();
        health
            .writing_since
            .store(now_ms().max(1), Ordering::Release);
        let r = self.rotate(&ring);
        health.writing_since.store(0, Ordering::Release);
        if let Err(e) = &r {
            self.stats.write_failures.fetch_add(1, Ordering::Relaxed);
            health.failing.store(true, Ordering::Release);
            if !self.rotation_failing {
                tracing::error!(path = %self.path.display(), error = %e, ?on_failure,
                    "audit log cannot be rotated; written on into the current file and tried again");
            }
        } else if self.rotation_failing {
            tracing::info!(path = %self.path.display(), "audit log rotated again");
        }
        self.rotation_failing = r.is_err();
    }

    /// Before a line that goes in after some were dropped: a `dropped`
    /// line with their count.
    fn note_lost(&mut self, ring: &Keyring) {
        let dropped = self.stats.dropped.load(Ordering::Relaxed);
        if dropped > self.reported && self.pending.len() <= MAX_PENDING {
            let mut line = Line::new("dropped");
            line.count = Some(dropped - self.reported);
            self.reported = dropped;
            self.push(line, ring);
        }
    }
}

/// Opens (creating, mode 0600; `new`: only if absent) for appending and
/// reading: a regular file only, never through a symbolic link (planted at
/// the live name, it would send the lines into the keyset, say) nor a FIFO
/// or device (a reader there takes the lines away).
fn open_private(path: &Path, new: bool) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.append(true).read(true);
    if new {
        o.create_new(true);
    } else {
        o.create(true);
    }
    o.mode(0o600).custom_flags(
        rustix::fs::OFlags::NONBLOCK.bits() as i32 | rustix::fs::OFlags::NOFOLLOW.bits() as i32,
    );
    let f = o.open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(f)
}

/// Whether `a` and `b` are one regular file, neither of them a symbolic
/// link (a link planted at a rotated name pointing at the live file must
/// not pass for a hard link a crash left, or the live file would be
/// removed with its lines).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::symlink_metadata(a), std::fs::symlink_metadata(b)) {
        (Ok(x), Ok(y)) => {
            x.file_type().is_file()
                && y.file_type().is_file()
                && x.dev() == y.dev()
                && x.ino() == y.ino()
        }
        _ => false,
    }
}

/// Whether `p` names the open file `f` (a regular file, not through a
/// symbolic link).
fn is_open_file(f: &File, p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (f.metadata(), std::fs::symlink_metadata(p)) {
        (Ok(a), Ok(b)) => b.file_type().is_file() && a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Gives the open file `f` the name `to` (never replacing one): through its
/// descriptor, so that it is this file whatever `path` names now; where
/// `/proc` is not mounted, through `path` while it still names `f`.
fn link_open_file(f: &File, path: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let by_fd = format!("/proc/self/fd/{}", f.as_raw_fd());
    match rustix::fs::linkat(
        rustix::fs::CWD,
        by_fd.as_str(),
        rustix::fs::CWD,
        to,
        rustix::fs::AtFlags::SYMLINK_FOLLOW,
    ) {
        Ok(()) => Ok(()),
        Err(e) if e == rustix::io::Errno::NOENT && !Path::new("/proc/self/fd").exists() => {
            if is_open_file(f, path) {
                std::fs::hard_link(path, to)
            } else {
                Err(std::io::Error::other(
                    "the live file was renamed and /proc is not mounted: cannot rotate it",
                ))
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// What a head's tag covers besides the line's MAC.
fn head_body(seq: u64) -> String {
    format!("stateseal audit head v1 {seq}")
}

/// Writes the head `v1 KEY SEQ MAC TAG` (TAG: the chain MAC, under the
/// primary root key's audit key, over MAC and the seq) to a new file then
/// renamed over `path`, synced.
fn write_head(path: &Path, ring: &Keyring, seq: u64, mac: &[u8; 32]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let key = ring.primary();
    let tag = key.audit_keys().chain_mac(mac, head_body(seq).as_bytes());
    let text = format!("v1 {} {seq} {} {}\n", key.id().0, hex(mac), hex(&tag));
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// The head kept at `path`, if there is one whose tag verifies under a key
/// of `ring`; else `None` (a changed or foreign head is warned about and
/// not used; one whose key was removed is not used either).
fn read_head(path: &Path, ring: &Keyring) -> Option<(u64, [u8; 32])> {
    use std::io::Read;
    let mut text = String::new();
    let read = verify::open_regular(path).and_then(|f| f.take(512).read_to_string(&mut text));
    match read {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "audit log: the head cannot be read; not used");
            return None;
        }
    }
    let parts: Vec<&str> = text.split_whitespace().collect();
    let parsed = match parts.as_slice() {
        ["v1", key, seq, mac, tag] => (|| {
            let key = KeyId(key.parse().ok()?);
            let seq: u64 = seq.parse().ok()?;
            let mac = verify::unhex32(mac.as_bytes())?;
            let tag = verify::unhex32(tag.as_bytes())?;
            Some((key, seq, mac, tag))
        })(),
        _ => None,
    };
    let Some((key, seq, mac, tag)) = parsed else {
        tracing::warn!(path = %path.display(), "audit log: the head is not one this writer wrote; not used");
        return None;
    };
    let Some(k) = ring.get(key) else {
        tracing::warn!(path = %path.display(), key = key.0, "audit log: the head's key is not in the keyset; not used");
        return None;
    };
    if k.audit_keys().chain_mac(&mac, head_body(seq).as_bytes()) != tag || seq >= MAX_SEQ {
        tracing::warn!(path = %path.display(), "audit log: the head does not verify (changed?); not used");
        return None;
    }
    Some((seq, mac))
}

/// At most this many rotated names are looked at by a restart.
const ROTATED_NAMES: usize = 1024;

/// The rotated files of `path`, oldest first, with the seq their names
/// give (suffixed names after the plain one), other than `path` itself (a
/// crash mid-rotation links it under its rotated name before removing the
/// live name); regular files only.
fn rotated_files(path: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Ok(Vec::new());
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!("{}.", name.to_string_lossy());
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let n = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = n.strip_prefix(&prefix) else {
            continue;
        };
        // `<seq, 20 digits>`, or `<seq>.<N>` (a name another file held).
        let (digits, suffix) = rest.split_once('.').unwrap_or((rest, "0"));
        if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let (Ok(seq), Ok(suffix)) = (digits.parse::<u64>(), suffix.parse::<u32>()) else {
            continue;
        };
        let p = e.path();
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_file())
            && !same_file(path, &p)
        {
            found.push(((seq, suffix), p));
        }
    }
    found.sort();
    Ok(found.into_iter().map(|((seq, _), p)| (seq, p)).collect())
}

/// Opens a rotated file to read, if it is a regular file, not sparse, no
/// longer than `limit`: never a FIFO (whose open would wait), a directory,
/// a symbolic link, or a file that would cost reading for nothing (and
/// crowd genuine files out of the restart's budget). A file that cannot be
/// read is passed over with a warning.
fn open_rotated(p: &Path, limit: u64) -> Option<(File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(
            rustix::fs::OFlags::NONBLOCK.bits() as i32 | rustix::fs::OFlags::NOFOLLOW.bits() as i32,
        )
        .open(p)
        .and_then(|f| f.metadata().map(|m| (f, m)));
    // A file whose blocks hold less than half its length is sparse: no
    // writer makes one, and it would cost reading for nothing.
    let sparse = |m: &std::fs::Metadata| {
        use std::os::unix::fs::MetadataExt;
        m.blocks().saturating_mul(512) < m.len() / 2
    };
    match opened {
        Ok((f, m)) if m.is_file() && m.len() <= limit && !sparse(&m) => Some((f, m.len())),
        Ok(_) => {
            tracing::warn!(path = %p.display(), "audit log: a rotated file that is not a regular, dense file of a rotated file's size is passed over");
            None
        }
        Err(e) => {
            tracing::warn!(path = %p.display(), error = %e, "audit log: a rotated file that cannot be read is passed over");
            None
        }
    }
}

/// What the log's files give a restart.
struct Found {
    /// The live file's first line's seq, when every line of it is in the
    /// chain; and when only it anchors.
    clean_first: Option<u64>,
    first: Option<u64>,
    /// The chain's last line.
    last: Option<(u64, [u8; 32])>,
    /// That chain holds the head kept in the data directory.
    holds: bool,
    skipped: Option<Skipped>,
}

impl Found {
    fn from_head(head: (u64, [u8; 32]), skipped: Option<Skipped>) -> Found {
        Found {
            clean_first: None,
            first: None,
            last: Some(head),
            holds: true,
            skipped,
        }
    }
}

/// Whether the file's last byte is a newline.
fn ends_with_newline(f: &mut File, size: u64) -> std::io::Result<bool> {
    use std::io::Read;
    f.seek(SeekFrom::Start(size - 1))?;
    let mut b = [0u8; 1];
    f.read_exact(&mut b)?;
    f.seek(SeekFrom::End(0))?;
    Ok(b[0] == b'\n')
}

/// The chain of the log's files for a restart: the live file's (`own`, its
/// own reading, or as going on from the rotated files', see [`choose`]),
/// else the rotated files'; or the error the start stops with when nothing
/// chains. `head`: the head kept in the data directory, looked for in the
/// chain.
fn files_chain(
    path: &Path,
    f: &mut File,
    size: u64,
    ring: &Keyring,
    rotated: &RotatedChain,
    head: Option<(u64, [u8; 32])>,
    own: Option<Ends>,
) -> Result<Found, AuditError> {
    let io = |source| AuditError::Io {
        path: path.to_owned(),
        source,
    };
    let live = if let Some(own) = own {
        let on = match rotated.seed {
            Some(seed) => Some(ends(f, size, ring, Some(seed), head).map_err(io)?),
            None => None,
        };
        let (e, on_chosen) = choose(own, on);
        if e.unverified {
            return Err(AuditError::Unverified(path.to_owned()));
        }
        let holds = e.holds_probe || (on_chosen && rotated.seed_holds);
        // A file without one complete audit line (a crash cut its first
        // line, right after a rotation say) is as if empty.
        e.any_line.then_some((e, holds))
    } else {
        None
    };
    let had_lines = live.is_some();
    let found = if let Some((e, holds)) = live {
        Found {
            clean_first: e.first.filter(|_| e.clean),
            first: e.first,
            last: e.last,
            holds,
            skipped: e.skipped,
        }
    } else if let Some(seed) = rotated.seed {
        Found {
            clean_first: None,
            first: None,
            last: Some(seed),
            holds: rotated.seed_holds,
            skipped: rotated.skipped,
        }
    } else if let Some((r, e)) = &rotated.newest {
        // No rotated file's chain verifies (their keys were removed, or
        // they were changed): as before such checks.
        if e.unverified {
            return Err(AuditError::Unverified(r.clone()));
        }
        Found {
            clean_first: None,
            first: None,
            last: Some(e.last.ok_or_else(|| AuditError::NoChain(r.clone()))?),
            holds: e.holds_probe,
            skipped: e.skipped,
        }
    } else {
        Found {
            clean_first: None,
            first: None,
            last: None,
            holds: false,
            skipped: None,
        }
    };
    if had_lines && found.last.is_none() {
        return Err(AuditError::NoChain(path.to_owned()));
    }
    Ok(found)
}

/// What the rotated files give a restart.
struct RotatedChain {
    /// The last line of the chain that ends highest among the rotated
    /// files read.
    seed: Option<(u64, [u8; 32])>,
    /// Lines of the file holding `seed` that did not verify.
    skipped: Option<Skipped>,
    /// The chain ending at `seed` holds the `probe` line.
    seed_holds: bool,
    /// When no line of them verifies: the newest readable one, checked on
    /// its own.
    newest: Option<(PathBuf, Ends)>,
}

impl RotatedChain {
    /// Nothing read.
    fn none() -> RotatedChain {
        RotatedChain {
            seed: None,
            skipped: None,
            seed_holds: false,
            newest: None,
        }
    }
}

/// The rotated files' chain: the newest readable rotated files (regular
/// files of at most `limit` bytes, newest name first, until `budget` bytes;
/// names past [`ROTATED_NAMES`] are not looked at), read oldest first, each
/// as going on from the highest chain end so far or, when no line of it
/// does (the files between were removed, or it was planted), on its own.
/// The seed is the highest end of a verified chain: copies of genuine lines
/// (under any name) end no higher than the genuine chain does, so planted,
/// copied or removed files never take it back; lines under a key removed
/// from the keyset are skipped, the lines after them checked over them.
fn rotated_chain(
    path: &Path,
    ring: &Keyring,
    limit: u64,
    budget: u64,
    probe: Option<(u64, [u8; 32])>,
) -> std::io::Result<RotatedChain> {
    let files = rotated_files(path)?;
    let mut chosen = Vec::new();
    let mut bytes = 0u64;
    for (_, p) in files.iter().rev().take(ROTATED_NAMES) {
        let Some((f, len)) = open_rotated(p, limit) else {
            continue;
        };
        if !chosen.is_empty() && bytes.saturating_add(len) > budget {
            break;
        }
        bytes = bytes.saturating_add(len);
        chosen.push((p.clone(), f, len));
    }
    let mut out = RotatedChain::none();
    for (p, mut f, len) in chosen.into_iter().rev() {
        let mut e = ends(&mut f, len, ring, out.seed, probe)?;
        // Going on from the chain so far, it holds the probe if that chain
        // did; on its own, only if this file does.
        let mut holds = e.holds_probe || out.seed_holds;
        if e.anchor.is_none() && out.seed.is_some() {
            e = ends(&mut f, len, ring, None, probe)?;
            holds = e.holds_probe;
        }
        if e.anchor.is_some() {
            if let Some(last) = e.last.filter(|l| out.seed.is_none_or(|s| l.0 > s.0)) {
                out.seed = Some(last);
                out.skipped = e.skipped;
                out.seed_holds = holds;
            }
        }
        out.newest = Some((p, e));
    }
    if out.seed.is_some() {
        out.newest = None;
    }
    Ok(out)
}

/// The live file's chain: of the live file read on its own (`own`) and
/// read as going on from the rotated files' chain (`on`: its end is that
/// chain's end, or past it when a line of the live file goes on from it),
/// the one that ends higher, `on` when even. So a planted or foreign line
/// on top of the live file, an older file in its place, or rotated files
/// removed or planted, never take the seq back. Only a verified chain of
/// the live file counts against `on`.
fn choose(own: Ends, on: Option<Ends>) -> (Ends, bool) {
    let Some(on) = on else {
        return (own, false);
    };
    // The live file's own chain holds the head kept in the data directory,
    // and no line of it goes on from the rotated files' chain: that chain
    // is not this log's (a foreign one copied in), whatever its end.
    if own.holds_probe && on.anchor.is_none() {
        return (own, false);
    }
    let own_last = own.anchor.and(own.last.map(|l| l.0));
    if on.last.map(|l| l.0) >= own_last {
        (on, true)
    } else {
        (own, false)
    }
}

/// `rotated_name(path, seq)` with a `.N` suffix no file in the directory
/// has: one above the highest taken, so that names sort in the order they
/// were made, or, when that is `u32::MAX`, the lowest free one; or the
/// suffixed name that is already `path` (a crash between the link and the
/// removal of the live name).
fn free_suffix(path: &Path, seq: u64, ours: &dyn Fn(&Path) -> bool) -> std::io::Result<PathBuf> {
    let base = rotated_name(path, seq);
    let (Some(dir), Some(name)) = (base.parent(), base.file_name()) else {
        return Err(std::io::Error::other("the audit log path has no file name"));
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!("{}.", name.to_string_lossy());
    let mut taken = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(dir)? {
        let n = e?.file_name().to_string_lossy().into_owned();
        if let Some(k) = n.strip_prefix(&prefix).and_then(|r| r.parse::<u32>().ok()) {
            let mut p = base.clone().into_os_string();
            p.push(format!(".{k}"));
            if ours(Path::new(&p)) {
                return Ok(PathBuf::from(p));
            }
            taken.insert(k);
        }
    }
    let suffix = match taken.last() {
        None => 1,
        Some(&max) if max < u32::MAX => max + 1,
        // At most u32::MAX names are taken, so one in 1..=u32::MAX is free.
        Some(_) => (1..u32::MAX)
            .find(|k| !taken.contains(k))
            .unwrap_or(u32::MAX),
    };
    let mut to = base.into_os_string();
    to.push(format!(".{suffix}"));
    Ok(PathBuf::from(to))
}

/// The name a file gets when rotated: its first line's seq, zero-padded so
/// that names sort in chain order.
pub fn rotated_name(path: &Path, first_seq: u64) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{first_seq:020}"));
    PathBuf::from(s)
}

/// Lines a restart found that did not verify: before the chain's first
/// line (`before` of them) and after its last, `seq`.
#[derive(Clone, Copy, Debug)]
struct Skipped {
    count: u64,
    before: u64,
    seq: u64,
}

/// What a restart reads at the end of a log file.
struct Ends {
    /// The seq of the file's first line, when it anchors the chain.
    first: Option<u64>,
    /// The seq of the file's first line in the chain (None: no line of the
    /// file verifies, or the chain was taken unchecked).
    anchor: Option<u64>,
    /// Every complete audit line is in the chain (none failed: no replayed
    /// or changed line).
    clean: bool,
    /// The last line whose MAC verifies, to chain on from.
    last: Option<(u64, [u8; 32])>,
    /// The `probe` line (the head kept in the data directory) is one of
    /// this file's lines in the chain.
    holds_probe: bool,
    /// Lines that did not verify, before the chain's first line or after
    /// `last`.
    skipped: Option<Skipped>,
    /// No line verifies, though some name a key of the keyset: changed or
    /// planted, not made by keys since removed.
    unverified: bool,
    /// Some complete line of the file is an audit line.
    any_line: bool,
}

/// The longest line a restart reads: longer ones (no writer makes one; a
/// `start` line listing thousands of keys stays far below) are junk, read
/// past without being held in memory.
pub(crate) const MAX_LINE: usize = 1 << 20;

/// The next line of `r` into `buf`, without its newline, keeping at most
/// `MAX_LINE + 1` bytes of it: its length, and whether a newline ended it;
/// `None` at the end.
fn next_line(
    r: &mut impl std::io::BufRead,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<(u64, bool)>> {
    buf.clear();
    let mut len = 0u64;
    loop {
        let chunk = r.fill_buf()?;
        if chunk.is_empty() {
            return Ok((len > 0).then_some((len, false)));
        }
        let (part, ended) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (&chunk[..i], true),
            None => (chunk, false),
        };
        let room = (MAX_LINE + 1).saturating_sub(buf.len());
        buf.extend_from_slice(&part[..part.len().min(room)]);
        let n = part.len();
        len += n as u64;
        r.consume(n + usize::from(ended));
        if ended {
            return Ok(Some((len, true)));
        }
    }
}

/// No writer reaches a seq past this (2^62 lines): a line that claims one
/// was planted, and is never chained on from (its successors would
/// exhaust the seq).
pub const MAX_SEQ: u64 = 1 << 62;

/// Reads the file from its start, line by line, for the last line in the
/// chain: one whose MAC verifies against the last good line's and whose
/// `seq` is the next one. A line that fails is never chained on from, even
/// by the line after it (a planted line can carry any MAC, so a copied run
/// of old genuine lines would verify among itself), so a restart neither
/// chains on from a planted or replayed line nor is stopped by it. The
/// chain is anchored, as in verify, only by the file's first line (the
/// `start` or `rotate` line every file begins with) verifying against its
/// own `prev`, or, past lines that failed, by a line that chains on from
/// the line physically before it (next seq, MAC over its MAC): a replayed
/// `start` further on anchors nothing. Lines that failed before the anchor
/// are counted with those after the chain's last line. When no line verifies at
/// all and no line names a key of the keyset (the keys that made them were
/// removed), the restart chains on from the last complete line, as before
/// such checks, and says so, never from a seq at or past [`MAX_SEQ`];
/// when lines name its keys, it refuses. Lines that are not audit lines
/// (junk, a cut line) are not the file's first line.
///
/// `seed`, the last line of the newest rotated file (when its chain holds),
/// is the chain this file continues: then no line of this file anchors on
/// its own, only the next line of `seed` does, as in verify, which checks
/// the files as one chain. A `start` line copied from another log to the
/// top of the file, or an older rotated file put in the live file's place,
/// is then skipped instead of taking the seq back.
fn ends(
    f: &mut File,
    size: u64,
    ring: &Keyring,
    seed: Option<(u64, [u8; 32])>,
    probe: Option<(u64, [u8; 32])>,
) -> std::io::Result<Ends> {
    use std::io::Read;
    f.seek(SeekFrom::Start(0))?;
    let verifies = |line: &Line, raw: &[u8], over: &[u8; 32], mac: &[u8; 32]| {
        ring.get(KeyId(line.mac_key)).is_some_and(|k| {
            k.audit_keys()
                .chain_mac(over, &raw[..raw.len() - MAC_SUFFIX_LEN])
                == *mac
        })
    };
    // (seq, MAC) of the last good line, how many complete lines since it
    // (or, before it, since the file's start) did not verify, how many did
    // before the anchor, and the last complete line at all.
    let mut good: Option<(u64, [u8; 32])> = seed;
    let mut bad = 0u64;
    let mut failed = 0u64;
    let mut before_anchor = 0u64;
    // The seq of this file's first line in the chain; whether `probe` is
    // one of its lines in the chain.
    let mut anchor: Option<u64> = None;
    let mut holds_probe = false;
    let mut last_parsed: Option<(u64, [u8; 32])> = None;
    let mut phys: Option<(u64, [u8; 32])> = None;
    let mut named_key = false;
    let mut any_line = false;
    let (mut first, mut first_line) = (None, true);
    let mut lines = std::io::BufReader::new((&mut *f).take(size));
    let mut raw = Vec::new();
    while let Some((len, ended)) = next_line(&mut lines, &mut raw)? {
        if !ended {
            // The last segment, without its newline: cut by a crash (the
            // restart ends the file with a newline before its own lines).
            break;
        }
        let parsed = if len > MAX_LINE as u64 {
            Err("longer than any audit line")
        } else {
            verify::parse(&raw)
        };
        let Ok((line, mac)) = parsed else {
            // Not a line (a crash's cut one): counted, but it does not
            // make the file unclean, nor is it the file's first line (as
            // in verify, the first complete line is).
            bad += 1;
            continue;
        };
        named_key |= ring.get(KeyId(line.mac_key)).is_some();
        any_line = true;
        // The complete line physically before this one.
        let before = std::mem::take(&mut phys);
        // The unchecked fallback never goes on from a seq at or past the
        // ceiling; a line that verifies is the writer's own, whatever its
        // seq.
        if line.seq < MAX_SEQ {
            last_parsed = Some((line.seq, mac));
        }
        phys = Some((line.seq, mac));
        let own = line
            .prev
            .as_deref()
            .and_then(|p| verify::unhex32(p.as_bytes()));
        // The next line of `after`: the next seq, a `prev` (if any) that is
        // its MAC, and a MAC over it.
        let next_of = |(seq, m): (u64, [u8; 32])| {
            seq.checked_add(1) == Some(line.seq)
                && own.is_none_or(|p| p == m)
                && verifies(&line, &raw, &m, &mac)
        };
        let ok = match good {
            // The anchor, as verify's: the file's first line, verifying
            // against its own `prev`, or the next line of the line
            // physically before it. Never a line further on that verifies
            // against its own `prev` alone (a replayed `start` does).
            None => {
                (first_line && own.is_some_and(|p| verifies(&line, &raw, &p, &mac)))
                    || before.is_some_and(next_of)
            }
            // Then only the next line of the chain.
            Some(g) => next_of(g),
        };
        if first_line && ok {
            first = Some(line.seq);
        }
        first_line = false;
        if ok {
            if anchor.is_none() {
                before_anchor = bad;
                anchor = Some(line.seq);
            }
            good = Some((line.seq, mac));
            holds_probe |= probe == good;
            bad = 0;
        } else {
            bad += 1;
            failed += 1;
        }
    }
    drop(lines);
    f.seek(SeekFrom::End(0))?;
    if good.is_none() && named_key {
        return Ok(Ends {
            first,
            anchor: None,
            clean: false,
            last: None,
            holds_probe: false,
            skipped: None,
            unverified: true,
            any_line,
        });
    }
    if good.is_none() && last_parsed.is_some() {
        tracing::warn!(
            "audit log: no line verifies under this keyset (its keys were removed?); chained \
             on from the last complete line unchecked"
        );
        return Ok(Ends {
            first,
            anchor: None,
            clean: false,
            last: last_parsed,
            holds_probe: false,
            skipped: None,
            unverified: false,
            any_line,
        });
    }
    Ok(Ends {
        first,
        anchor,
        clean: failed == 0,
        last: good,
        holds_probe,
        skipped: good
            .filter(|_| bad + before_anchor > 0)
            .map(|(seq, _)| Skipped {
                count: bad + before_anchor,
                before: before_anchor,
                seq,
            }),
        unverified: false,
        any_line,
    })
}

#[cfg(test)]
mod tests {
    use std::future::Future as _;

    use super::*;

    /// A new keyset's keyring.
    fn keyring() -> Arc<KeyringHandle> {
        let file = crate::domain::keyring::KeysetFile::generate(1_700_000_000);
        Arc::new(KeyringHandle::new(Keyring::from_file(&file).unwrap()))
    }

    /// A log to `sink`, rotated at 1 MiB, every Seal logged, no head kept.
    fn config(sink: Sink, on_failure: OnFailure) -> AuditConfig {
        AuditConfig {
            sink,
            max_bytes: 1 << 20,
            sample_seals: 1,
            on_failure,
            replica: "r".into(),
            head: None,
        }
    }

    /// A log to a file in a new directory (kept while the log lives).
    fn file_log(on_failure: OnFailure) -> (tempfile::TempDir, Arc<Audit>) {
        let dir = tempfile::tempdir().unwrap();
        let audit = Audit::start(
            config(Sink::File(dir.path().join("audit.log")), on_failure),
            keyring(),
        )
        .unwrap();
        (dir, audit)
    }

    #[test]
    fn times_are_rfc3339_with_microseconds_and_hex_is_lowercase() {
        let mut c = Clock::default();
        let t = c.now();
        assert_eq!(t.len(), "2026-12-03T16:20:11.734201Z".len(), "{t}");
        assert!(t.ends_with('Z') && t.as_bytes()[19] == b'.', "{t}");
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let want = crate::domain::keyring::rfc3339(secs);
        assert_eq!(&t[..10], &want[..10]);
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
    }

    /// A line longer than any audit line is read past keeping at most
    /// `MAX_LINE + 1` bytes of it; the lines around it are read whole, and
    /// a last segment without its newline is told apart.
    #[test]
    fn a_line_longer_than_any_audit_line_is_not_held_whole() {
        let mut data = b"first\n".to_vec();
        data.resize(data.len() + 16 * MAX_LINE, b'a');
        data.extend_from_slice(b"\nlast\ncut");
        let mut r = std::io::BufReader::with_capacity(8192, &data[..]);
        let mut buf = Vec::new();
        assert_eq!(next_line(&mut r, &mut buf).unwrap(), Some((5, true)));
        assert_eq!(buf, b"first");
        let long = next_line(&mut r, &mut buf).unwrap();
        assert_eq!(long, Some((16 * MAX_LINE as u64, true)));
        assert_eq!(buf.len(), MAX_LINE + 1);
        assert!(buf.capacity() <= 2 * (MAX_LINE + 1), "{}", buf.capacity());
        assert_eq!(next_line(&mut r, &mut buf).unwrap(), Some((4, true)));
        assert_eq!(buf, b"last");
        assert_eq!(next_line(&mut r, &mut buf).unwrap(), Some((3, false)));
        assert_eq!(next_line(&mut r, &mut buf).unwrap(), None);
    }

    /// Review of the group commit, C: a round that failed after one that
    /// wrote does not refuse the written one's tickets, and a dropped
    /// round's ticket is never answered written by a later round.
    #[test]
    fn each_ticket_is_answered_by_its_own_round() {
        let (_dir, audit) = file_log(OnFailure::Closed);
        let s = &audit.shared;
        s.answered(true, (0, 10));
        s.answered(false, (10, 20));
        s.answered(true, (20, 30));
        assert_eq!(s.outcome(5), Some(true));
        assert_eq!(s.outcome(15), Some(false));
        assert_eq!(s.outcome(25), Some(true));
        assert_eq!(s.outcome(30), None);
        // Rounds failing one after another (an outage) are kept as one.
        s.answered(false, (30, 40));
        s.answered(false, (40, 50));
        assert_eq!(s.outcome(45), Some(false));
        assert_eq!(s.failed.lock().unwrap().ranges.len(), 2);
        audit.close();
    }

    /// A decision's line, written without serde, is the bytes serde writes
    /// for the same [`Line`] (which verify reads back): with and without
    /// each optional member, and a caller and tenant that need escaping.
    #[test]
    fn a_decision_line_is_what_serde_writes() {
        let keys = keyring();
        let cfg = AuditConfig {
            replica: "r\"1\u{7}é".into(),
            ..config(Sink::Stdout, OnFailure::Closed)
        };
        let stats = Arc::new(AuditStats::default());
        let Ok(mut w) = Writer::open(&cfg, keys.clone(), stats) else {
            panic!("no writer");
        };
        let ring = keys.current();
        let full = Decision {
            method: Method::Open,
            tenant: Tenant::new("t-1"),
            caller: "CN=a \"b\"\\c\n\u{1}\u{2028}ü".into(),
            mode: Some("reserve"),
            subject: Some("user-7".into()),
            attempt: Some("att".into()),
            trail: Trail {
                key_id: Some(KeyId(3)),
                ledger_id: Some([9; 32]),
            },
            refused: Some(Reject::Replayed),
        };
        // Nothing to escape, not all of it ASCII (copied as it is).
        let bare = Decision {
            method: Method::Seal,
            caller: "CN=ü ✓ \u{7f}\u{2028}\u{2029} ~".into(),
            mode: None,
            subject: None,
            attempt: Some(String::new()),
            trail: Trail::default(),
            refused: None,
            ..full.clone()
        };
        for (d, sampled) in [
            (full.clone(), 1),
            (bare.clone(), 1),
            (full, 7),
            (bare, u32::MAX),
        ] {
            w.pending.clear();
            w.decision(d, sampled, &ring);
            let raw = w.pending.strip_suffix(b"\n").unwrap().to_vec();
            let line: Line = serde_json::from_slice(&raw).unwrap();
            let mut body = serde_json::to_vec(&line).unwrap();
            body.pop();
            assert_eq!(
                String::from_utf8_lossy(&raw[..raw.len() - MAC_SUFFIX_LEN]),
                String::from_utf8_lossy(&body)
            );
            assert_eq!(line.sampled, (sampled > 1).then_some(sampled));
        }
    }

    /// A waker that counts its wakes.
    struct Count(AtomicU64);

    impl std::task::Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_round_wakes_only_the_waiters_of_its_own_tickets() {
        let (_dir, audit) = file_log(OnFailure::Closed);
        let s = &audit.shared;
        let count = Arc::new(Count(AtomicU64::new(0)));
        let waker = std::task::Waker::from(count.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        // Far longer than the test: the watcher does not end it.
        let hour = Duration::from_secs(3600);
        let mut late = std::pin::pin!(s.settled(5, hour));
        assert!(late.as_mut().poll(&mut cx).is_pending());
        s.answered(true, (0, 3));
        s.answered(false, (3, 5));
        assert_eq!(count.0.load(Ordering::Relaxed), 0, "woken by other rounds");
        assert!(late.as_mut().poll(&mut cx).is_pending());
        s.answered(true, (5, 9));
        assert_eq!(count.0.load(Ordering::Relaxed), 1);
        assert_eq!(late.as_mut().poll(&mut cx), std::task::Poll::Ready(true));
        // One dropped before its round is forgotten.
        let mut gone = Box::pin(s.settled(12, hour));
        assert!(gone.as_mut().poll(&mut cx).is_pending());
        assert_eq!(s.waiters.list().entries.len(), 1);
        drop(gone);
        assert!(s.waiters.list().entries.is_empty());
        audit.close();
    }

    /// A round that never comes (its writer hangs, here held away) does not
    /// hold the answer: the watcher ends the wait, with no timer of the
    /// request's own.
    #[test]
    fn a_waiter_whose_round_never_comes_is_answered_when_its_wait_is_over() {
        let (_dir, audit) = file_log(OnFailure::Closed);
        let held = lock(&audit.shared.q).writer.take();
        assert!(held.is_some());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let started = std::time::Instant::now();
        let answer = rt.block_on(async {
            let waited = audit.shared.settled(0, Duration::from_millis(300));
            // Far longer than the wait: a wait that never ends fails here.
            tokio::time::timeout(Duration::from_secs(60), waited).await
        });
        let took = started.elapsed();
        assert_eq!(answer, Ok(false));
        // The outer timeout's own wake-up would end it at 60 s: ended by
        // the watcher, it is far sooner.
        assert!(
            took < Duration::from_secs(30),
            "the wait ended only after {took:?}"
        );
        assert!(took >= Duration::from_millis(300));
        assert!(audit.shared.waiters.list().entries.is_empty());
        lock(&audit.shared.q).writer = held;
        audit.close();
    }

    /// Review of the group commit's fixes, F3: once the writer is lost (a
    /// leader unwound holding it), nothing more is queued: each entry is
    /// counted as dropped, not left waiting for a writer that never comes.
    #[test]
    fn nothing_is_queued_once_the_writer_is_lost() {
        let (_dir, audit) = file_log(OnFailure::Open);
        let s = &audit.shared;
        let lost = lock(&s.q).writer.take();
        assert!(lost.is_some());
        s.health.ended.store(true, Ordering::Release);
        assert_eq!(s.submit(Entry::Key(KeyEvent::ReloadApplied)), None);
        assert_eq!(audit.stats().dropped.load(Ordering::Relaxed), 1);
        assert!(lock(&s.q).entries.is_empty());
        assert!(!audit.ready());
        audit.close();
    }

    /// Third review of the group commit, N1: while the sink fails and a
    /// task holds the writer, the thread looks again every RETRY, it does
    /// not spin.
    #[test]
    fn the_thread_does_not_spin_while_a_task_holds_a_failing_writer() {
        let (_dir, audit) = file_log(OnFailure::Closed);
        let s = &audit.shared;
        let held = lock(&s.q).writer.take();
        s.health.failing.store(true, Ordering::Release);
        let before = s.turns.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_secs(2));
        let turns = s.turns.load(Ordering::Relaxed) - before;
        lock(&s.q).writer = held;
        s.health.failing.store(false, Ordering::Release);
        audit.close();
        // One turn per RETRY (500 ms), and the first at once.
        assert!(turns <= 8, "{turns} turns in 2 s");
    }

    /// A seq at its largest value is a failing sink, never an overflow.
    #[test]
    fn an_exhausted_seq_makes_no_line_and_does_not_panic() {
        let keys = keyring();
        let cfg = config(Sink::Stdout, OnFailure::Closed);
        let stats = Arc::new(AuditStats::default());
        let Ok(mut w) = Writer::open(&cfg, keys.clone(), stats.clone()) else {
            panic!("no writer");
        };
        w.seq = u64::MAX - 1;
        let ring = keys.current();
        w.push(Line::new("stop"), &ring);
        w.push(Line::new("stop"), &ring);
        let text = String::from_utf8(w.pending.clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            text.starts_with(&format!("{{\"seq\":{},", u64::MAX - 1)),
            "{text}"
        );
        assert!(w.exhausted);
        assert_eq!(stats.dropped.load(Ordering::Relaxed), 1);
    }
}
