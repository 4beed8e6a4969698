//! Runs the real `stateseal` binary as a child process on 127.0.0.1.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct ServerProcess {
    pub child: Child,
    pub addr: SocketAddr,
    pub log: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

pub fn command() -> Command {
    Command::new(env!("CARGO_BIN_EXE_stateseal"))
}

/// Starts `stateseal serve --listen 127.0.0.1:0 --data-dir DIR ARGS…` and
/// waits for its "listening" line.
pub fn spawn(data_dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> ServerProcess {
    spawn_as(command(), data_dir, args, envs)
}

/// Like [`spawn`], with `cmd` as the program (e.g. the binary behind a
/// privilege-dropping wrapper).
pub fn spawn_as(
    mut cmd: Command,
    data_dir: &Path,
    args: &[&str],
    envs: &[(&str, &str)],
) -> ServerProcess {
    cmd.arg("serve")
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .env_remove("STATESEAL_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn stateseal");
    let stderr = child.stderr.take().expect("stderr");
    let log = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains("listening") {
                    if let Some(addr) = line
                        .split_whitespace()
                        .find_map(|w| w.strip_prefix("addr="))
                        .and_then(|a| a.parse::<SocketAddr>().ok())
                    {
                        let _ = tx.send(addr);
                    }
                }
                log.lock().unwrap().push(line);
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(addr) = rx.recv_timeout(Duration::from_millis(100)) {
            return ServerProcess {
                child,
                addr,
                log,
                reader: Some(reader),
            };
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "stateseal exited early ({status}): {:?}",
                log.lock().unwrap()
            );
        }
        assert!(
            Instant::now() < deadline,
            "stateseal did not start: {:?}",
            log.lock().unwrap()
        );
    }
}

impl ServerProcess {
    /// SIGKILL: no chance to flush anything.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }

    /// Waits (up to 30 s) for a log line holding `needle`: the log is read
    /// from the child's stderr on a thread of its own, so a line may land a
    /// moment after the state it reports.
    pub fn wait_logged(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.log.lock().unwrap().iter().any(|l| l.contains(needle)) {
            assert!(Instant::now() < deadline, "never logged {needle:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, then waits for exit; returns the exit status and the full log.
    pub fn terminate(mut self) -> (std::process::ExitStatus, Vec<String>) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("stateseal did not stop on SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let log = self.log.lock().unwrap().clone();
        (status, log)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `stateseal serve ARGS… --data-dir DIR` and asserts it refuses to
/// start with a message containing `want`.
pub fn assert_refuses(args: &[&str], data_dir: &Path, want: &str) {
    let out = command()
        .arg("serve")
        .args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .env_remove("STATESEAL_DATABASE_URL")
        .output()
        .expect("run stateseal");
    assert!(!out.status.success(), "{args:?} started");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(want), "{args:?}: {err}");
}

/// The health port a server logged (`health_addr=`), when started with
/// `--health-listen`.
pub fn health_addr(s: &ServerProcess) -> SocketAddr {
    let log = s.log.lock().unwrap();
    log.iter()
        .find_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("health_addr="))
                .and_then(|a| a.parse().ok())
        })
        .expect("health port logged")
}

/// A keyset made with `stateseal keys init` in `dir`, for replicas to
/// share; returns its path.
pub fn keys_init(dir: &Path) -> String {
    let ks = dir.join("keyset.json");
    assert!(command()
        .args(["keys", "init"])
        .arg(&ks)
        .output()
        .expect("keys init")
        .status
        .success());
    ks.to_str().expect("utf-8 path").to_owned()
}

/// The container memory limit in `deploy/base/deployment.yaml`, in bytes.
pub fn deploy_memory_limit() -> u64 {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/base/deployment.yaml"
    ))
    .expect("deploy/base/deployment.yaml");
    let limits = text.split("limits:").nth(1).expect("a limits: block");
    let mem = limits
        .lines()
        .find_map(|l| l.trim().strip_prefix("memory:"))
        .expect("a memory limit")
        .trim();
    let mib: u64 = mem
        .strip_suffix("Mi")
        .expect("memory in Mi")
        .parse()
        .expect("a number of MiB");
    mib * 1024 * 1024
}

pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// A GET over HTTP/1.1; the whole response.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    http_request(addr, "GET", path, "")
}

/// One HTTP/1.1 exchange; `headers` are extra header lines, each ending in
/// CRLF. Returns the whole response (the server closes the connection). A
/// server that refuses a request it cannot parse may close before it read
/// all of it: the rest of the write then fails (broken pipe) and the kernel
/// may turn the unread bytes into a reset. What arrived is the answer.
pub fn http_request(addr: std::net::SocketAddr, method: &str, path: &str, headers: &str) -> String {
    use std::io::{ErrorKind, Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let request = format!("{method} {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n");
    if let Err(e) = s.write_all(request.as_bytes()) {
        assert!(
            matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset),
            "{e}"
        );
    }
    let mut out = Vec::new();
    if let Err(e) = s.read_to_end(&mut out) {
        assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The metrics port the server logged at start (`--metrics-listen`).
pub fn metrics_addr(p: &ServerProcess) -> std::net::SocketAddr {
    let log = p.log.lock().unwrap();
    let line = log
        .iter()
        .find(|l| l.contains("metrics_addr="))
        .expect("metrics port logged")
        .clone();
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("metrics_addr="))
        .unwrap()
        .parse()
        .unwrap()
}

/// Writes `DIR/tenants.json` with one tenant, `t`, whose bearer secret is
/// `secret`; returns its path.
pub fn bearer_tenants(dir: &Path, secret: &str) -> std::path::PathBuf {
    use sha2::Digest;
    let digest: String = sha2::Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let tenants = dir.join("tenants.json");
    std::fs::write(
        &tenants,
        format!(r#"{{"tenants":[{{"name":"t","bearer_sha256":"{digest}"}}]}}"#),
    )
    .unwrap();
    tenants
}
