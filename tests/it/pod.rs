//! The binary run the way the Kubernetes pod runs it: as uid/gid 65532 (not
//! root), able to write only its data dir and /tmp, the keyset read from a
//! Secret-style directory (root-owned, mode 0440, group 65532) whose `..data`
//! symlink is swapped mid-run — the new keyset must be picked up.
//!
//! Needs root to drop privileges (setpriv); otherwise it says loudly that it
//! was skipped.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::{chown, symlink, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::process::{command, spawn_as};
use crate::common::*;

const UID: u32 = 65532;

fn publish(dir: &Path, src: &Path, version: u32) {
    let versioned = dir.join(format!("..2026_11_30_{version:02}"));
    std::fs::create_dir(&versioned).unwrap();
    let file = versioned.join("keyset.json");
    std::fs::copy(src, &file).unwrap();
    chown(&file, Some(0), Some(UID)).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o440)).unwrap();
    let tmp = dir.join("..data_tmp");
    symlink(versioned.file_name().unwrap(), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    if std::fs::symlink_metadata(dir.join("keyset.json")).is_err() {
        symlink("..data/keyset.json", dir.join("keyset.json")).unwrap();
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_as_non_root_with_a_swapped_secret_directory() {
    if !is_root() || Command::new("setpriv").arg("--version").output().is_err() {
        crate::common::skip::skipped(
            "pod-like-test",
            &format!("needs root and setpriv to drop to uid {UID}"),
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let master = tmp.path().join("master.json");
    assert!(command()
        .args(["keys", "init"])
        .arg(&master)
        .status()
        .unwrap()
        .success());
    let secret = tmp.path().join("secret");
    std::fs::create_dir(&secret).unwrap();
    publish(&secret, &master, 1);
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    chown(&data, Some(UID), Some(UID)).unwrap();

    let mut cmd = Command::new("setpriv");
    cmd.args([
        "--reuid",
        &UID.to_string(),
        "--regid",
        &UID.to_string(),
        "--clear-groups",
        "--",
    ])
    .arg(env!("CARGO_BIN_EXE_stateseal"));
    let keyset = secret.join("keyset.json");
    let p = spawn_as(
        cmd,
        &data,
        &[
            "--keyset",
            keyset.to_str().unwrap(),
            "--reload-interval-ms",
            "100",
        ],
        &[],
    );
    let mut c = connect(p.addr).await;
    let t1 = c.seal(seal_req(b"x", true)).await.unwrap().into_inner();
    assert_eq!(t1.key_id, "1");

    // It really is not root, and cannot write outside its data dir.
    let status = std::fs::read_to_string(format!("/proc/{}/status", p.child.id())).unwrap();
    let uid_line = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .unwrap()
        .to_string();
    assert!(
        uid_line.split_whitespace().skip(1).all(|u| u == "65532"),
        "{uid_line}"
    );
    assert!(
        std::fs::metadata(data.join("ledger")).is_ok(),
        "the ledger is in the data dir"
    );

    // Rotate through the Secret directory, as kubelet would.
    let out = command()
        .args(["keys", "add"])
        .arg(&master)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(command()
        .args(["keys", "promote"])
        .arg(&master)
        .arg("2")
        // One replica, which loads both at once: nothing to wait for.
        .args(["--rollout", "0"])
        .status()
        .unwrap()
        .success());
    publish(&secret, &master, 2);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let t = c.seal(seal_req(b"y", false)).await.unwrap().into_inner();
        if t.key_id == "2" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "new keyset not picked up: {:?}",
            p.log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A token sealed before the swap still opens (key 1 is now staged).
    assert!(
        c.open(open_req(&t1.request_state))
            .await
            .unwrap()
            .into_inner()
            .consumed
    );
    let (status, log) = p.terminate();
    assert!(status.success(), "{log:?}");
}
