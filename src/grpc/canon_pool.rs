//! Canonicalization of `params_json` off the async workers: small inputs
//! run inline; larger ones on the blocking pool, at most
//! `max_canonicalizations` at once with a bounded queue; over the queue,
//! `RESOURCE_EXHAUSTED` at once ([`CanonPool`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::net::limits::LimitStats;

/// Runs canonicalizations of `params_json` off the async workers, bounded.
#[derive(Debug)]
pub struct CanonPool {
    running: Arc<Semaphore>,
    admitted: AtomicUsize,
    max_admitted: usize,
    stats: Arc<LimitStats>,
}

/// Inputs up to this size are canonicalized inline: a few microseconds,
/// cheaper than a hand-off to the blocking pool.
pub const INLINE_CANON_BYTES: usize = 4 * 1024;

/// The pool is full: answer `RESOURCE_EXHAUSTED` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

impl CanonPool {
    /// At most `running` at once and `queue` waiting; refusals counted
    /// into `stats`.
    pub fn new(running: usize, queue: usize, stats: Arc<LimitStats>) -> Self {
        let running = running.max(1);
        CanonPool {
            running: Arc::new(Semaphore::new(running)),
            admitted: AtomicUsize::new(0),
            max_admitted: running + queue,
            stats,
        }
    }

    /// Runs `f` over `input`: inline when small, else on the blocking pool
    /// under the bounds. `Err(Busy)` when running and queued are full.
    pub async fn run<T, F>(&self, input: String, f: F) -> Result<T, Busy>
    where
        T: Send + 'static,
        F: FnOnce(&str) -> T + Send + 'static,
    {
        if input.len() <= INLINE_CANON_BYTES {
            return Ok(f(&input));
        }
        if self.admitted.fetch_add(1, Ordering::AcqRel) >= self.max_admitted {
            self.admitted.fetch_sub(1, Ordering::AcqRel);
            self.stats.canon_refused.fetch_add(1, Ordering::Relaxed);
            return Err(Busy);
        }
        struct Admitted<'a>(&'a AtomicUsize);
        impl Drop for Admitted<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let _admitted = Admitted(&self.admitted);
        let permit = self
            .running
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Busy)?;
        tokio::task::spawn_blocking(move || {
            let r = f(&input);
            drop(permit);
            r
        })
        .await
        .map_err(|_| Busy)
    }
}
