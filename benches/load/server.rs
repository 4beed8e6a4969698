//! The stateseal server this bench starts (without `--addr`): the real
//! binary on a temporary data directory, its address read from its log.

use std::path::PathBuf;

use super::args::Args;
use crate::{ports, support};

pub struct Server {
    pub child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Server {
    pub fn data_dir(&self) -> PathBuf {
        self._dir.path().to_path_buf()
    }

    pub fn rss_kib(&self, field: &str) -> Option<u64> {
        support::status_kib(&self.child.id().to_string(), field)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(extra: &[String]) -> (Server, String) {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_stateseal"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .args(extra)
        .env("STATESEAL_LOG", "warn,stateseal::app::server=info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start stateseal");
    let stderr = child.stderr.take().expect("stderr");
    // Read on a thread of its own, so that a server that never reports its
    // address ends the bench with an error instead of hanging it; then keep
    // draining stderr so the server never blocks on it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(a) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("addr="))
            {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(a.to_string());
                }
            }
        }
    });
    // Owned first: a panic below kills the server on the way out.
    let server = Server { child, _dir: dir };
    let addr = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("stateseal exited, or logged no `addr=` line within 60 s");
    (server, addr)
}

/// The server the scenarios call: `--addr`, or one started here with the
/// `--server-arg`s (and, for `--samples`, a metrics listener). Returns the
/// server started, its address, and its metrics address.
pub fn for_args(args: &Args) -> (Option<Server>, String, Option<String>) {
    let mut metrics_addr: Option<String> = None;
    let (server, addr) = match &args.addr {
        Some(a) => (None, a.clone()),
        None => {
            let mut extra = args.server_args.clone();
            if !extra.iter().any(|a| a.starts_with("--max-ledger-records")) {
                // The durable scenarios leave a record per consumption (their
                // tokens live 600 s): on a fast machine a default run makes
                // more than the server's default bound of 250,000, and the
                // rest would be refused OVERLOADED. The bound is not what
                // this bench measures (tests/it/ledger_bound.rs tests it).
                extra.extend(["--max-ledger-records".into(), "0".into()]);
            }
            if args.samples.is_some() {
                // The sampler reads the ledger's record count from /metrics.
                let port = ports::free_port();
                extra.extend(["--metrics-listen".into(), format!("127.0.0.1:{port}")]);
                metrics_addr = Some(format!("127.0.0.1:{port}"));
            }
            let (s, a) = start_server(&extra);
            (Some(s), a)
        }
    };
    (server, addr, metrics_addr)
}
