//! Time is injected so that expiry and garbage collection are testable
//! without sleeping (rustls's `decrypt_at(…, now)` habit).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of Unix time in whole seconds.
pub trait Clock: Send + Sync + 'static {
    fn now_unix(&self) -> u64;
}

/// The operating system's wall clock, as is (it may step backwards).
#[derive(Debug, Default)]
pub struct WallClock;

impl Clock for WallClock {
    fn now_unix(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }
}

/// A clock behind a high-water mark: if the inner clock steps backwards,
/// `now_unix` keeps answering the latest time it has seen. So within one
/// process an expired token never becomes valid again, and garbage
/// collection never runs "earlier" and drops a live ledger record.
#[derive(Debug, Default)]
pub struct HighWater<C> {
    inner: C,
    high_water: AtomicU64,
}

impl<C: Clock> HighWater<C> {
    pub fn wrap(inner: C) -> Self {
        HighWater {
            inner,
            high_water: AtomicU64::new(0),
        }
    }
    pub fn inner(&self) -> &C {
        &self.inner
    }
}

impl<C: Clock> Clock for HighWater<C> {
    fn now_unix(&self) -> u64 {
        let now = self.inner.now_unix();
        let seen = self.high_water.fetch_max(now, Ordering::Relaxed);
        seen.max(now)
    }
}

/// The clock the service runs on: the wall clock behind a high-water mark.
pub type SystemClock = HighWater<WallClock>;

impl SystemClock {
    pub fn new() -> Self {
        HighWater::wrap(WallClock)
    }
}

/// A clock that only moves when told to; for tests and simulations.
#[derive(Debug)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn new(now_unix: u64) -> Self {
        Self(AtomicU64::new(now_unix))
    }
    pub fn set(&self, now_unix: u64) {
        self.0.store(now_unix, Ordering::SeqCst);
    }
    pub fn advance(&self, secs: u64) {
        self.0.fetch_add(secs, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_unix(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl<C: Clock> Clock for std::sync::Arc<C> {
    fn now_unix(&self) -> u64 {
        (**self).now_unix()
    }
}
