//! Real filesystem faults under concurrent consumption, on the sled data
//! directory:
//!
//! - a small tmpfs filled to the last byte;
//! - an ext4 filesystem (on a loop device, mounted `errors=remount-ro`)
//!   that the kernel turns read-only while sled holds its files open —
//!   how a disk error takes a filesystem away in production. The error is
//!   raised through ext4's own `trigger_fs_error` switch in sysfs.
//!   (`mount -o remount,ro` is refused by the kernel while a file is open
//!   for writing — "mount point is busy" — so that is not the way in.)
//!
//! Nothing is accepted without a durable record; the process fails stop
//! (exits non-zero, for the orchestrator to restart it); after space (or
//! rw) returns, a restart recovers and every acknowledged consumption is
//! still REPLAYED. Needs root (mount, loop devices, mkfs.ext4 and e2fsck);
//! without them a test prints a loud SKIPPED and says why.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::process::spawn;
use crate::common::*;

/// Runs a system command; its stderr (or why it could not run) on failure.
/// `ok` says which exit codes count as success.
pub(crate) fn run(cmd: &str, args: &[&str], ok: &[i32]) -> Result<String, String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {cmd}: {e}"))?;
    match out.status.code() {
        Some(c) if ok.contains(&c) => Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned()),
        _ => Err(format!(
            "{cmd} {args:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A mount point that is lazily unmounted when dropped.
pub(crate) struct Mounted(PathBuf);

impl Mounted {
    /// Unmounts now, not lazily; on failure the drop unmounts lazily.
    fn unmount(self) -> Result<PathBuf, String> {
        run("umount", &[path_str(&self.0)], &[0])?;
        let this = std::mem::ManuallyDrop::new(self);
        Ok(this.0.clone())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

pub(crate) fn mount_tmpfs(dir: &Path, size: &str) -> Result<Mounted, String> {
    let opts = format!("size={size}");
    run(
        "mount",
        &["-t", "tmpfs", "-o", &opts, "tmpfs", path_str(dir)],
        &[0],
    )?;
    Ok(Mounted(dir.to_owned()))
}

/// An ext4 filesystem in an image file, mounted through a loop device with
/// `errors=remount-ro`.
struct Ext4 {
    image: PathBuf,
    mounted: Option<Mounted>,
    /// The filesystem's name under /sys/fs/ext4 (the loop device's name).
    device: String,
}

impl Ext4 {
    fn create(image: &Path, dir: &Path) -> Result<Self, String> {
        std::fs::File::create(image)
            .and_then(|f| f.set_len(64 << 20))
            .map_err(|e| format!("cannot create the image: {e}"))?;
        run("mkfs.ext4", &["-q", "-F", path_str(image)], &[0])?;
        let mut fs = Ext4 {
            image: image.to_owned(),
            mounted: None,
            device: String::new(),
        };
        fs.mount(dir)?;
        Ok(fs)
    }

    fn mount(&mut self, dir: &Path) -> Result<(), String> {
        run(
            "mount",
            &[
                "-o",
                "loop,errors=remount-ro",
                path_str(&self.image),
                path_str(dir),
            ],
            &[0],
        )?;
        self.mounted = Some(Mounted(dir.to_owned()));
        let source = run("findmnt", &["-n", "-o", "SOURCE", path_str(dir)], &[0])?;
        self.device = source.trim_start_matches("/dev/").to_owned();
        if !self.switch().exists() {
            return Err(format!("{} does not exist", self.switch().display()));
        }
        Ok(())
    }

    fn switch(&self) -> PathBuf {
        Path::new("/sys/fs/ext4")
            .join(&self.device)
            .join("trigger_fs_error")
    }

    /// Raises a filesystem error: with `errors=remount-ro` the kernel
    /// aborts the journal and makes the filesystem read-only at once.
    fn fail(&self) {
        std::fs::write(self.switch(), "stateseal disk test").unwrap();
    }

    fn options(&self) -> String {
        let dir = &self.mounted.as_ref().unwrap().0;
        run("findmnt", &["-n", "-o", "OPTIONS", path_str(dir)], &[0]).unwrap()
    }

    /// Unmounts, repairs with e2fsck (exit 1: errors corrected) and mounts
    /// read-write again: what an operator does after such an error.
    fn repair_and_remount(&mut self) {
        let dir = self.mounted.take().unwrap().unmount().unwrap();
        run("e2fsck", &["-f", "-y", path_str(&self.image)], &[0, 1]).unwrap();
        self.mount(&dir).unwrap();
    }
}

/// Fills the filesystem of `dir` to the last byte; returns the filler path.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write;
    let p = dir.join("filler");
    let mut f = std::fs::File::create(&p).unwrap();
    let chunk = vec![0u8; 4096];
    loop {
        if f.write_all(&chunk).is_err() {
            break;
        }
    }
    let _ = f.sync_all();
    p
}

/// What 8 concurrent consumers saw before the server failed stop.
struct Run {
    acked: Vec<String>,
    before_fault: usize,
    refused: Vec<String>,
}

/// Starts a server on `data`, consumes single-use tokens with 8 callers,
/// calls `fault` after half a second, and waits for the server to exit
/// non-zero. Every refusal must be `LEDGER_UNAVAILABLE` (or a cut
/// connection); every acknowledgement is kept for [`restart_and_recheck`].
async fn consume_until_fail_stop(data: &Path, fault: impl FnOnce()) -> Run {
    let s = spawn(data, &[], &[]);
    let client = connect(s.addr).await;
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let (mut c, acked, failures, stop) = (
                client.clone(),
                acked.clone(),
                failures.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(t) = c.seal(seal_req(b"d", true)).await else {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    };
                    let t = t.into_inner().request_state;
                    match c.open(open_req(&t)).await {
                        Ok(o) => {
                            assert!(o.into_inner().consumed);
                            acked.lock().unwrap().push(t);
                        }
                        Err(e) => failures.lock().unwrap().push(reason(&e)),
                    }
                }
            })
        })
        .collect();
    // Half a second of consumption (longer on a slow machine: at least 20).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let warmup = Instant::now() + Duration::from_secs(10);
    while acked.lock().unwrap().len() < 20 && Instant::now() < warmup {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before_fault = acked.lock().unwrap().len();
    assert!(before_fault > 0, "no consumption before the fault");
    fault();
    // The server notices at its next flush: refuses, then exits non-zero.
    let pid = s.child.id();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut s = s;
    let status = loop {
        if let Ok(Some(st)) = s.child.try_wait() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "pid {pid} kept running on a broken disk: {:?}",
            s.log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    assert!(!status.success(), "must exit non-zero for a restart");
    let log = s.log.lock().unwrap().join("\n");
    assert!(log.contains("sled ledger write failed"), "{log}");
    let refused = failures.lock().unwrap().clone();
    assert!(
        refused
            .iter()
            .all(|r| r == "LEDGER_UNAVAILABLE" || r.starts_with("<no reason")),
        "{refused:?}"
    );
    let acked = acked.lock().unwrap().clone();
    Run {
        acked,
        before_fault,
        refused,
    }
}

/// Restarts on `data` once the disk is back: every acknowledged
/// consumption is REPLAYED, and the service consumes again.
async fn restart_and_recheck(data: &Path, fault: &str, run: Run) {
    let s = spawn(data, &[], &[]);
    let mut c = connect(s.addr).await;
    let mut reopened = 0;
    for t in &run.acked {
        match c.open(open_req(t)).await {
            Err(e) if reason(&e) == "REPLAYED" => {}
            other => {
                reopened += 1;
                eprintln!("acknowledged consumption not REPLAYED: {other:?}");
            }
        }
    }
    println!(
        "{fault}: {} consumptions acknowledged ({} before the fault), {} re-checked, {reopened} reopened; {} refused",
        run.acked.len(),
        run.before_fault,
        run.acked.len(),
        run.refused.len()
    );
    assert_eq!(reopened, 0);
    let t = c
        .seal(seal_req(b"d", true))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    assert!(c.open(open_req(&t)).await.unwrap().into_inner().consumed);
    let (st, _) = s.terminate();
    assert!(st.success());
}

/// A 16 MiB tmpfs filled under consumption until the server fails stop;
/// `restarts_while_full` starts attempted before space returns (each must
/// fail); then the restart and the re-check.
async fn full_disk(what: &str, restarts_while_full: usize) {
    let base = tempfile::tempdir().unwrap();
    let fs = match mount_tmpfs(base.path(), "16m") {
        Ok(fs) => fs,
        Err(e) => {
            crate::common::skip::skipped(
                "real-disk-fault-test",
                &format!("cannot mount a tmpfs here ({e})"),
            );
            return;
        }
    };
    let data = base.path().join("data");
    let mut filler = None;
    let run = consume_until_fail_stop(&data, || filler = Some(fill(base.path()))).await;
    for _ in 0..restarts_while_full {
        let out = crate::common::process::command()
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .env_remove("STATESEAL_LOG")
            .output()
            .unwrap();
        assert!(!out.status.success(), "started on a full disk");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("ledger unavailable"), "{err}");
    }
    // Space returns; the process is restarted.
    std::fs::remove_file(filler.unwrap()).unwrap();
    restart_and_recheck(&data, what, run).await;
    drop(fs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_disk_fails_stop_and_loses_nothing() {
    full_disk("full disk", 0).await;
}

/// An orchestrator restarts the process at once, while the disk is still
/// full: those starts fail, and once space returns the next one recovers
/// everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restart_on_a_still_full_disk_fails_and_damages_nothing() {
    full_disk("full disk, restarted while full", 3).await;
}

/// The loss this guards against (an `fdatasync` that returns 0 while the
/// kernel aborts the journal, the write then lost) needs a round to race the
/// error, so the fault is raised several times, each on a fresh filesystem.
/// Without the ledger's probe after `fdatasync`, about one trial in eight
/// lost the acknowledgements of that round.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_filesystem_gone_read_only_fails_stop_and_loses_nothing() {
    const TRIALS: usize = 8;
    for trial in 1..=TRIALS {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("mnt");
        std::fs::create_dir(&dir).unwrap();
        let mut fs = match Ext4::create(&base.path().join("ext4.img"), &dir) {
            Ok(fs) => fs,
            Err(e) => {
                crate::common::skip::skipped(
                    "read-only-filesystem-test",
                    &format!("cannot mount ext4 on a loop device here ({e})"),
                );
                return;
            }
        };
        let data = dir.join("data");
        let run = consume_until_fail_stop(&data, || fs.fail()).await;
        // Older kernels list the option `ro`, newer ones `emergency_ro`;
        // either way nothing can be written.
        let options = fs.options();
        let write = std::fs::write(dir.join("probe"), b"x");
        assert_eq!(
            write.as_ref().map_err(|e| e.raw_os_error()),
            Err(Some(30)),
            "the filesystem did not go read-only (EROFS): {write:?}, options {options}"
        );
        // rw returns: the operator repairs and remounts; the process restarts.
        fs.repair_and_remount();
        let what = format!("filesystem gone read-only, trial {trial} of {TRIALS}");
        restart_and_recheck(&data, &what, run).await;
    }
}

/// Readiness reflects a writer that died on a real fault: the sled ledger
/// itself on the ext4 filesystem the kernel turns read-only. (The server maps
/// `ready() == false` to `NOT_SERVING`, `tests/failure.rs`; the process
/// exits within 200 ms of `failed_for_good`, too soon to probe from outside.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sled_writer_dead_on_a_read_only_filesystem_is_not_ready() {
    use rand::RngCore;
    use stateseal::internals::ledger::sled::SledLedger;
    use stateseal::internals::ledger::{Consumed, Ledger, LedgerError, LedgerKey, TenantTag};
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("mnt");
    std::fs::create_dir(&dir).unwrap();
    let fs = match Ext4::create(&base.path().join("ext4.img"), &dir) {
        Ok(fs) => fs,
        Err(e) => {
            crate::common::skip::skipped(
                "read-only-filesystem-test",
                &format!("cannot mount ext4 on a loop device here ({e})"),
            );
            return;
        }
    };
    let key = || {
        let mut id = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut id);
        LedgerKey {
            expires_at: 4_000_000_000,
            id,
            tenant: TenantTag::default(),
        }
    };
    let ledger = SledLedger::open(&dir.join("ledger")).unwrap();
    let consumed = key();
    assert_eq!(ledger.consume(&consumed).await.unwrap(), Consumed::Now);
    assert!(ledger.ready().await);
    fs.fail();
    let err = ledger.consume(&key()).await.unwrap_err();
    println!("consumption on the read-only filesystem: {err:?}");
    assert!(!ledger.ready().await, "a dead writer must not report ready");
    assert!(ledger.failed_for_good());
    // Never again from this open store, not even an answer it could give
    // from memory: each refused as the writer's fail-stop.
    for k in [consumed, key()] {
        match ledger.consume(&k).await {
            Err(LedgerError::FailedForGood) => {}
            other => panic!("after the fail-stop: {other:?}"),
        }
    }
    // Nor does close() touch the store (no flush, no fdatasync after the
    // failed one): refused the same way, so the server exits non-zero.
    match ledger.close().await {
        Err(LedgerError::FailedForGood) => {}
        other => panic!("close after the fail-stop: {other:?}"),
    }
    assert!(!ledger.ready().await);
}

/// A snapshot write that hits a full disk leaves sled 0.34 an unfinished,
/// empty `snap.<LSN>.generating`, which its next open takes for the latest
/// snapshot and refuses ("Read corrupted data"): the replica could never be
/// restarted. Found by the nemesis (a restart while the disk was still
/// full); here the file sled leaves is planted directly. The ledger drops it
/// at open (it holds nothing the log does not) and every consumption is
/// still there.
#[tokio::test]
async fn an_unfinished_sled_snapshot_does_not_stop_a_restart() {
    use stateseal::internals::ledger::sled::SledLedger;
    use stateseal::internals::ledger::{Consumed, Ledger, LedgerKey, TenantTag};
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("ledger");
    let keys: Vec<LedgerKey> = (0..50u8)
        .map(|i| LedgerKey {
            expires_at: 4_000_000_000,
            id: [i; 32],
            tenant: TenantTag::default(),
        })
        .collect();
    {
        let ledger = SledLedger::open(&dir).unwrap();
        for k in &keys {
            assert_eq!(ledger.consume(k).await.unwrap(), Consumed::Now);
        }
    }
    let unfinished = dir.join("snap.7FFFFFFFFFFFFFFF.generating");
    std::fs::write(&unfinished, b"").unwrap();
    // Fails at once (not a busy lock) if the unfinished snapshot stops it.
    let ledger = crate::common::open_sled_again(&dir);
    for k in &keys {
        assert_eq!(ledger.consume(k).await.unwrap(), Consumed::Before);
    }
    assert!(!unfinished.exists());
}

/// A frozen filesystem (`fsfreeze`), thawed when dropped: writes to it
/// block until then.
struct Frozen<'a>(&'a Path);

impl Frozen<'_> {
    fn freeze(dir: &Path) -> Frozen<'_> {
        run("fsfreeze", &["-f", path_str(dir)], &[0]).unwrap();
        Frozen(dir)
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        let _ = run("fsfreeze", &["-u", path_str(self.0)], &[0]);
    }
}

/// Review of the audit log's group commit, A: the request's task that
/// writes an audit line to a file system that hangs (frozen) is held in
/// `write(2)` with its worker thread. On one CPU (`taskset -c 0`) the
/// server still runs a second worker: the other calls are refused
/// `AUDIT_UNAVAILABLE` and readiness goes NOT_SERVING; once the file
/// system thaws, the held call is answered (its line written) and SIGTERM
/// stops the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_audit_file_system_holds_one_call_not_the_server() {
    let base = tempfile::tempdir().unwrap();
    let mnt = base.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let _fs = match Ext4::create(&base.path().join("image"), &mnt) {
        Ok(fs) => fs,
        Err(e) => {
            crate::common::skip::skipped(
                "audit-frozen-fs-test",
                &format!("cannot mount an ext4 image here ({e})"),
            );
            return;
        }
    };
    let log = mnt.join("audit.log");
    let mut one_cpu = Command::new("taskset");
    one_cpu
        .args(["-c", "0"])
        .arg(env!("CARGO_BIN_EXE_stateseal"));
    let s = crate::common::process::spawn_as(
        one_cpu,
        &base.path().join("data"),
        &[
            "--audit-log",
            log.to_str().unwrap(),
            "--health-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let health = crate::common::process::health_addr(&s);
    let mut c = connect(s.addr).await;
    c.seal(seal_req(b"x", false)).await.unwrap();
    let mut held_c = connect(s.addr).await;
    let frozen = Frozen::freeze(&mnt);
    let held = tokio::spawn(async move { held_c.seal(seal_req(b"x", false)).await });
    // Readiness: NOT_SERVING once the write has hung 2 s.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = tokio::time::timeout(
            Duration::from_secs(5),
            health_status(health, "stateseal.v1.RequestState"),
        )
        .await
        .expect("the health check was not answered while a write hangs");
        if status == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "never NOT_SERVING");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let refused = tokio::time::timeout(Duration::from_secs(20), c.seal(seal_req(b"x", false)))
        .await
        .expect("no answer while a write hangs")
        .unwrap_err();
    assert_eq!(reason(&refused), "AUDIT_UNAVAILABLE");
    assert!(
        !held.is_finished(),
        "the held call was answered while frozen"
    );
    drop(frozen);
    let answered = tokio::time::timeout(Duration::from_secs(30), held)
        .await
        .expect("the held call was not answered after the thaw")
        .unwrap();
    assert!(answered.is_ok(), "{answered:?}");
    let (status, out) = s.terminate();
    assert!(status.success(), "{out:?}");
}
