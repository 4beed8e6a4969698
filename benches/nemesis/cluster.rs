//! The system under test: the replicas (processes of the real binary, under
//! the clock shim, each in its own network namespace on PostgreSQL), the
//! private PostgreSQL, the proxies, and the operations the nemesis applies
//! to them; and the servers' settings that the schedule and the callers are
//! sized by (`LEASE_S`, `DB_TIMEOUT_MS`, `CLOCK_SKEW_S`). `schedule.rs` and
//! `clients.rs` use this module, never the reverse.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::net::{sh, Chain, Netns};
use super::private_pg::{self, PrivatePg};
use super::proxy::Proxy;
use super::{Config, Store};

/// The lease every reservation asks for, and the servers' maximum.
pub const LEASE_S: u32 = 2;
/// The servers' `--db-timeout-ms`.
pub const DB_TIMEOUT_MS: u64 = 1000;
/// The servers' `--clock-skew`, in seconds.
pub const CLOCK_SKEW_S: u64 = 5;
/// On patroni: the servers' `--clock-skew` (its default), which is also how
/// long past its lease's end a reservation outlives collection. A failover
/// takes longer than [`CLOCK_SKEW_S`]; a Commit kept through it must find
/// its reservation still there (docs/operations.md, "Running on replicated
/// PostgreSQL").
pub const PATRONI_SKEW_S: u64 = 60;
/// On patroni: how long a caller keeps a returned handler's Commit (the
/// packages' default commit window, no longer than [`PATRONI_SKEW_S`]).
pub const COMMIT_WINDOW: Duration = Duration::from_secs(60);
/// Patroni's timing on the nemesis's cluster: a dead leader is replaced
/// after about `ttl`.
const PATRONI_TIMING: super::patroni::Timing = super::patroni::Timing {
    ttl: 10,
    loop_wait: 2,
    retry_timeout: 4,
};
const GRPC_PORT: u16 = 50051;

pub struct Replica {
    pub idx: usize,
    pub ns: Option<Netns>,
    /// Where the callers connect (through the client proxy on PostgreSQL).
    pub client_addr: SocketAddr,
    pub db_proxy: Option<Proxy>,
    pub client_proxy: Option<Proxy>,
    args: Vec<String>,
    shim: PathBuf,
    log: PathBuf,
    offset_file: PathBuf,
    /// The clock's step now, and whether the running process started
    /// during one.
    offset: AtomicI64,
    started_stepped: AtomicBool,
    pub data_dir: PathBuf,
    child: tokio::sync::Mutex<Option<Child>>,
}

pub struct Cluster {
    pub store: Store,
    pub replicas: Vec<Replica>,
    pub pg: Option<std::sync::Mutex<PrivatePg>>,
    /// The sled replica's tmpfs.
    tmpfs: Option<PathBuf>,
    /// The replicated PostgreSQL (patroni).
    pub patroni: Option<super::patroni::Cluster>,
    exits: AtomicUsize,
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_stateseal")
}

impl Cluster {
    pub async fn start(cfg: &Config, dir: &Path) -> Cluster {
        let shim = super::skew::shim(dir).expect("the clock shim needs cc");
        let keyset = super::process::keys_init(dir);
        let ttl = (cfg.duration.as_secs() + 3600).to_string();
        let lease = LEASE_S.to_string();
        let skew = if cfg.store == Store::Patroni {
            PATRONI_SKEW_S
        } else {
            CLOCK_SKEW_S
        };
        let common = |listen: String, data: &Path| -> Vec<String> {
            [
                "serve",
                "--listen",
                &listen,
                "--data-dir",
                data.to_str().unwrap(),
                "--keyset",
                &keyset,
                "--clock-skew",
                &skew.to_string(),
                "--default-lease-s",
                &lease,
                "--max-lease-s",
                &lease,
                "--max-ttl",
                &ttl,
                "--max-ledger-records",
                "5000000",
            ]
            .map(String::from)
            .to_vec()
        };
        // Every replica on PostgreSQL, whichever: its ledger flags.
        let on_postgres = |url: &str| -> Vec<String> {
            [
                "--ledger",
                "postgres",
                "--database-url",
                url,
                "--expected-replicas",
                "3",
                "--db-timeout-ms",
                &DB_TIMEOUT_MS.to_string(),
                "--insecure-plaintext",
            ]
            .map(String::from)
            .to_vec()
        };
        let mut replicas = Vec::new();
        let mut patroni = None;
        let (pg, tmpfs) = match cfg.store {
            Store::Patroni => {
                let cluster = tokio::task::block_in_place(|| {
                    super::patroni::Cluster::up(cfg.asynchronous, PATRONI_TIMING)
                });
                let url = cluster.url();
                for idx in 0..3usize {
                    let port = private_pg::free_port();
                    let data = dir.join(format!("replica{idx}"));
                    let mut args = common(format!("127.0.0.1:{port}"), &data);
                    args.extend(on_postgres(&url));
                    args.extend(["--replication-check-interval-ms".into(), "1000".into()]);
                    if !cfg.asynchronous {
                        args.push("--require-synchronous-replication".into());
                    }
                    replicas.push(Replica::new(
                        idx,
                        None,
                        ([127, 0, 0, 1], port).into(),
                        None,
                        None,
                        args,
                        &shim,
                        dir,
                        data,
                    ));
                }
                patroni = Some(cluster);
                (None, None)
            }
            Store::Postgres => {
                let pg_bin = private_pg::available().unwrap();
                let pg = PrivatePg::start(&pg_bin, None, "max_connections = 200\n");
                let upstream: SocketAddr = ([127, 0, 0, 1], pg.port).into();
                for idx in 0..3u8 {
                    let db_port = private_pg::free_port();
                    let ns = Netns::create(idx, db_port, GRPC_PORT).unwrap();
                    let db_proxy = Proxy::start(
                        (ns.host_ip, db_port).into(),
                        upstream,
                        cfg.seed ^ u64::from(idx),
                    )
                    .await;
                    let client_proxy = Proxy::start(
                        (Ipv4Addr::LOCALHOST, 0).into(),
                        (ns.ns_ip, GRPC_PORT).into(),
                        cfg.seed ^ (u64::from(idx) << 8),
                    )
                    .await;
                    let data = dir.join(format!("replica{idx}"));
                    let mut args = common(format!("{}:{GRPC_PORT}", ns.ns_ip), &data);
                    let url = format!(
                        "postgres://postgres@{}:{db_port}/postgres?sslmode=disable",
                        ns.host_ip
                    );
                    args.extend(on_postgres(&url));
                    replicas.push(Replica::new(
                        idx.into(),
                        Some(ns),
                        client_proxy.addr,
                        Some(db_proxy),
                        Some(client_proxy),
                        args,
                        &shim,
                        dir,
                        data,
                    ));
                }
                (Some(std::sync::Mutex::new(pg)), None)
            }
            Store::Sled => {
                let mnt = dir.join("tmpfs");
                std::fs::create_dir_all(&mnt).unwrap();
                sh(Command::new("mount")
                    .args(["-t", "tmpfs", "-o", "size=512m", "tmpfs"])
                    .arg(&mnt))
                .unwrap();
                let port = private_pg::free_port();
                let data = mnt.join("data");
                let args = common(format!("127.0.0.1:{port}"), &data);
                replicas.push(Replica::new(
                    0,
                    None,
                    ([127, 0, 0, 1], port).into(),
                    None,
                    None,
                    args,
                    &shim,
                    dir,
                    data,
                ));
                (None, Some(mnt))
            }
        };
        let c = Cluster {
            store: cfg.store,
            replicas,
            pg,
            tmpfs,
            patroni,
            exits: AtomicUsize::new(0),
        };
        for r in &c.replicas {
            let mut child = r.child.lock().await;
            *child = Some(r.spawn().await);
        }
        c
    }

    /// Replicas that exited without the nemesis killing them (restarted by
    /// [`Cluster::supervise`]).
    pub fn exits(&self) -> usize {
        self.exits.load(Ordering::Relaxed)
    }

    /// Restarts a replica that exited on its own; the schedule calls it
    /// between faults.
    pub async fn supervise(&self) {
        for r in &self.replicas {
            // A replica a fault holds (paused, being restarted) is its.
            let Ok(mut child) = r.child.try_lock() else {
                continue;
            };
            let exited = match child.as_mut() {
                Some(c) => c.try_wait().ok().flatten(),
                None => None,
            };
            if let Some(status) = exited {
                self.exits.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "nemesis: replica{} exited on its own ({status}); last log lines:\n{}",
                    r.idx,
                    r.log_tail(5)
                );
                *child = Some(r.spawn().await);
            }
        }
    }

    /// Every fault healed by the schedule; here every replica is made sure
    /// to run and to answer.
    pub async fn recover(&self) {
        for r in &self.replicas {
            r.set_clock(0);
            if let Some(p) = &r.db_proxy {
                p.set(0, 0);
            }
            if let Some(p) = &r.client_proxy {
                p.set(0, 0);
            }
            if let Some(ns) = &r.ns {
                for c in [
                    Chain::DbIn,
                    Chain::DbOut,
                    Chain::ClientsIn,
                    Chain::ClientsOut,
                ] {
                    ns.heal(c).unwrap();
                }
            }
        }
        self.supervise().await;
        // A sled replica (re)started during a step anchored its clock guard
        // to the stepped clock: once the clock is corrected it refuses until
        // restarted (docs/operations.md, Clocks: start after time sync), as
        // an operator would.
        if self.store == Store::Sled {
            for r in &self.replicas {
                if r.started_stepped.load(Ordering::Relaxed) {
                    eprintln!(
                        "nemesis: replica{} started during a clock step: restarted on the corrected clock",
                        r.idx
                    );
                    r.kill_restart(Duration::ZERO).await;
                }
            }
        }
    }

    pub async fn shutdown(&self) {
        for r in &self.replicas {
            if let Some(mut c) = r.child.lock().await.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if let Some(mnt) = &self.tmpfs {
            let _ = sh(Command::new("umount").arg(mnt));
        }
    }

    /// One fault of the replicated PostgreSQL (patroni) and its heal: the
    /// fault; for `kill-primary`, `partition-primary` and `switchover` a
    /// wait for another node to lead (two minutes at most), for
    /// `kill-etcd-member` `window`; then `heal --wait` (every node and
    /// member back, both standbys streaming, a synchronous one set).
    /// Returns what happened and whether another node led after it.
    /// Panics when the cluster cannot be healed: the run would be void.
    pub fn replicated_fault(&self, kind: &str, window: Duration) -> (String, bool) {
        let c = self.patroni.as_ref().unwrap();
        let before = c.leader();
        let t = Instant::now();
        let injected = c.try_run(&[kind]);
        let mut led_after = None;
        if injected.is_ok() && kind != "kill-etcd-member" {
            while t.elapsed() < Duration::from_secs(120) {
                match c.leader() {
                    Some(l) if Some(&l) != before.as_ref() => {
                        led_after = Some(t.elapsed());
                        break;
                    }
                    _ => std::thread::sleep(Duration::from_millis(200)),
                }
            }
        } else {
            std::thread::sleep(window);
        }
        let healing = Instant::now();
        if let Err(e) = c.try_run(&["heal", "--wait"]) {
            eprintln!("nemesis: heal after {kind} failed, again: {e}");
            c.run(&["heal", "--wait"]);
        }
        let after = c.leader();
        let failover = led_after.is_some() && after.is_some() && after != before;
        let what = match (&injected, led_after) {
            (Err(e), _) => format!("{kind} failed: {e}"),
            (Ok(_), Some(d)) => format!("{kind}: another leader after {:.1} s", d.as_secs_f64()),
            (Ok(_), None) if kind == "kill-etcd-member" => {
                format!("{kind}: down {} ms", window.as_millis())
            }
            (Ok(_), None) => format!("{kind}: no other leader within 120 s"),
        };
        (
            format!(
                "{what}; leader {} -> {}; healed in {:.1} s",
                before.as_deref().unwrap_or("none"),
                after.as_deref().unwrap_or("none"),
                healing.elapsed().as_secs_f64()
            ),
            failover,
        )
    }

    pub fn pg_restart(&self, mode: &str) {
        if let Some(pg) = &self.pg {
            pg.lock().unwrap().restart(mode);
        }
    }

    /// Fills the sled replica's tmpfs; returns the filler to delete.
    pub fn fill_disk(&self) -> Option<PathBuf> {
        use std::io::Write;
        let mnt = self.tmpfs.as_ref()?;
        let path = mnt.join("filler");
        let mut f = std::fs::File::create(&path).ok()?;
        let block = vec![0u8; 1 << 20];
        while f.write_all(&block).is_ok() {}
        let _ = f.flush();
        Some(path)
    }
}

impl Replica {
    #[allow(clippy::too_many_arguments)]
    fn new(
        idx: usize,
        ns: Option<Netns>,
        client_addr: SocketAddr,
        db_proxy: Option<Proxy>,
        client_proxy: Option<Proxy>,
        args: Vec<String>,
        shim: &Path,
        dir: &Path,
        data_dir: PathBuf,
    ) -> Replica {
        let r = Replica {
            idx,
            ns,
            client_addr,
            db_proxy,
            client_proxy,
            args,
            shim: shim.to_owned(),
            log: dir.join(format!("replica{idx}.log")),
            offset_file: dir.join(format!("replica{idx}.offset")),
            offset: AtomicI64::new(0),
            started_stepped: AtomicBool::new(false),
            data_dir,
            child: tokio::sync::Mutex::new(None),
        };
        r.set_clock(0);
        r
    }

    /// Starts the process and waits for its "listening" line; a start that
    /// fails (the database unreachable, the disk full) is tried again every
    /// half second, as an orchestrator would, for two minutes at most.
    async fn spawn(&self) -> Child {
        let give_up = Instant::now() + Duration::from_secs(120);
        loop {
            match self.try_spawn().await {
                Ok(child) => return child,
                Err(why) => {
                    eprintln!("nemesis: replica{} did not start: {why}", self.idx);
                    assert!(
                        Instant::now() < give_up,
                        "replica{} could not be restarted for two minutes: {why}",
                        self.idx
                    );
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    async fn try_spawn(&self) -> Result<Child, String> {
        let before = std::fs::metadata(&self.log).map(|m| m.len()).unwrap_or(0);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = match &self.ns {
            Some(ns) => ns.exec(bin()),
            None => Command::new(bin()),
        };
        cmd.args(&self.args)
            .env("LD_PRELOAD", &self.shim)
            .env("STATESEAL_TEST_CLOCK_OFFSET_FILE", &self.offset_file)
            .env_remove("STATESEAL_LOG")
            .env_remove("STATESEAL_DATABASE_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let mut child = cmd.spawn().expect("spawn stateseal");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let new = read_from(&self.log, before);
            if new.contains("listening") {
                let stepped = self.offset.load(Ordering::Relaxed) != 0;
                self.started_stepped.store(stepped, Ordering::Relaxed);
                return Ok(child);
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("{status}: {}", new.lines().last().unwrap_or("")));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no \"listening\" line in 60 s: {new}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    pub fn set_clock(&self, secs: i64) {
        self.offset.store(secs, Ordering::Relaxed);
        let tmp = self.offset_file.with_extension("tmp");
        std::fs::write(&tmp, secs.to_string()).unwrap();
        std::fs::rename(&tmp, &self.offset_file).unwrap();
    }

    /// `kill -9`, then a restart after `down`.
    pub async fn kill_restart(&self, down: Duration) {
        let mut child = self.child.lock().await;
        if let Some(mut c) = child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        tokio::time::sleep(down).await;
        *child = Some(self.spawn().await);
    }

    /// SIGSTOP for `d`, then SIGCONT; holds the process so that neither the
    /// supervisor nor a kill touches it meanwhile.
    pub async fn pause(&self, d: Duration) {
        let child = self.child.lock().await;
        let pid = child.as_ref().map(|c| c.id().to_string());
        if let Some(pid) = &pid {
            let _ = Command::new("kill").args(["-STOP", pid]).status();
        }
        tokio::time::sleep(d).await;
        if let Some(pid) = &pid {
            let _ = Command::new("kill").args(["-CONT", pid]).status();
        }
    }
}

/// What `path` holds past byte `offset` (this start's lines of a log that
/// every restart appends to).
fn read_from(path: &Path, offset: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let mut text = Vec::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        if f.seek(SeekFrom::Start(offset)).is_ok() {
            let _ = f.read_to_end(&mut text);
        }
    }
    String::from_utf8_lossy(&text).into_owned()
}
