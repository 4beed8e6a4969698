//! Time is injected so that expiry and garbage collection are testable
//! without sleeping (rustls's `decrypt_at(…, now)` habit).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of Unix time in whole seconds.
pub trait Clock: Send + Sync + 'static {
    fn now_unix(&self) -> u64;
}

/// The system clock behind a high-water mark: if the wall clock steps
/// backwards, `now_unix` keeps answering the latest time it has seen, so an
/// expired token never becomes valid again within one process.
#[derive(Debug, Default)]
pub struct SystemClock {
    high_water: AtomicU64,
}

impl SystemClock {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Clock for SystemClock {
    fn now_unix(&self) -> u64 {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let seen = self.high_water.fetch_max(wall, Ordering::Relaxed);
        seen.max(wall)
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
