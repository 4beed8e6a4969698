//! Network namespaces for the replicas: each in its own, joined to the
//! harness's by a veth pair (harness side 10.X.K.1, replica side 10.X.K.2,
//! a /30 that exists only on this machine), with an nftables table whose
//! four chains the nemesis fills with drops and flushes to heal.

use std::net::Ipv4Addr;
use std::process::Command;

pub fn sh(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn ip() -> Command {
    Command::new("ip")
}

const PREFIX: &str = "ssnem";

/// Deletes the namespaces an earlier harness left behind (its process is
/// gone: a harness that was killed never ran its drops).
pub fn remove_stale() {
    let Ok(out) = ip().args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid = rest.split('r').next().unwrap_or("");
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = sh(ip().args(["netns", "del", name]));
        }
    }
}

/// The chains: traffic from the database, to the database, from the
/// clients, to the clients.
#[derive(Clone, Copy, Debug)]
pub enum Chain {
    DbIn,
    DbOut,
    ClientsIn,
    ClientsOut,
}

impl Chain {
    fn name(self) -> &'static str {
        match self {
            Chain::DbIn => "db_in",
            Chain::DbOut => "db_out",
            Chain::ClientsIn => "clients_in",
            Chain::ClientsOut => "clients_out",
        }
    }
}

pub struct Netns {
    pub name: String,
    pub host_ip: Ipv4Addr,
    pub ns_ip: Ipv4Addr,
    db_port: u16,
    grpc_port: u16,
}

impl Netns {
    /// Namespace `idx` of this harness process, with the veth pair up and
    /// the nftables table in place. `db_port` is the database proxy's port
    /// on the harness side, `grpc_port` the replica's inside.
    pub fn create(idx: u8, db_port: u16, grpc_port: u16) -> Result<Netns, String> {
        let pid = std::process::id();
        let name = format!("{PREFIX}{pid}r{idx}");
        let octet = 16 + (pid % 200) as u8;
        let host_ip = Ipv4Addr::new(10, octet, idx, 1);
        let ns_ip = Ipv4Addr::new(10, octet, idx, 2);
        let (vh, vn) = (
            format!("sn{}h{idx}", pid % 100_000),
            format!("sn{}n{idx}", pid % 100_000),
        );
        sh(ip().args(["netns", "add", &name]))?;
        let ns = Netns {
            name,
            host_ip,
            ns_ip,
            db_port,
            grpc_port,
        };
        sh(ip().args(["link", "add", &vh, "type", "veth", "peer", "name", &vn]))?;
        sh(ip().args(["link", "set", &vn, "netns", &ns.name]))?;
        sh(ip().args(["addr", "add", &format!("{host_ip}/30"), "dev", &vh]))?;
        sh(ip().args(["link", "set", &vh, "up"]))?;
        sh(ns
            .exec("ip")
            .args(["addr", "add", &format!("{ns_ip}/30"), "dev", &vn]))?;
        sh(ns.exec("ip").args(["link", "set", &vn, "up"]))?;
        sh(ns.exec("ip").args(["link", "set", "lo", "up"]))?;
        let mut table = String::from("table inet nemesis {\n");
        for (c, hook) in [
            (Chain::DbIn, "input"),
            (Chain::DbOut, "output"),
            (Chain::ClientsIn, "input"),
            (Chain::ClientsOut, "output"),
        ] {
            table.push_str(&format!(
                "  chain {} {{ type filter hook {hook} priority 0; policy accept; }}\n",
                c.name()
            ));
        }
        table.push_str("}\n");
        ns.nft(&table)?;
        Ok(ns)
    }

    /// A command run inside the namespace.
    pub fn exec(&self, program: &str) -> Command {
        let mut c = ip();
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    fn nft(&self, script: &str) -> Result<(), String> {
        let path = std::env::temp_dir().join(format!("{}.nft", self.name));
        std::fs::write(&path, script).map_err(|e| e.to_string())?;
        let r = sh(self.exec("nft").arg("-f").arg(&path));
        let _ = std::fs::remove_file(&path);
        r
    }

    /// Drops what `chain` matches.
    pub fn block(&self, chain: Chain) -> Result<(), String> {
        let rule = match chain {
            Chain::DbIn => format!("ip saddr {} tcp sport {} drop", self.host_ip, self.db_port),
            Chain::DbOut => format!("ip daddr {} tcp dport {} drop", self.host_ip, self.db_port),
            Chain::ClientsIn => format!("tcp dport {} drop", self.grpc_port),
            Chain::ClientsOut => format!("tcp sport {} drop", self.grpc_port),
        };
        self.nft(&format!("add rule inet nemesis {} {rule}\n", chain.name()))
    }

    pub fn heal(&self, chain: Chain) -> Result<(), String> {
        self.nft(&format!("flush chain inet nemesis {}\n", chain.name()))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // The veth pair goes with the namespace.
        let _ = sh(ip().args(["netns", "del", &self.name]));
    }
}
