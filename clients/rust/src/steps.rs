//! Where the boundary's time goes, for benchmarks
//! ([`crate::Builder::steps`]): the total time and the count of each step,
//! recorded only when a [`Steps`] is given.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A step of the boundary's work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The boundary on the response path, in all, minus the handler.
    Boundary,
    /// Binding v2 (the params digest) and the subject.
    Binding,
    /// The manifest: the questions' JSON when sealing, the answers' JSON
    /// sent and the filtered answers parsed back.
    Manifest,
    /// Each RPC as the boundary awaits it.
    RpcSeal,
    RpcOpen,
    /// Off the response path: a Commit sent on its own.
    RpcCommit,
    RpcRenew,
    RpcRelease,
    /// Commits carried by an Open (a count; no time of their own).
    CommitCarried,
}

/// Total time and count per [`Step`].
#[derive(Debug, Default)]
pub struct Steps {
    nanos: [AtomicU64; 9],
    counts: [AtomicU64; 9],
}

impl Steps {
    pub(crate) fn add(&self, step: Step, d: Duration) {
        let i = step as usize;
        self.nanos[i].fetch_add(
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.counts[i].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add_count(&self, step: Step, n: u64) {
        self.counts[step as usize].fetch_add(n, Ordering::Relaxed);
    }

    /// The time spent in `step` since the last reset.
    pub fn total(&self, step: Step) -> Duration {
        Duration::from_nanos(self.nanos[step as usize].load(Ordering::Relaxed))
    }

    /// How many times `step` ran since the last reset.
    pub fn count(&self, step: Step) -> u64 {
        self.counts[step as usize].load(Ordering::Relaxed)
    }

    pub fn reset(&self) {
        for a in self.nanos.iter().chain(self.counts.iter()) {
            a.store(0, Ordering::Relaxed);
        }
    }
}

/// A duration in nanoseconds, saturating.
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
