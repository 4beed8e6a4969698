//! A private replicated PostgreSQL for tests and the nemesis: three
//! PostgreSQL 15 nodes under Patroni with etcd, started and driven through
//! `tests/patroni/cluster.py` (its README says what each command does).
//! Used by `tests/it/patroni.rs` and `benches/nemesis` (`--store patroni`).
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

pub const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/patroni/cluster.py");

/// Why the topology cannot run here, if it cannot.
pub fn unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("needs root (cgroups, nftables)".into());
    }
    let patroni = std::env::var("STATESEAL_PATRONI").unwrap_or_else(|_| "patroni".into());
    for tool in [patroni.as_str(), "etcd", "nft", "python3"] {
        let found = if tool.contains('/') {
            std::path::Path::new(tool).exists()
        } else {
            Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if !found {
            return Some(format!("{tool} is not installed (.ci/run installs it)"));
        }
    }
    if !std::path::Path::new("/usr/lib/postgresql/15/bin/postgres").exists() {
        return Some("PostgreSQL 15's binaries are not installed".into());
    }
    None
}

/// Patroni's timing: `ttl` (the leader key's life: a dead leader is
/// replaced after it), `loop_wait` and `retry_timeout`, in seconds.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub ttl: u32,
    pub loop_wait: u32,
    pub retry_timeout: u32,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            ttl: 15,
            loop_wait: 3,
            retry_timeout: 5,
        }
    }
}

/// A running topology; torn down on drop.
pub struct Cluster {
    supervisor: Child,
    pub dir: tempfile::TempDir,
    pub info: Value,
}

impl Cluster {
    /// Starts it (synchronous replication unless `asynchronous`) and waits
    /// until a leader leads and both standbys stream.
    pub fn up(asynchronous: bool, timing: Timing) -> Cluster {
        // Under /tmp: the postgres user must reach it.
        let dir = tempfile::Builder::new()
            .prefix("ss-patroni-")
            .tempdir_in("/tmp")
            .unwrap();
        let mut args = vec![
            SCRIPT.to_owned(),
            "up".into(),
            dir.path().display().to_string(),
            "--ttl".into(),
            timing.ttl.to_string(),
            "--loop-wait".into(),
            timing.loop_wait.to_string(),
            "--retry-timeout".into(),
            timing.retry_timeout.to_string(),
        ];
        if asynchronous {
            args.push("--async".into());
        }
        let mut supervisor = Command::new("python3")
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(supervisor.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let info: Value = serde_json::from_str(&line)
            .unwrap_or_else(|_| panic!("cluster.py up printed {line:?}"));
        assert!(info.get("error").is_none(), "cluster.py up: {info}");
        Cluster {
            supervisor,
            dir,
            info,
        }
    }

    /// The multi-host URL (`host=a,b,c`, `target_session_attrs=read-write`).
    pub fn url(&self) -> String {
        self.info["url"].as_str().unwrap().to_owned()
    }

    /// One subcommand on this cluster; its JSON answer, or what went wrong.
    pub fn try_run(&self, what: &[&str]) -> Result<Value, String> {
        let dir = self.dir.path().display().to_string();
        let mut args = vec![SCRIPT, what[0], dir.as_str()];
        args.extend_from_slice(&what[1..]);
        let out = Command::new("python3")
            .args(&args)
            .output()
            .map_err(|e| format!("python3: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let v: Value = serde_json::from_str(text.lines().last().unwrap_or("")).map_err(|_| {
            format!(
                "cluster.py {what:?}: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        if !out.status.success() || v.get("error").is_some() {
            return Err(format!("cluster.py {what:?}: {v}"));
        }
        Ok(v)
    }

    /// [`Self::try_run`], panicking on failure.
    pub fn run(&self, what: &[&str]) -> Value {
        self.try_run(what).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The node that leads now, if one does.
    pub fn leader(&self) -> Option<String> {
        self.try_run(&["status"])
            .ok()
            .and_then(|s| s["leader"].as_str().map(String::from))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let dir = self.dir.path().display().to_string();
        let _ = Command::new("python3")
            .args([SCRIPT, "down", dir.as_str(), "--purge"])
            .output();
        let _ = self.supervisor.kill();
        let _ = self.supervisor.wait();
    }
}
