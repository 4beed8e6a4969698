//! Key rotation across two stateseal processes under continuous load: A
//! reads a plain keyset file replaced by rename, B reads one from a
//! Kubernetes-style Secret directory whose `..data` symlink is swapped. A full
//! rotation (add staged, promote on A then B, retire after the token
//! lifetime) must cause zero failed opens.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::process::{command, spawn, ServerProcess};
use crate::common::*;
use stateseal::proto::request_state_client::RequestStateClient;
use tonic::transport::Channel;

const TTL: &str = "3";
const SKEW: &str = "1";

fn keys(args: &[&str], file: &Path) -> String {
    let out = command()
        .arg("keys")
        .arg(args[0])
        .arg(file)
        .args(&args[1..])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "keys {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Replaces `dst` with `src`'s content by an atomic rename.
fn publish_plain(src: &Path, dst: &Path) {
    let tmp = dst.with_extension("tmp");
    std::fs::copy(src, &tmp).unwrap();
    std::fs::rename(&tmp, dst).unwrap();
}

/// Publishes `src` into a Secret-style directory the way kubelet does: a new
/// timestamped directory, then an atomic swap of the `..data` symlink.
fn publish_k8s(src: &Path, dir: &Path, version: u32) {
    let versioned = format!("..2026_11_30_{version:04}");
    std::fs::create_dir_all(dir.join(&versioned)).unwrap();
    std::fs::copy(src, dir.join(&versioned).join("keyset.json")).unwrap();
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&versioned, &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    let link = dir.join("keyset.json");
    if std::fs::symlink_metadata(&link).is_err() {
        std::os::unix::fs::symlink("..data/keyset.json", &link).unwrap();
    }
    if version > 1 {
        let old = dir.join(format!("..2026_11_30_{:04}", version - 1));
        std::fs::remove_dir_all(old).unwrap();
    }
}

fn reloads(p: &ServerProcess) -> usize {
    p.log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("reloaded"))
        .count()
}

fn wait_reload(p: &ServerProcess, before: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads(p) <= before {
        assert!(
            Instant::now() < deadline,
            "no reload: {:?}",
            p.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[derive(Default)]
struct Load {
    ok: AtomicU64,
    failures: Mutex<Vec<String>>,
    /// Reusable tokens with their expiry and the replica that sealed them.
    tokens: Mutex<Vec<(String, i64, usize)>>,
}

async fn drive(clients: [RequestStateClient<Channel>; 2], load: Arc<Load>, stop: Arc<AtomicBool>) {
    let mut c = clients;
    let started = Instant::now();
    while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(60) {
        for (s, o) in [(0usize, 1usize), (1, 0)] {
            for single_use in [false, true] {
                let sealed = match c[s].seal(seal_req(b"rotating", single_use)).await {
                    Ok(r) => r.into_inner(),
                    Err(e) => {
                        load.failures
                            .lock()
                            .unwrap()
                            .push(format!("seal on {s}: {}", reason(&e)));
                        continue;
                    }
                };
                match c[o].open(open_req(&sealed.request_state)).await {
                    Ok(_) => {
                        load.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => load.failures.lock().unwrap().push(format!(
                        "open on {o} of key {} sealed on {s}: {}",
                        sealed.key_id,
                        reason(&e)
                    )),
                }
                if !single_use {
                    load.tokens.lock().unwrap().push((
                        sealed.request_state,
                        sealed.expires_at_unix,
                        s,
                    ));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Re-opens every stored reusable token that is still comfortably within its
/// lifetime, on both replicas.
async fn reopen_live(clients: &mut [RequestStateClient<Channel>; 2], load: &Load) -> usize {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let live: Vec<_> = load
        .tokens
        .lock()
        .unwrap()
        .iter()
        .filter(|t| t.1 > now + 1)
        .cloned()
        .collect();
    for (t, _, _) in &live {
        for c in clients.iter_mut() {
            if let Err(e) = c.open(open_req(t)).await {
                load.failures
                    .lock()
                    .unwrap()
                    .push(format!("re-open of a live token: {}", reason(&e)));
            }
        }
    }
    live.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_rotation_under_load_fails_no_open() {
    let tmp = tempfile::tempdir().unwrap();
    let master = tmp.path().join("master.json");
    keys(&["init"], &master);
    let a_file = tmp.path().join("a-keyset.json");
    publish_plain(&master, &a_file);
    let b_dir = tmp.path().join("b-secret");
    publish_k8s(&master, &b_dir, 1);
    let mut v = 1;

    let flags = |ks: &Path| {
        vec![
            "--keyset".to_string(),
            ks.display().to_string(),
            "--reload-interval-ms".into(),
            "100".into(),
            "--max-ttl".into(),
            TTL.into(),
            "--default-ttl".into(),
            TTL.into(),
            "--clock-skew".into(),
            SKEW.into(),
        ]
    };
    let a_flags = flags(&a_file);
    let b_flags = flags(&b_dir.join("keyset.json"));
    let a = spawn(
        &tmp.path().join("a-data"),
        &a_flags.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
    );
    let b = spawn(
        &tmp.path().join("b-data"),
        &b_flags.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
    );
    let mut clients = [connect(a.addr).await, connect(b.addr).await];

    let load = Arc::new(Load::default());
    let stop = Arc::new(AtomicBool::new(false));
    let driver = tokio::spawn(drive(clients.clone(), load.clone(), stop.clone()));
    let pause = || tokio::time::sleep(Duration::from_millis(400));
    pause().await;

    // 1. Stage key 2 everywhere.
    assert!(keys(&["add"], &master).contains("staged key 2"));
    let (ra, rb) = (reloads(&a), reloads(&b));
    publish_plain(&master, &a_file);
    wait_reload(&a, ra);
    pause().await;
    v += 1;
    publish_k8s(&master, &b_dir, v);
    wait_reload(&b, rb);
    pause().await;

    // 2. Promote key 2: A first, B a moment later. In between, A seals with
    //    key 2 (staged on B) and B with key 1 (staged on A).
    // The test has seen both replicas load key 2: no rollout wait needed.
    keys(&["promote", "2", "--rollout", "0"], &master);
    let (ra, rb) = (reloads(&a), reloads(&b));
    publish_plain(&master, &a_file);
    wait_reload(&a, ra);
    pause().await;
    pause().await;
    v += 1;
    publish_k8s(&master, &b_dir, v);
    wait_reload(&b, rb);
    let rollout_done = Instant::now();
    pause().await;
    let live = reopen_live(&mut clients, &load).await;
    assert!(live > 0);

    // 3. Retiring key 1 is refused until demotion + rollout + max TTL + skew.
    let retire = |force: bool| {
        let mut c = command();
        c.args(["keys", "retire"]).arg(&master).args([
            "1",
            "--max-ttl",
            TTL,
            "--clock-skew",
            SKEW,
            "--rollout",
            "1",
        ]);
        if force {
            c.arg("--force");
        }
        c.output().unwrap()
    };
    let demoted_at = {
        let file =
            stateseal::internals::keyring::KeysetFile::parse(&std::fs::read(&master).unwrap())
                .unwrap();
        let k1 = file.keys.iter().find(|k| k.id == 1).unwrap();
        k1.demoted_at.expect("key 1 was demoted by the promotion")
    };
    let early = retire(false);
    assert!(!early.status.success());
    assert!(String::from_utf8_lossy(&early.stderr).contains("may still carry unexpired tokens"));
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = retire(false);
        if r.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "retire never allowed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The rule, on the clock it is written in (whole Unix seconds; an
    // Instant measured from a rounded start is not): demotion + rollout (1)
    // + max TTL + clock skew.
    let retired_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (ttl, skew): (u64, u64) = (TTL.parse().unwrap(), SKEW.parse().unwrap());
    assert!(
        retired_at >= demoted_at + 1 + ttl + skew,
        "retired before the token lifetime passed: {retired_at} < {demoted_at} + 1 + {ttl} + {skew}"
    );
    let _ = rollout_done;
    let key1_tokens: Vec<String> = load
        .tokens
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, _, _)| {
            stateseal::internals::token::UntrustedToken::parse(t, 1 << 16)
                .is_ok_and(|u| u.header().key_id == stateseal::internals::keyring::KeyId(1))
        })
        .map(|(t, _, _)| t.clone())
        .collect();
    assert!(
        !key1_tokens.is_empty(),
        "some tokens were sealed under key 1"
    );
    let (ra, rb) = (reloads(&a), reloads(&b));
    publish_plain(&master, &a_file);
    v += 1;
    publish_k8s(&master, &b_dir, v);
    wait_reload(&a, ra);
    wait_reload(&b, rb);
    pause().await;
    reopen_live(&mut clients, &load).await;

    stop.store(true, Ordering::Relaxed);
    driver.await.unwrap();
    let failures = load.failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(10)]
    );
    let ok = load.ok.load(Ordering::Relaxed);
    assert!(ok > 100, "too little load: {ok}");
    eprintln!("rotation: {ok} successful seal→open pairs across replicas, 0 failures");

    // Key 1 is gone: its tokens (all expired by now) get UNKNOWN_KEY.
    for c in clients.iter_mut() {
        assert_eq!(
            reason(&c.open(open_req(&key1_tokens[0])).await.unwrap_err()),
            "UNKNOWN_KEY"
        );
    }
    let listing = keys(&["list"], &master);
    assert!(listing.contains("retired"), "{listing}");
    let json: serde_json::Value =
        serde_json::from_str(&keys(&["list", "--json"], &master)).unwrap();
    assert_eq!(json["keys"][0]["state"], "retired", "{json}");
    assert_eq!(json["keys"][1]["state"], "primary", "{json}");
    assert!(json["keys"][1]["primary_for_seconds"].is_u64(), "{json}");
    assert!(json["now"].as_str().unwrap().ends_with('Z'));
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&master).unwrap()).unwrap();
    let material = file["keys"][1]["material"].as_str().unwrap();
    assert!(
        !listing.contains(material),
        "keys list printed key material"
    );
    assert!(
        file["keys"][0].get("material").is_none(),
        "retired key material erased"
    );
    a.terminate();
    b.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_keyset_is_rejected_and_the_old_one_stays_in_force() {
    let tmp = tempfile::tempdir().unwrap();
    let ks = tmp.path().join("keyset.json");
    keys(&["init"], &ks);
    let p = spawn(
        &tmp.path().join("data"),
        &[
            "--keyset",
            ks.to_str().unwrap(),
            "--reload-interval-ms",
            "100",
        ],
        &[],
    );
    let mut c = connect(p.addr).await;
    let t = c
        .seal(seal_req(b"x", false))
        .await
        .unwrap()
        .into_inner()
        .request_state;
    for bad in [
        &b"not json"[..],
        br#"{"format":"stateseal-keyset/v1","keys":[]}"#,
    ] {
        let rejected = |p: &ServerProcess| {
            p.log
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.contains("rejected a new version"))
                .count()
        };
        let before = rejected(&p);
        std::fs::write(&ks, bad).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while rejected(&p) == before {
            assert!(Instant::now() < deadline, "bad keyset not noticed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        c.open(open_req(&t)).await.unwrap();
        c.seal(seal_req(b"y", false)).await.unwrap();
    }
    let (_, log) = p.terminate();
    assert_eq!(log.iter().filter(|l| l.contains("reloaded")).count(), 0);
}

/// `keys init` and `keys add` with a bare file name write it in the working
/// directory (the temporary file beside it, then linked or renamed).
#[test]
fn keys_commands_take_a_bare_file_name() {
    let dir = tempfile::tempdir().unwrap();
    for args in [["init"], ["add"]] {
        let out = command()
            .current_dir(dir.path())
            .arg("keys")
            .arg(args[0])
            .arg("keyset.json")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "keys {}: {}",
            args[0],
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let ks =
        stateseal::internals::keyring::KeysetFile::read(&dir.path().join("keyset.json")).unwrap();
    assert_eq!(ks.keys.len(), 2);
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["keyset.json"], "no temporary file left");
}
