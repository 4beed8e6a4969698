//! Hot reload of mounted files (the keyset; certificates and tenants where
//! configured).
//!
//! The file is re-read on an interval and applied when its content changes.
//! Polling the path, rather than watching inodes, is what follows the way
//! Kubernetes updates a mounted Secret: it writes a new timestamped directory
//! and atomically swaps the `..data` symlink, so the file's path stays the
//! same while everything behind it is replaced. A file that fails to parse or
//! validate is rejected with a log line and a counter; what is in force stays.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use crate::domain::keyring::{Kek, Keyring, KeyringHandle, KeysetError, KeysetFile};
use crate::ops::audit::{key_changes, Audit, KeyEvent};

/// Reload outcomes, for metrics and tests.
#[derive(Debug, Default)]
pub struct ReloadStats {
    pub reloads: AtomicU64,
    pub failures: AtomicU64,
}

/// A file's content, zeroized on drop (it may hold key material).
pub type FileBytes = Zeroizing<Vec<u8>>;

/// Reads `paths` once: their contents (zeroized on drop) and the digest of
/// all of them together (each length-prefixed). Whoever loads a version
/// from these bytes holds exactly the version this digest names.
pub fn read_files(paths: &[PathBuf]) -> std::io::Result<(Vec<FileBytes>, [u8; 32])> {
    let mut h = Sha256::new();
    let mut contents = Vec::with_capacity(paths.len());
    for p in paths {
        let bytes = Zeroizing::new(std::fs::read(p)?);
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(&bytes[..]);
        contents.push(bytes);
    }
    Ok((contents, h.finalize().into()))
}

/// Why an applier refused a new version of its file: the loader's own
/// error, kept with its type (a keyset, TLS or tenants error).
pub type ApplyError = Box<dyn std::error::Error + Send + Sync>;

/// The loader panicked on a new version (a parser bug); the watcher goes on.
#[derive(Debug, thiserror::Error)]
#[error("the loader failed unexpectedly")]
pub struct LoaderPanicked;

/// Polls `paths` every `every`; when their content differs from the last
/// seen (`initial` is the digest of what is in force, see [`read_files`]),
/// calls `apply` with the bytes of the first path (appliers of several files
/// re-read them all). `what` names the files in logs.
pub async fn watch_file<F>(
    what: &'static str,
    paths: Vec<PathBuf>,
    initial: [u8; 32],
    every: Duration,
    stats: Arc<ReloadStats>,
    apply: F,
) where
    F: Fn(&[u8]) -> Result<(), ApplyError> + Send + Sync + 'static,
{
    let apply = Arc::new(apply);
    let path = paths.first().cloned().unwrap_or_default();
    let mut seen = initial;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let (contents, digest) = match read_files(&paths) {
            Ok(r) => r,
            Err(e) => {
                // A missing file mid-swap is not a new version: keep polling.
                tracing::debug!(file = what, error = %e, "cannot read; keeping the version in force");
                continue;
            }
        };
        if digest == seen {
            continue;
        }
        seen = digest;
        // A panic while loading (a parser bug) must not end the watcher:
        // every later version — a revocation among them — would be ignored.
        // Loading may block (a PKCS#11 token unwrapping keys): off the
        // runtime's workers.
        let apply = apply.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            let bytes = contents.first().map(|b| &b[..]).unwrap_or_default();
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| apply(bytes)))
                .unwrap_or_else(|_| Err(LoaderPanicked.into()))
        })
        .await
        .unwrap_or_else(|_| Err(LoaderPanicked.into()));
        match outcome {
            Ok(()) => {
                stats.reloads.fetch_add(1, Ordering::Relaxed);
                tracing::info!(file = what, path = %path.display(), "reloaded");
            }
            Err(e) => {
                stats.failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(file = what, path = %path.display(), error = %e, "rejected a new version; the previous one stays in force");
            }
        }
    }
}

/// The keyset's `apply`: parse, validate, unwrap (with the KEK of a wrapped
/// keyset), swap; the audit log records what the new version changed, or
/// that it was refused.
pub fn keyset_applier(
    handle: Arc<KeyringHandle>,
    kek: Option<Arc<dyn Kek>>,
    audit: Option<Arc<Audit>>,
) -> impl Fn(&[u8]) -> Result<(), ApplyError> {
    move |bytes| {
        let note = |e: KeyEvent| {
            if let Some(a) = &audit {
                a.key_event(e);
            }
        };
        let before = handle.current();
        let ring = KeysetFile::parse(bytes)
            .and_then(|file| Keyring::from_file_with(&file, kek.as_deref()))
            .and_then(|ring| match before.refuses_successor(&ring) {
                Some(why) => Err(KeysetError::Refused(why)),
                None => Ok(ring),
            });
        let ring = match ring {
            Ok(ring) => ring,
            Err(e) => {
                // Keyset errors never hold key bytes.
                note(KeyEvent::ReloadRefused(e.to_string()));
                return Err(e.into());
            }
        };
        tracing::info!(keys = ?ring.summary(), "keyset in force");
        key_changes(&before, &ring).into_iter().for_each(note);
        handle.replace(ring);
        note(KeyEvent::ReloadApplied);
        Ok(())
    }
}
