//! Open connections of one listener, so that none can be hoarded: a peer
//! that opens connections and keeps them open without using them (the
//! HTTP/2 preface, SETTINGS, PING answers and nothing else) must not lock
//! out probes and callers.
//!
//! - A connection with no open stream for `idle_timeout` is closed.
//! - When the listener is at its cap, an arriving connection evicts the
//!   oldest connection still in its handshake, else the established one
//!   idle (no open stream) longest; while every connection has a stream
//!   open it waits, looking again every half second. Where callers
//!   authenticate (bearer, mTLS), a connection whose last call that tried
//!   to authenticate did not (or that never carried one) goes first, busy
//!   or not (the idlest of them, else the oldest, closed at once): stalled
//!   health checks from a peer without credentials must not keep it ahead
//!   of a caller's idle one, nor a credential that passed once (a secret
//!   since rotated, a tenant since removed) keep a connection protected.
//! - At most `per_ip` connections per source address (an IPv4-mapped IPv6
//!   address counts as its IPv4 address), counting those still in their
//!   handshake, and closing ones only while a stream is open on them: over
//!   it, the new connection evicts that address's idlest connection (one
//!   still in its handshake counts as idle since it opened, and gives its
//!   handshake up), or is refused when all of them are busy. The newest
//!   connection wins, so a burst from one address cannot get its last
//!   arrival refused while older ones are on their way out.
//! - A stream open longer than `max_stream_age` (up to twice that) closes
//!   its connection at once: every call is unary, so its peer is holding
//!   the answer back (a zero flow-control window) to keep the connection
//!   busy.
//! - With `auth_deadline` (bearer authentication): a connection that has
//!   not sent a request with a valid credential within the deadline is
//!   closed.
//! - Where callers authenticate (bearer, mTLS): a connection with
//!   `max_auth_failures` failed requests since the last that passed (or
//!   since it opened) is closed at once.
//!
//! Closing: a connection marked to close gracefully (idle, evicted, at its
//! address's cap, past the auth deadline) is closed by the task serving it
//! (`net::serve`): an HTTP/2 GOAWAY, so that its peer sends nothing new on
//! it and resends what the server did not take; the streams the server took
//! finish; a peer that does not finish the close within a bound is cut. A
//! connection closed at once (the attack cases: requests that keep failing
//! authentication, a busy unauthenticated connection evicted, a stream held
//! past its age) is ended by its own I/O (`accept::Counted`): its reads end
//! and a write its peer does not take at once fails. A close is never
//! called off. Which streams are open is counted by [`ConnActivityLayer`],
//! around every request.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use atomic_waker::AtomicWaker;

/// How one listener's connections are bounded.
#[derive(Clone, Debug)]
pub struct ConnPolicy {
    /// Closed after this long without an open stream.
    pub idle_timeout: Duration,
    /// Connections per source address (`usize::MAX`: no bound).
    pub per_ip: usize,
    /// Bearer mode: closed without a request with a valid credential
    /// within this long of opening.
    pub auth_deadline: Option<Duration>,
    /// Where callers authenticate: closed after this many failed requests
    /// since the last that passed (or since it opened).
    pub max_auth_failures: u32,
    /// A connection with a stream open this long (up to twice this long)
    /// is closed at once: every call is unary and bounded by the request
    /// timeout, so such a stream is held by a peer that does not take its
    /// answer (a zero flow-control window), keeping its connection busy
    /// and never evicted.
    pub max_stream_age: Duration,
    /// Callers authenticate (bearer, mTLS): eviction takes connections
    /// whose calls do not authenticate (none has yet, or the last that
    /// tried failed) first, and failed requests close a connection.
    pub callers_authenticate: bool,
}

/// Counters for the metrics endpoint, shared by the listeners that report
/// them.
#[derive(Debug, Default)]
pub struct ConnStats {
    /// Closed because their TLS handshake (or HTTP/2 preface) failed or
    /// timed out.
    pub handshakes_failed: AtomicU64,
    /// Closed mid-handshake to make room for a newer one.
    pub handshakes_evicted: AtomicU64,
    pub closed_idle: AtomicU64,
    pub evicted: AtomicU64,
    pub refused_per_ip: AtomicU64,
    pub closed_unauthenticated: AtomicU64,
    /// Closed with a stream open past `max_stream_age`.
    pub closed_stalled: AtomicU64,
    /// Graceful closes begun (an HTTP/2 GOAWAY sent), by [`Cause`].
    pub goaways: [AtomicU64; Cause::ALL.len()],
    /// Connections cut because their peer did not finish a graceful close
    /// within its bound.
    pub cut_after_drain: AtomicU64,
}

/// Why the server closes a connection gracefully (HTTP/2 GOAWAY, then a
/// bounded drain).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Cause {
    /// No open stream for the idle timeout.
    Idle = 0,
    /// Made room for an arrival at the listener's cap.
    Evicted = 1,
    /// Made room for an arrival at its address's cap.
    PerIp = 2,
    /// No request with a valid credential within the auth deadline.
    AuthDeadline = 3,
    /// Reached the maximum connection age.
    MaxAge = 4,
    /// The server is shutting down.
    Shutdown = 5,
}

impl Cause {
    pub const ALL: [Cause; 6] = [
        Cause::Idle,
        Cause::Evicted,
        Cause::PerIp,
        Cause::AuthDeadline,
        Cause::MaxAge,
        Cause::Shutdown,
    ];

    /// Its label in metrics.
    pub const fn name(self) -> &'static str {
        match self {
            Cause::Idle => "idle",
            Cause::Evicted => "evicted",
            Cause::PerIp => "per_ip",
            Cause::AuthDeadline => "auth_deadline",
            Cause::MaxAge => "max_age",
            Cause::Shutdown => "shutdown",
        }
    }

    fn from_u8(v: u8) -> Cause {
        Cause::ALL
            .into_iter()
            .find(|c| *c as u8 == v)
            .unwrap_or(Cause::Idle)
    }
}

/// The address a connection counts against: an IPv4-mapped IPv6 address
/// as its IPv4 address, any other as it is. (Not an IPv6 /64: Kubernetes
/// gives each node's pods one /64, and they would share one cap.)
pub fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

/// One open connection.
#[derive(Debug)]
pub struct Conn {
    id: u64,
    ip: IpAddr,
    /// When it opened, in milliseconds since the registry's epoch.
    opened_ms: u64,
    registry: Arc<Conns>,
    /// Streams open now.
    active: AtomicUsize,
    /// Streams open now, by the parity of the registry's stream epoch they
    /// opened in (see [`Conns::age_streams`]).
    by_epoch: [AtomicUsize; 2],
    /// When the last stream ended (or the connection opened), in
    /// milliseconds since the registry's epoch.
    idle_since_ms: AtomicU64,
    /// Past its handshake and served (only such a connection is evicted to
    /// make room on the listener; its address's cap also evicts one still
    /// in its handshake).
    established: AtomicBool,
    /// [`NEVER`], [`PASSED`] or [`LAPSED`].
    auth: AtomicU8,
    /// Failed requests since the last that passed (or since it opened).
    auth_failures: AtomicU32,
    /// [`OPEN`], [`SOFT`] or [`HARD`].
    closing: AtomicU8,
    /// Why it was marked [`SOFT`] (a [`Cause`]).
    cause: AtomicU8,
    /// When its GOAWAY was sent (registry milliseconds + 1; 0: not yet).
    goaway_ms: AtomicU64,
    /// Its reads (see `accept::Counted`).
    waker: AtomicWaker,
    /// The task serving it (see `net::serve`), which begins a graceful
    /// close when it is marked [`SOFT`].
    task_waker: AtomicWaker,
}

/// How long after its GOAWAY a connection still takes new streams (those a
/// peer sent before it read the GOAWAY); later ones are refused
/// `UNAVAILABLE` unprocessed.
pub const LATE_AFTER_GOAWAY: Duration = Duration::from_secs(1);

const OPEN: u8 = 0;
/// Idle too long, evicted, or bearer without a valid credential by its
/// deadline: closed gracefully by the task serving it (HTTP/2 GOAWAY, the
/// streams it takes finish, then a bounded drain; see `net::serve`).
/// Final: a stream served meanwhile does not call it off.
const SOFT: u8 = 1;
/// Requests that keep failing authentication, a busy unauthenticated
/// connection evicted, or a stream held past its age: the attack cases,
/// closed at once by the connection's own I/O.
const HARD: u8 = 2;

/// No call on the connection has passed caller authentication.
const NEVER: u8 = 0;
/// The last call that tried passed.
const PASSED: u8 = 1;
/// One passed, and a later one failed (its secret rotated, its tenant
/// removed, or a stolen connection's guesses): no longer protected from
/// eviction, but it did authenticate within the deadline.
const LAPSED: u8 = 2;

/// What a connection's I/O is to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closing {
    No,
    /// Marked to close, with a stream open: served as usual until no stream
    /// is open.
    AfterStreams,
    /// Close when nothing is buffered and no stream is open.
    WhenQuiet,
    Now,
}

impl Conn {
    /// Marks the connection to be closed and wakes its reader and its task.
    fn close(&self, how: u8, cause: Cause) {
        if how == SOFT && self.closing.load(Ordering::SeqCst) == OPEN {
            self.cause.store(cause as u8, Ordering::SeqCst);
        }
        if self.closing.fetch_max(how, Ordering::SeqCst) < how {
            self.waker.wake();
            self.task_waker.wake();
        }
    }

    /// Closed at once: a write its peer does not take at once ends it (a
    /// peer that stops reading keeps h2 from reading too, so the end of its
    /// reads alone would never come). Its streams go with it.
    pub fn ending(&self) -> bool {
        self.closing.load(Ordering::SeqCst) == HARD
    }

    /// For the task serving the connection: ready with the cause once it is
    /// marked to close gracefully (or at once: then its I/O ends it).
    pub fn poll_close_requested(&self, cx: &Context<'_>) -> Poll<Option<Cause>> {
        self.task_waker.register(cx.waker());
        match self.closing.load(Ordering::SeqCst) {
            OPEN => Poll::Pending,
            SOFT => Poll::Ready(Some(Cause::from_u8(self.cause.load(Ordering::SeqCst)))),
            _ => Poll::Ready(None),
        }
    }

    /// Its serving task sent the GOAWAY (graceful close) now.
    pub fn goaway_sent(&self) {
        let now = self.registry.now_ms().saturating_add(1);
        let _ = self
            .goaway_ms
            .compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// A stream arriving now, past [`LATE_AFTER_GOAWAY`] after the GOAWAY,
    /// was sent by a peer that ignores it (a client stops within a round
    /// trip): refused, it does not hold the connection open.
    pub fn late_after_goaway(&self) -> bool {
        let at = self.goaway_ms.load(Ordering::SeqCst);
        let late = u64::try_from(LATE_AFTER_GOAWAY.as_millis()).unwrap_or(u64::MAX);
        at != 0 && self.registry.now_ms().saturating_add(1).saturating_sub(at) > late
    }

    /// Streams open on it now.
    pub fn active_streams(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// The counters of its listener.
    pub fn stats(&self) -> &Arc<ConnStats> {
        &self.registry.stats
    }

    /// For the connection's reads: registers the reader and tells what to
    /// do.
    pub fn poll_closing(&self, cx: &Context<'_>) -> Closing {
        self.waker.register(cx.waker());
        self.closing_now()
    }

    /// What the connection's I/O is to do, without registering a waker.
    fn closing_now(&self) -> Closing {
        match self.closing.load(Ordering::SeqCst) {
            OPEN => Closing::No,
            SOFT if self.active.load(Ordering::SeqCst) > 0 => Closing::AfterStreams,
            SOFT => Closing::WhenQuiet,
            _ => Closing::Now,
        }
    }

    /// Completes once the connection is marked to be closed (for its
    /// handshake, which then gives up: a connection evicted before it was
    /// served is never served).
    pub async fn marked(&self) {
        std::future::poll_fn(|cx| {
            self.waker.register(cx.waker());
            if self.is_closing() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }

    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst) != OPEN
    }

    /// The handshake is over: the connection is served, and may be evicted
    /// to make room on the listener. (It counts against its address's cap
    /// from the moment it was registered.)
    pub fn established(&self) {
        self.idle_since_ms
            .store(self.registry.now_ms(), Ordering::SeqCst);
        self.established.store(true, Ordering::SeqCst);
    }

    /// A request passed caller authentication.
    pub fn authenticated(&self) {
        self.auth_failures.store(0, Ordering::Relaxed);
        self.auth.store(PASSED, Ordering::Relaxed);
    }

    /// A request failed caller authentication: the connection is no longer
    /// counted as authenticated, and is closed after `max_auth_failures`
    /// such requests since the last that passed.
    pub fn auth_failed(&self) {
        let _ = self
            .auth
            .compare_exchange(PASSED, LAPSED, Ordering::Relaxed, Ordering::Relaxed);
        let n = self.auth_failures.fetch_add(1, Ordering::Relaxed) + 1;
        let p = &self.registry.policy;
        if p.callers_authenticate && n >= p.max_auth_failures && !self.is_authenticated() {
            self.registry
                .stats
                .closed_unauthenticated
                .fetch_add(1, Ordering::Relaxed);
            self.close(HARD, Cause::Idle);
        }
    }

    /// Its last call that tried to authenticate passed.
    fn is_authenticated(&self) -> bool {
        self.auth.load(Ordering::Relaxed) == PASSED
    }

    /// How long it has had no open stream; `None` while a stream is open,
    /// or while it is still in its handshake unless `handshaking` counts.
    fn idle_for_ms(&self, now_ms: u64, handshaking: bool) -> Option<u64> {
        (self.active.load(Ordering::SeqCst) == 0
            && (handshaking || self.established.load(Ordering::Relaxed)))
        .then(|| now_ms.saturating_sub(self.idle_since_ms.load(Ordering::Relaxed)))
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let mut inner = self
            .registry
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        inner.by_id.remove(&self.id);
        if let Some(n) = inner.per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                inner.per_ip.remove(&self.ip);
            }
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    /// Weak: a connection leaves when its last handle drops.
    by_id: HashMap<u64, std::sync::Weak<Conn>>,
    per_ip: HashMap<IpAddr, usize>,
}

/// The open connections of one listener.
#[derive(Debug)]
pub struct Conns {
    policy: ConnPolicy,
    stats: Arc<ConnStats>,
    epoch: Instant,
    /// The parity of the stream epoch: a stream opening now counts under
    /// it (see [`Conns::age_streams`]).
    stream_epoch: AtomicU8,
    inner: Mutex<Inner>,
}

impl Conns {
    /// The counters this registry's listener reports into.
    pub fn stats(&self) -> &Arc<ConnStats> {
        &self.stats
    }

    /// A registry counting into `stats`, and its sweeper (closing idle and
    /// unauthenticated connections) running until the registry is dropped.
    pub fn new(policy: ConnPolicy, stats: Arc<ConnStats>) -> Arc<Self> {
        let conns = Arc::new(Conns {
            policy,
            stats,
            epoch: Instant::now(),
            stream_epoch: AtomicU8::new(0),
            inner: Mutex::default(),
        });
        let every = (conns.policy.idle_timeout / 4)
            .clamp(Duration::from_millis(50), Duration::from_secs(1));
        Self::every(&conns, every, Conns::sweep);
        Self::every(&conns, conns.policy.max_stream_age, Conns::age_streams);
        conns
    }

    /// Runs `f` on the registry every `period` until the registry is
    /// dropped.
    fn every(conns: &Arc<Self>, period: Duration, f: fn(&Conns)) {
        let weak = Arc::downgrade(conns);
        let period = period.clamp(Duration::from_millis(50), Duration::from_secs(86_400));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(Instant::now() + period, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match weak.upgrade() {
                    Some(c) => f(&c),
                    None => return,
                }
            }
        });
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Ends one stream epoch (every `max_stream_age`). A stream counts
    /// under the parity of the epoch it opened in; the parity about to be
    /// reused can only hold streams opened an epoch ago or more, so a
    /// connection with one is closed at once (`HARD`): its peer holds a
    /// stream it does not finish, which keeps the connection busy, never
    /// idle and never evicted. Two counters per connection, nothing per
    /// stream.
    fn age_streams(&self) {
        let next = self.stream_epoch.load(Ordering::SeqCst) ^ 1;
        for c in self.live() {
            if c.by_epoch[usize::from(next)].load(Ordering::SeqCst) > 0
                && c.closing.load(Ordering::SeqCst) != HARD
            {
                self.stats.closed_stalled.fetch_add(1, Ordering::Relaxed);
                c.close(HARD, Cause::Idle);
            }
        }
        self.stream_epoch.store(next, Ordering::SeqCst);
    }

    fn live(&self) -> Vec<Arc<Conn>> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .by_id
            .values()
            .filter_map(std::sync::Weak::upgrade)
            .collect()
    }

    /// Closes idle connections past the idle timeout, and (bearer mode)
    /// connections that did not authenticate in time.
    fn sweep(&self) {
        let now = self.now_ms();
        let idle = u64::try_from(self.policy.idle_timeout.as_millis()).unwrap_or(u64::MAX);
        let deadline = self
            .policy
            .auth_deadline
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        for c in self.live() {
            if c.ending() {
                // Its task may be waiting on a write its peer does not
                // take: woken, the write that still waits ends it.
                c.waker.wake();
            }
            if c.closing.load(Ordering::Relaxed) == HARD {
                continue;
            }
            if c.idle_for_ms(now, false).is_some_and(|ms| ms >= idle) {
                if !c.is_closing() {
                    self.stats.closed_idle.fetch_add(1, Ordering::Relaxed);
                }
                c.close(SOFT, Cause::Idle);
            } else if let Some(d) = deadline {
                if c.established.load(Ordering::Relaxed)
                    && !c.is_closing()
                    && c.auth.load(Ordering::Relaxed) == NEVER
                    && now.saturating_sub(c.opened_ms) >= d
                {
                    self.stats
                        .closed_unauthenticated
                        .fetch_add(1, Ordering::Relaxed);
                    c.close(SOFT, Cause::AuthDeadline);
                }
            }
        }
    }

    /// Marks a connection to be closed to make room: the established one
    /// idle longest. Where callers authenticate, one whose calls do not
    /// authenticate (none has, or the last that tried failed) goes first: the idlest of those, else (busy: a
    /// held stream, a health check on the gRPC port, buys an
    /// unauthenticated peer nothing) the oldest, closed at once; only then
    /// an authenticated one. False if there is no such connection.
    pub fn evict_idlest(&self) -> bool {
        let all = self.live();
        // A connection closing gracefully that never authenticated and
        // still has a stream open (its peer ignores the GOAWAY) buys an
        // unauthenticated peer nothing either: cut at once first.
        if self.policy.callers_authenticate {
            let draining = all
                .iter()
                .filter(|c| {
                    c.closing.load(Ordering::SeqCst) == SOFT
                        && !c.is_authenticated()
                        && c.active.load(Ordering::SeqCst) > 0
                })
                .min_by_key(|c| (c.opened_ms, c.id));
            if let Some(c) = draining {
                c.close(HARD, Cause::Evicted);
                return true;
            }
        }
        let live: Vec<_> = all.into_iter().filter(|c| !c.is_closing()).collect();
        self.evict_among(&live, false)
    }

    /// [`Self::evict_idlest`] among `live` (none of them closing); with
    /// `handshaking`, a connection still in its handshake is a candidate,
    /// idle since it opened (and, having carried no call, unauthenticated).
    fn evict_among(&self, live: &[Arc<Conn>], handshaking: bool) -> bool {
        if !self.policy.callers_authenticate {
            return self.evict_idlest_of(live.iter(), handshaking);
        }
        let (authenticated, unauthenticated): (Vec<_>, Vec<_>) =
            live.iter().partition(|c| c.is_authenticated());
        if self.evict_idlest_of(unauthenticated.iter().copied(), handshaking) {
            return true;
        }
        let busy = unauthenticated
            .iter()
            .filter(|c| c.established.load(Ordering::Relaxed))
            .min_by_key(|c| (c.opened_ms, c.id));
        if let Some(c) = busy {
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
            c.close(HARD, Cause::Evicted);
            return true;
        }
        self.evict_idlest_of(authenticated.into_iter(), handshaking)
    }

    /// Marks the idlest of `candidates` (idle longest; of those idle as long,
    /// to the millisecond, the oldest) to close once no stream is open.
    fn evict_idlest_of<'a>(
        &self,
        candidates: impl Iterator<Item = &'a Arc<Conn>>,
        handshaking: bool,
    ) -> bool {
        let now = self.now_ms();
        let idle = candidates
            .filter_map(|c| c.idle_for_ms(now, handshaking).map(|ms| (ms, c)))
            .max_by_key(|(ms, c)| (*ms, std::cmp::Reverse(c.id)));
        match idle {
            Some((_, c)) => {
                self.stats.evicted.fetch_add(1, Ordering::Relaxed);
                // With `handshaking`: its address's cap.
                c.close(
                    SOFT,
                    if handshaking {
                        Cause::PerIp
                    } else {
                        Cause::Evicted
                    },
                );
                true
            }
            None => false,
        }
    }

    /// Registers a connection just accepted from `ip`; `None` when `ip`
    /// holds `per_ip` connections and every one of them is busy (the
    /// connection is to be refused). At the cap with one idle or still in
    /// its handshake, the idlest is evicted. A connection already closing
    /// is held only while a stream is open on it: one with none leaves as
    /// soon as its task runs (its handshake gives up, its reads end, a
    /// write its peer does not take ends it): counting them would refuse the
    /// newest arrival of a burst (a probe behind a flood from its own
    /// address) while the ones it would replace are on their way out.
    pub fn register(self: &Arc<Self>, ip: IpAddr) -> Option<Arc<Conn>> {
        let ip = address_key(ip);
        let registered = {
            let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            inner.per_ip.get(&ip).copied().unwrap_or(0)
        };
        if registered >= self.policy.per_ip {
            let mine: Vec<_> = self.live().into_iter().filter(|c| c.ip == ip).collect();
            let held = mine
                .iter()
                .filter(|c| !c.is_closing() || c.active.load(Ordering::SeqCst) > 0)
                .count();
            // Connections of the address closing with a stream open (their
            // peer may ignore the GOAWAY): as many as the cap, and the
            // address gets no more, evicting none (each eviction would let
            // one more in while the evicted one drains).
            let draining = mine
                .iter()
                .filter(|c| c.is_closing() && c.active.load(Ordering::SeqCst) > 0)
                .count();
            let open: Vec<_> = mine.into_iter().filter(|c| !c.is_closing()).collect();
            if held >= self.policy.per_ip
                && (draining >= self.policy.per_ip || !self.evict_among(&open, true))
            {
                self.stats.refused_per_ip.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.next += 1;
        let id = inner.next;
        let now = self.now_ms();
        let conn = Arc::new(Conn {
            id,
            ip,
            opened_ms: now,
            registry: self.clone(),
            active: AtomicUsize::new(0),
            by_epoch: [AtomicUsize::new(0), AtomicUsize::new(0)],
            idle_since_ms: AtomicU64::new(now),
            established: AtomicBool::new(false),
            auth: AtomicU8::new(NEVER),
            auth_failures: AtomicU32::new(0),
            closing: AtomicU8::new(OPEN),
            cause: AtomicU8::new(Cause::Idle as u8),
            goaway_ms: AtomicU64::new(0),
            waker: AtomicWaker::new(),
            task_waker: AtomicWaker::new(),
        });
        inner.by_id.insert(id, Arc::downgrade(&conn));
        *inner.per_ip.entry(ip).or_default() += 1;
        Some(conn)
    }
}

/// What a connection's handshake established about the peer (TLS: the
/// client certificate), attached to each request on it.
#[derive(Clone, Debug)]
pub enum PeerIdentity {
    /// Plaintext, or TLS without client certificates.
    Anonymous,
    /// A client certificate the handshake verified against the client CA
    /// in force then. The tenant is mapped from these SANs on *every*
    /// request, against the tenants file in force at that request, so a
    /// removed tenant is refused at once on connections that are already
    /// open; an expired certificate likewise. A replaced client CA reaches
    /// open connections within the maximum connection age.
    Certificate(Arc<CertIdentity>),
}

/// The parts of a verified client certificate that authorization uses.
#[derive(Debug)]
pub struct CertIdentity {
    pub uris: Vec<String>,
    pub dns: Vec<String>,
    /// The certificate's notAfter, Unix seconds.
    pub not_after: i64,
}

// === streams per connection ===

/// What a request's extensions carry about its connection (tonic inserts a
/// connection's `ConnectInfo` into every request on it).
#[derive(Clone, Debug)]
pub struct ConnInfo<P> {
    pub peer: P,
    pub conn: Arc<Conn>,
}

/// Counts a connection's open streams: from a request's arrival to the end
/// of its response body.
#[derive(Clone, Debug, Default)]
pub struct ConnActivityLayer;

impl<S> tower_layer::Layer<S> for ConnActivityLayer {
    type Service = ConnActivity<S>;
    fn layer(&self, inner: S) -> ConnActivity<S> {
        ConnActivity { inner }
    }
}

#[derive(Clone, Debug)]
pub struct ConnActivity<S> {
    inner: S,
}

/// A stream's place on its connection; leaves (and starts the idle clock)
/// on drop.
#[derive(Debug)]
pub struct StreamGuard(Option<(Arc<Conn>, u8)>);

impl StreamGuard {
    pub(crate) fn enter(conn: Option<Arc<Conn>>) -> Self {
        StreamGuard(conn.map(|c| {
            let parity = c.registry.stream_epoch.load(Ordering::SeqCst);
            c.by_epoch[usize::from(parity)].fetch_add(1, Ordering::SeqCst);
            c.active.fetch_add(1, Ordering::SeqCst);
            (c, parity)
        }))
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if let Some((c, parity)) = self.0.take() {
            let now = c.registry.now_ms();
            c.idle_since_ms.store(now, Ordering::SeqCst);
            c.by_epoch[usize::from(parity)].fetch_sub(1, Ordering::SeqCst);
            if c.active.fetch_sub(1, Ordering::SeqCst) == 1 && c.is_closing() {
                // The last stream of a closing connection: its reads
                // decide when it ends.
                c.waker.wake();
            }
        }
    }
}

/// The connection a request's extensions name, whatever its peer type.
pub fn conn_of(e: &http::Extensions) -> Option<Arc<Conn>> {
    e.get::<ConnInfo<PeerIdentity>>()
        .map(|i| i.conn.clone())
        .or_else(|| e.get::<ConnInfo<()>>().map(|i| i.conn.clone()))
}

impl<S, B, RB> tower_service::Service<http::Request<B>> for ConnActivity<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Send + 'static,
{
    type Response = http::Response<GuardedBody<RB>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() == HEALTH_WATCH {
            // A stream that never ends would keep its connection busy
            // forever, never idle, never evicted: probes use Check.
            let mut resp = http::Response::new(GuardedBody {
                body: None,
                _guard: StreamGuard(None),
            });
            let h = resp.headers_mut();
            h.insert(
                "content-type",
                http::HeaderValue::from_static("application/grpc"),
            );
            h.insert("grpc-status", http::HeaderValue::from_static("12")); // UNIMPLEMENTED
            h.insert(
                "grpc-message",
                http::HeaderValue::from_static("Watch is not served; use Check"),
            );
            return Box::pin(async move { Ok(resp) });
        }
        let guard = StreamGuard::enter(conn_of(req.extensions()));
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(resp.map(|body| GuardedBody {
                body: Some(body),
                _guard: guard,
            }))
        })
    }
}

/// `grpc.health.v1.Health/Watch`: refused on every gRPC listener.
const HEALTH_WATCH: &str = "/grpc.health.v1.Health/Watch";

pin_project_lite::pin_project! {
    /// A response body that keeps its stream counted until it is done
    /// (`None`: a headers-only answer).
    pub struct GuardedBody<B> {
        #[pin]
        body: Option<B>,
        _guard: StreamGuard,
    }
}

impl<B: http_body::Body> http_body::Body for GuardedBody<B> {
    type Data = B::Data;
    type Error = B::Error;
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        match self.project().body.as_pin_mut() {
            Some(b) => b.poll_frame(cx),
            None => Poll::Ready(None),
        }
    }
    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(|b| b.is_end_stream())
    }
    fn size_hint(&self) -> http_body::SizeHint {
        self.body
            .as_ref()
            .map_or_else(|| http_body::SizeHint::with_exact(0), |b| b.size_hint())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    /// `N` established connections from [`IP`].
    fn established<const N: usize>(conns: &Arc<Conns>) -> [Arc<Conn>; N] {
        std::array::from_fn(|_| {
            let c = conns.register(IP).unwrap();
            c.established();
            c
        })
    }

    fn registry(per_ip: usize) -> Arc<Conns> {
        Conns::new(
            ConnPolicy {
                idle_timeout: Duration::from_secs(300),
                per_ip,
                auth_deadline: None,
                max_auth_failures: 3,
                max_stream_age: Duration::from_secs(15),
                callers_authenticate: false,
            },
            Arc::default(),
        )
    }

    /// A burst from one address, the accept loop ahead of the handshakes:
    /// every established connection of that address is marked to close,
    /// and the next arrival (a probe behind a flood from its own address)
    /// is still admitted; the oldest of the address's open connections,
    /// established or in its handshake, makes room.
    #[tokio::test]
    async fn an_arrival_behind_a_burst_is_admitted_and_the_oldest_makes_room() {
        let conns = registry(2);
        let [a, b] = established(&conns);
        // Two arrivals whose handshakes have not run yet.
        let c = conns.register(IP).unwrap();
        let d = conns.register(IP).unwrap();
        assert!(a.is_closing() && b.is_closing());
        let e = conns.register(IP).expect("the newest arrival is admitted");
        assert!(
            c.is_closing(),
            "the oldest open one (in its handshake) makes room"
        );
        assert!(!d.is_closing() && !e.is_closing());
        assert_eq!(conns.stats.refused_per_ip.load(Ordering::Relaxed), 0);
    }

    /// Connections already closing leave room: an arrival under the cap of
    /// open ones evicts nothing.
    #[tokio::test]
    async fn closing_connections_do_not_count_against_the_address() {
        let conns = registry(2);
        let [a, b] = established(&conns);
        a.close(SOFT, Cause::Idle);
        let _c = conns.register(IP).unwrap();
        assert!(!b.is_closing(), "room was there: nothing evicted");
        assert_eq!(conns.stats.evicted.load(Ordering::Relaxed), 0);
    }

    /// The cap still holds against busy connections: with every open
    /// connection of the address in a stream, the arrival is refused.
    #[tokio::test]
    async fn an_address_whose_connections_are_all_busy_is_refused() {
        let conns = registry(2);
        let [a, b] = established(&conns);
        let _streams = (
            StreamGuard::enter(Some(a.clone())),
            StreamGuard::enter(Some(b.clone())),
        );
        assert!(conns.register(IP).is_none());
        assert!(!a.is_closing() && !b.is_closing());
        assert_eq!(conns.stats.refused_per_ip.load(Ordering::Relaxed), 1);
        // Another address is not affected.
        assert!(conns
            .register(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1)))
            .is_some());
    }

    /// A dropped connection gives its place back, whether or not its
    /// handshake finished.
    #[tokio::test]
    async fn a_dropped_connection_gives_its_place_back() {
        let conns = registry(1);
        let a = conns.register(IP).unwrap();
        let _s = StreamGuard::enter(Some(a.clone()));
        drop(_s);
        a.established();
        let guard = StreamGuard::enter(Some(a.clone()));
        assert!(conns.register(IP).is_none(), "a is busy");
        drop(guard);
        drop(a);
        let b = conns.register(IP).expect("a's place is free");
        drop(b); // never established
        let c = conns.register(IP).expect("b's place is free");
        assert_eq!(conns.stats.evicted.load(Ordering::Relaxed), 0);
        let counted = |conns: &Conns| {
            let inner = conns.inner.lock().unwrap();
            inner.per_ip.get(&IP).copied()
        };
        assert_eq!(counted(&conns), Some(1));
        drop(c);
        assert_eq!(counted(&conns), None, "the address's count is gone");
    }

    /// A closing connection with a stream open is still held: with it and
    /// the address's other connections busy, the arrival is refused.
    #[tokio::test]
    async fn a_closing_connection_with_a_stream_open_still_counts() {
        let conns = registry(2);
        let [a, b] = established(&conns);
        let _streams = (
            StreamGuard::enter(Some(a.clone())),
            StreamGuard::enter(Some(b.clone())),
        );
        a.close(SOFT, Cause::Idle);
        assert!(conns.register(IP).is_none());
        assert_eq!(conns.stats.refused_per_ip.load(Ordering::Relaxed), 1);
    }

    /// A stream held open past the stream age (a peer that does not take
    /// its answer keeps its connection busy, never evicted) closes its
    /// connection at once; a connection whose streams each end in time is
    /// kept, however long it stays busy with overlapping ones.
    #[tokio::test(start_paused = true)]
    async fn a_stream_held_past_its_age_closes_its_connection() {
        let conns = registry(4);
        let [stalled, busy] = established(&conns);
        let _held = StreamGuard::enter(Some(stalled.clone()));
        let mut overlapping = std::collections::VecDeque::new();
        // 40 s in steps of 1 s; each of busy's streams lasts 3 s.
        for _ in 0..40 {
            overlapping.push_back(StreamGuard::enter(Some(busy.clone())));
            if overlapping.len() > 3 {
                overlapping.pop_front();
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(
            stalled.closing_now(),
            Closing::Now,
            "the stalled stream's connection is open"
        );
        assert!(
            !busy.is_closing(),
            "a busy connection with short streams was closed"
        );
        assert_eq!(conns.stats.closed_stalled.load(Ordering::Relaxed), 1);
    }

    /// Where callers authenticate (here without a deadline, as with mTLS),
    /// a connection that never carried an authenticated call is evicted
    /// first: idle before busy, and a busy one before an authenticated one
    /// however long that has been idle (issue 58, finding 5).
    #[tokio::test(start_paused = true)]
    async fn connections_without_an_authenticated_call_are_evicted_first() {
        let conns = Conns::new(
            ConnPolicy {
                callers_authenticate: true,
                ..registry(16).policy.clone()
            },
            Arc::default(),
        );
        let [caller, idle, busy] = established(&conns);
        caller.authenticated();
        let _held = StreamGuard::enter(Some(busy.clone()));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(conns.evict_idlest());
        assert_eq!(idle.closing_now(), Closing::WhenQuiet, "the idle one first");
        assert!(conns.evict_idlest());
        assert_eq!(
            busy.closing_now(),
            Closing::Now,
            "then the busy one, at once"
        );
        assert!(!caller.is_closing());
        assert!(conns.evict_idlest());
        assert!(caller.is_closing(), "then the authenticated one");
    }

    /// Where callers authenticate, a connection whose last call that tried
    /// failed authentication (its bearer secret rotated, its certificate's
    /// tenant removed) loses its place among the authenticated ones: it is
    /// evicted before an authenticated one idle longer, until a call on it
    /// passes again (issue 58 review, finding 4: the flag was sticky).
    #[tokio::test(start_paused = true)]
    async fn a_failed_authentication_takes_a_connection_out_of_the_authenticated() {
        let conns = Conns::new(
            ConnPolicy {
                callers_authenticate: true,
                ..registry(16).policy.clone()
            },
            Arc::default(),
        );
        let [steady] = established(&conns);
        steady.authenticated();
        tokio::time::sleep(Duration::from_secs(5)).await;
        let [lapsed, again] = established(&conns);
        lapsed.authenticated();
        lapsed.auth_failed();
        again.authenticated();
        again.auth_failed();
        again.authenticated();
        assert!(conns.evict_idlest());
        assert!(
            lapsed.is_closing(),
            "the connection whose authentication failed goes first"
        );
        assert!(!steady.is_closing() && !again.is_closing());
        assert!(conns.evict_idlest());
        assert!(
            steady.is_closing() && !again.is_closing(),
            "then the idlest authenticated one: a call that passed again restores it"
        );
    }

    /// Failed authentication closes a connection where callers
    /// authenticate, deadline or not (mTLS has none): after
    /// `max_auth_failures` failed requests since the last that passed,
    /// whether one ever did or not; failures between calls that pass do
    /// not add up (issue 58 review, finding 4: without a deadline, failures
    /// never closed a connection).
    #[tokio::test]
    async fn failed_authentication_closes_a_connection_without_a_deadline() {
        let conns = Conns::new(
            ConnPolicy {
                callers_authenticate: true,
                ..registry(16).policy.clone()
            },
            Arc::default(),
        );
        assert_eq!(conns.policy.max_auth_failures, 3);
        assert!(conns.policy.auth_deadline.is_none());
        let [never, lapsed, between] = established(&conns);
        never.auth_failed();
        never.auth_failed();
        assert!(!never.is_closing());
        never.auth_failed();
        assert_eq!(never.closing_now(), Closing::Now);
        lapsed.authenticated();
        for _ in 0..3 {
            lapsed.auth_failed();
        }
        assert_eq!(
            lapsed.closing_now(),
            Closing::Now,
            "authenticated once, then its tenant removed"
        );
        for _ in 0..4 {
            between.auth_failed();
            between.auth_failed();
            between.authenticated();
        }
        assert!(!between.is_closing());
        assert_eq!(
            conns.stats.closed_unauthenticated.load(Ordering::Relaxed),
            2
        );
        // Where callers do not authenticate, nothing is closed for it.
        let [plain] = established(&registry(16));
        for _ in 0..5 {
            plain.auth_failed();
        }
        assert!(!plain.is_closing());
    }

    /// With bearer's deadline, a connection that authenticated within it
    /// and failed later is not closed by the deadline (it did authenticate
    /// in time), only by its failures (at once); one that never did is,
    /// gracefully.
    #[tokio::test(start_paused = true)]
    async fn the_deadline_closes_only_connections_that_never_authenticated() {
        let conns = Conns::new(
            ConnPolicy {
                callers_authenticate: true,
                auth_deadline: Some(Duration::from_secs(10)),
                ..registry(16).policy.clone()
            },
            Arc::default(),
        );
        let [silent, lapsed] = established(&conns);
        lapsed.authenticated();
        lapsed.auth_failed();
        tokio::time::sleep(Duration::from_secs(20)).await;
        conns.sweep();
        // Gracefully (GOAWAY): a legitimate client that was slow to send
        // its first call resends it on another connection.
        assert_eq!(silent.closing_now(), Closing::WhenQuiet);
        assert_eq!(
            Cause::from_u8(silent.cause.load(Ordering::SeqCst)),
            Cause::AuthDeadline
        );
        assert!(!lapsed.is_closing());
        lapsed.auth_failed();
        lapsed.auth_failed();
        assert_eq!(lapsed.closing_now(), Closing::Now);
    }

    /// An IPv4-mapped IPv6 address counts as its IPv4 address.
    #[tokio::test]
    async fn an_ipv4_mapped_address_counts_as_its_ipv4() {
        let conns = registry(1);
        let m = conns
            .register(IpAddr::V6("::ffff:127.0.0.1".parse().unwrap()))
            .unwrap();
        m.established();
        let _busy = StreamGuard::enter(Some(m.clone()));
        assert!(conns.register(IP).is_none(), "the same address, busy");
        let other = IpAddr::V6("::ffff:127.0.0.2".parse().unwrap());
        assert!(conns.register(other).is_some());
    }

    /// A connection closed at once ends on a write that would wait, even
    /// with a stream open (the stream held past its age is why it closes).
    #[tokio::test]
    async fn a_hard_close_ends_a_connection_with_a_stream_open() {
        let conns = registry(2);
        let [a, b] = established(&conns);
        let _streams = (
            StreamGuard::enter(Some(a.clone())),
            StreamGuard::enter(Some(b.clone())),
        );
        a.close(HARD, Cause::Idle);
        b.close(SOFT, Cause::Idle);
        assert!(a.ending(), "closed at once, yet its writes may wait");
        assert!(!b.ending(), "a soft close waits for its stream");
    }

    /// An address at its cap whose evicted connections keep a stream open
    /// while they close (their peer ignores the GOAWAY) gets no more once
    /// as many as the cap are so held: each eviction would let one more in
    /// while the evicted one drains, and one address would fill the
    /// listener.
    #[tokio::test(start_paused = true)]
    async fn an_address_whose_closing_connections_stay_busy_gets_no_more() {
        let conns = registry(2);
        let [a, b] = established(&conns);
        let (mut held, mut kept) = (Vec::new(), Vec::new());
        for (victim, label) in [(&a, "a"), (&b, "b")] {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let next = conns.register(IP).expect("an idle one is evicted for it");
            next.established();
            assert!(victim.is_closing(), "{label} not evicted");
            held.push(StreamGuard::enter(Some(victim.clone())));
            kept.push(next);
        }
        assert!(
            conns.register(IP).is_none(),
            "a third connection let in while two evicted ones drain busy"
        );
        drop(held);
        assert!(conns.register(IP).is_some(), "refused once they are idle");
        drop(kept);
    }

    /// Where callers authenticate, a connection closing gracefully that
    /// never authenticated and keeps a stream open is cut at once when an
    /// arrival needs room, before any other is evicted.
    #[tokio::test(start_paused = true)]
    async fn a_draining_unauthenticated_busy_connection_is_cut_first() {
        let conns = Conns::new(
            ConnPolicy {
                callers_authenticate: true,
                ..registry(16).policy.clone()
            },
            Arc::default(),
        );
        let [silent, caller] = established(&conns);
        caller.authenticated();
        silent.close(SOFT, Cause::AuthDeadline);
        let _stream = StreamGuard::enter(Some(silent.clone()));
        assert!(conns.evict_idlest());
        assert_eq!(silent.closing_now(), Closing::Now);
        assert!(!caller.is_closing());
    }

    /// Streams that arrive more than [`LATE_AFTER_GOAWAY`] after the
    /// GOAWAY are refused; those that crossed it are taken.
    #[tokio::test(start_paused = true)]
    async fn streams_long_after_the_goaway_are_late() {
        let conns = registry(16);
        let [c] = established(&conns);
        assert!(!c.late_after_goaway());
        c.goaway_sent();
        tokio::time::sleep(LATE_AFTER_GOAWAY / 2).await;
        assert!(!c.late_after_goaway(), "a stream that crossed the GOAWAY");
        tokio::time::sleep(LATE_AFTER_GOAWAY).await;
        assert!(c.late_after_goaway());
    }
}
