//! Time is injected so that expiry and garbage collection are testable
//! without sleeping (rustls's `decrypt_at(…, now)` habit).

pub mod guard;

use std::sync::atomic::{AtomicU64, Ordering};

use std::time::{Instant, SystemTime, UNIX_EPOCH};

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

/// Unix time that no wall-clock step moves: the wall clock read once, when
/// the clock is made, plus the monotonic time elapsed since. It runs at the
/// rate NTP gives the monotonic clock and is never stepped. The sled
/// ledger judges its leases by it, so a step of the wall clock while the
/// process runs neither ends a lease early nor lengthens one.
#[derive(Debug)]
pub struct MonotonicClock {
    anchor_unix_ms: u64,
    anchor: Instant,
}

impl MonotonicClock {
    pub fn new() -> Self {
        let anchor_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        MonotonicClock {
            anchor_unix_ms,
            anchor: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_unix(&self) -> u64 {
        let elapsed = u64::try_from(self.anchor.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.anchor_unix_ms.saturating_add(elapsed) / 1000
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

#[cfg(test)]
mod tests {
    use super::*;

    /// It starts at the wall clock's time and moves with real time.
    #[test]
    fn the_monotonic_clock_starts_at_the_wall_clock() {
        let m = MonotonicClock::new();
        let d = |m: &MonotonicClock| m.now_unix().abs_diff(WallClock.now_unix());
        assert!(d(&m) <= 1, "{}", d(&m));
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert!(d(&m) <= 1, "{}", d(&m));
    }
}
