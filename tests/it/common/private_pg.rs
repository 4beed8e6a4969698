//! A private PostgreSQL instance for a test: `initdb` into a temporary
//! directory, its own port on 127.0.0.1, trust authentication, optionally
//! TLS. Needs root (initdb runs as the `postgres` user via runuser) and
//! PostgreSQL's server binaries under /usr/lib/postgresql.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The server binaries, or the reason a test cannot start an instance.
pub fn available() -> Result<PathBuf, &'static str> {
    let bin = pg_bin().ok_or("no PostgreSQL server binaries under /usr/lib/postgresql")?;
    if !rustix::process::geteuid().is_root() {
        return Err("not root: initdb must run as the postgres user");
    }
    Ok(bin)
}

pub fn pg_bin() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    found.sort();
    found.pop()
}

pub fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn as_postgres(bin: &Path, tool: &str) -> Command {
    let mut c = Command::new("runuser");
    c.args(["-u", "postgres", "--"]).arg(bin.join(tool));
    c
}

// The free-port helper is shared with clients/rust's tests.
#[path = "ports.rs"]
mod ports;
pub use ports::free_port;

/// A private PostgreSQL instance, stopped on drop.
pub struct PrivatePg {
    bin: PathBuf,
    data: PathBuf,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl PrivatePg {
    /// `tls`: (server cert PEM, key PEM, CA PEM for client certificates);
    /// `extra_conf`: lines appended to postgresql.conf.
    pub fn start(bin: &Path, tls: Option<(&str, &str, &str)>, extra_conf: &str) -> PrivatePg {
        let dir = tempfile::Builder::new()
            .prefix("stateseal-pg-")
            .tempdir()
            .unwrap();
        let data = dir.path().join("data");
        run(Command::new("chown").arg("postgres").arg(dir.path()));
        run(as_postgres(bin, "initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data));
        let mut conf = format!(
            "listen_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nfsync = off\n",
            dir.path().display()
        );
        let mut hba = String::from("local all all trust\n");
        match tls {
            Some((cert, key, client_ca)) => {
                for (name, pem) in [
                    ("server.crt", cert),
                    ("server.key", key),
                    ("client_ca.crt", client_ca),
                ] {
                    let p = data.join(name);
                    std::fs::write(&p, pem).unwrap();
                    run(Command::new("chown").arg("postgres").arg(&p));
                    run(Command::new("chmod").arg("0600").arg(&p));
                }
                conf.push_str(
                    "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\nssl_ca_file = 'client_ca.crt'\n",
                );
                hba.push_str("hostssl all certuser 127.0.0.1/32 cert\n");
                hba.push_str("hostssl all postgres 127.0.0.1/32 trust\n");
            }
            None => {
                conf.push_str("ssl = off\n");
                hba.push_str("host all postgres 127.0.0.1/32 trust\n");
            }
        }
        let initdb_conf = std::fs::read_to_string(data.join("postgresql.conf")).unwrap();
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
        // The port is free when chosen, but other tests bind ports at the
        // same time: on a start that fails, another port.
        let mut port = 0;
        for attempt in 1..=5 {
            port = free_port();
            std::fs::write(
                data.join("postgresql.conf"),
                format!("{initdb_conf}{conf}port = {port}\n{extra_conf}"),
            )
            .unwrap();
            let started = as_postgres(bin, "pg_ctl")
                .args(["-w", "-t", "60", "-D"])
                .arg(&data)
                .arg("-l")
                .arg(dir.path().join("log"))
                .arg("start")
                .output()
                .unwrap();
            if started.status.success() {
                break;
            }
            assert!(
                attempt < 5,
                "private PostgreSQL did not start: {}",
                String::from_utf8_lossy(&started.stderr)
            );
        }
        if tls.is_some() {
            run(as_postgres(bin, "psql")
                .args([
                    "-h",
                    &dir.path().display().to_string(),
                    "-p",
                    &port.to_string(),
                    "-U",
                    "postgres",
                    "-c",
                ])
                .arg("CREATE ROLE certuser LOGIN SUPERUSER"));
        }
        PrivatePg {
            bin: bin.to_owned(),
            data,
            port,
            _dir: dir,
        }
    }
}

impl PrivatePg {
    /// `pg_ctl restart -m MODE` (`fast` or `immediate`), waiting until the
    /// server accepts connections again on the same port.
    pub fn restart(&self, mode: &str) {
        run(as_postgres(&self.bin, "pg_ctl")
            .args(["-w", "-t", "60", "-m", mode, "-D"])
            .arg(&self.data)
            .arg("-l")
            .arg(self._dir.path().join("log"))
            .arg("restart"));
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        let _ = as_postgres(&self.bin, "pg_ctl")
            .args(["-m", "immediate", "-D"])
            .arg(&self.data)
            .arg("stop")
            .output();
    }
}
