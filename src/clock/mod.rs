//! Time is injected so that expiry and garbage collection are testable
//! without sleeping (rustls's `decrypt_at(…, now)` habit).

pub mod guard;

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

/// The clock the service runs on: the wall clock as is. A step is not
/// hidden here (a high-water mark would latch a forward step and seal tokens
/// that outlive --max-ttl by the step's size); it is caught by the clock
/// guard ([`guard`]), which stops the replica from sealing, opening and
/// collecting while the wall clock disagrees with the reference, and by the
/// ledgers' horizon, which never lets a collected record be consumed afresh.
pub type SystemClock = WallClock;

impl WallClock {
    pub fn new() -> Self {
        WallClock
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
