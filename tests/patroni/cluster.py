#!/usr/bin/env python3
"""A private replicated PostgreSQL for stateseal's tests: three PostgreSQL 15
nodes managed by Patroni (Debian's 3.0.2), with etcd (Debian's 3.4, three
members by default) as its store, all on 127.0.0.1 on free ports chosen at run
time, everything under one directory. Python 3.11 standard library only.

    cluster.py up DIR [--async] [--etcd-members 1|3] [--ttl S] [--loop-wait S]
                      [--retry-timeout S] [--timeout S] [--watch-pid PID] [--detach]
        Starts the topology and blocks until a leader is elected, both standbys
        stream and (synchronous mode) a synchronous standby is set; creates the
        database `test`; prints ONE JSON line on stdout. Then it stays in the
        foreground as the cluster's supervisor until `down`, SIGTERM/SIGINT/SIGHUP,
        or the death of the process that started it (--watch-pid, default its
        parent): then it tears everything down. Spawn it as a child and read the
        first line (Rust: Command + BufReader::read_line; shell: run it with `&`
        and call `wait-ready`). --detach forks the supervisor away instead (its
        own zombie then stays where PID 1 does not reap, as on this machine).
    cluster.py wait-ready DIR [--timeout S]   prints the `up` JSON once it exists
    cluster.py status DIR                     leader, sync standby, timeline, members
    cluster.py wait-healthy DIR [--timeout S] [--nodes N]
    cluster.py kill-primary DIR [--wait]      SIGKILL of the leader node: its Patroni,
                                              postmaster and every backend at once
    cluster.py kill-node DIR NAME / start-node DIR NAME
    cluster.py switchover DIR [--to NAME]     planned, through Patroni's REST API;
                                              waits for the new leader
    cluster.py partition-primary DIR          the leader node cut from the other
                                              nodes and from etcd (clients still reach it)
    cluster.py partition-node DIR NAME
    cluster.py kill-etcd-member DIR [NAME]    default: etcd's raft leader
    cluster.py heal DIR [--wait]              removes partitions, restarts what was killed
    cluster.py pgbouncer DIR [--pool-mode transaction] [--ignore-startup-parameters P]
                                              PgBouncer in front of the current leader
    cluster.py down DIR [--purge]             stops everything; idempotent
    cluster.py down-stale                     tears down clusters whose supervisor died

Every command prints one JSON line. Needs root (cgroup v2, nftables); PostgreSQL,
Patroni and PgBouncer run as the `postgres` user. Each node (its Patroni, its
postmaster, every backend) lives in its own cgroup v2 group: "kill -9 of a node"
is `cgroup.kill`, and a partition is an nftables table matching sockets by
cgroup (`socket cgroupv2`), so on one loopback the node is cut from its peers
and etcd while other clients (in other cgroups) still reach it.
"""

import argparse
import base64
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

PGBIN = "/usr/lib/postgresql/15/bin"
CG_NAME = "stateseal-patroni"
NODES = ("n1", "n2", "n3")
HOST = "127.0.0.1"
STATE = "cluster.json"
READY = "ready.json"

_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# --------------------------------------------------------------------------- helpers


def out(obj):
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def log(msg):
    sys.stderr.write(f"[cluster.py {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


class Fail(Exception):
    pass


def http(method, url, body=None, timeout=2.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with _HTTP.open(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode(errors="replace")


def b64(s):
    return base64.b64encode(s.encode()).decode()


def prefix_end(s):
    b = bytearray(s.encode())
    b[-1] += 1
    return bytes(b).decode()


def etcd_range(endpoints, key, prefix=False, timeout=1.5):
    """Values under `key` (v3 JSON gateway), from the first member that answers."""
    body = {"key": b64(key)}
    if prefix:
        body["range_end"] = b64(prefix_end(key))
    last = None
    for ep in endpoints:
        try:
            status, js = http("POST", f"http://{ep}/v3/kv/range", body, timeout)
            if status == 200 and isinstance(js, dict):
                return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
                        for kv in js.get("kvs", [])}
            last = f"{ep}: HTTP {status} {js}"
        except (OSError, ValueError) as e:
            last = f"{ep}: {e}"
    raise Fail(f"no etcd member answered: {last}")


def port_free(port):
    s = socket.socket()
    try:
        s.bind((HOST, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def pick_ports(n):
    """n distinct free ports, below the kernel's ephemeral range where possible."""
    try:
        lo, hi = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except OSError:
        lo, hi = 32768, 60999
    if lo > 12000:
        pool = range(10000, lo)
    else:
        pool = range(hi + 1, 65535)
    avoid = {5432, 5433, 6379, 3306, 5672, 15672, 25672, 1883, 4222, 6222, 8222, 2379, 2380,
             6432, 8008, 8080, 9090}
    chosen = []
    rnd = random.SystemRandom()
    while len(chosen) < n:
        p = rnd.choice(pool)
        if p in avoid or p in chosen or not port_free(p):
            continue
        chosen.append(p)
    return chosen


def cgroup2_mount():
    """(mount point, depth of the mount's root in the hierarchy)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup2":
                fields = left.split()
                root, mnt = fields[3], fields[4]
                depth = 0 if root == "/" else len(root.strip("/").split("/"))
                return mnt, depth
    raise Fail("no cgroup2 hierarchy is mounted (needed to kill and partition a node as a whole)")


def pid_alive(pid):
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pid_start(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def run(cmd, timeout=60, check=True, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise Fail(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def psql(port, sql, db="postgres", timeout=20, check=True):
    env = dict(os.environ, PGCONNECT_TIMEOUT="3")
    return run([f"{PGBIN}/psql", "-X", "-w", "-At", "-h", HOST, "-p", str(port), "-U", "postgres",
                "-d", db, "-v", "ON_ERROR_STOP=1", "-c", sql], timeout=timeout, check=check, env=env)


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
           and not k.startswith("PG") and k not in ("PYTHONPATH", "PYTHONHOME")}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["PATH"] = f"{PGBIN}:/usr/sbin:/usr/bin:/sbin:/bin"
    env["LANG"] = env["LC_ALL"] = "C.UTF-8"
    return env


# --------------------------------------------------------------------------- the cluster


class Cluster:
    def __init__(self, d):
        self.dir = os.path.abspath(d)
        self.path = os.path.join(self.dir, STATE)
        with open(self.path) as f:
            self.s = json.load(f)

    # ---- state
    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.s, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    @property
    def nodes(self):
        return self.s["nodes"]

    def node(self, name):
        for n in self.nodes:
            if n["name"] == name:
                return n
        raise Fail(f"no node {name!r} (nodes: {', '.join(n['name'] for n in self.nodes)})")

    def etcd_endpoints(self):
        return [f"{HOST}:{e['client']}" for e in self.s["etcd"]]

    def cg(self, *parts):
        return os.path.join(self.s["cgroup"], *parts)

    def nft_cg(self, name):
        return os.path.relpath(self.cg(name), "/sys/fs/cgroup")

    # ---- processes
    def spawn(self, group, cmd, logfile, as_postgres):
        """Starts cmd in cgroup `group`, SIGKILLed if this supervisor dies."""
        cgprocs = self.cg(group, "cgroup.procs")
        wrap = ["setpriv", "--pdeathsig", "KILL"]
        if as_postgres:
            wrap += ["--reuid=postgres", "--regid=postgres", "--init-groups"]
        script = 'echo $$ > "$0" && exec "$@"'
        lf = open(logfile, "ab")
        p = subprocess.Popen(["/bin/sh", "-c", script, cgprocs] + wrap + ["--"] + cmd,
                             stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT,
                             env=clean_env(), cwd=self.dir, start_new_session=True)
        lf.close()
        return p.pid

    def cg_pids(self, group):
        try:
            with open(self.cg(group, "cgroup.procs")) as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def cg_kill(self, group, wait=10.0):
        path = self.cg(group)
        if not os.path.isdir(path):
            return
        try:
            with open(os.path.join(path, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            for pid in self.cg_pids(group):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        deadline = time.time() + wait
        while time.time() < deadline:
            reap()
            try:
                with open(os.path.join(path, "cgroup.events")) as f:
                    if "populated 0" in f.read():
                        return
            except OSError:
                return
            time.sleep(0.05)

    def start_etcd(self, e):
        names = ",".join(f"{x['name']}=http://{HOST}:{x['peer']}" for x in self.s["etcd"])
        cmd = ["etcd", "--name", e["name"], "--data-dir", os.path.join(self.dir, e["name"]),
               "--listen-client-urls", f"http://{HOST}:{e['client']}",
               "--advertise-client-urls", f"http://{HOST}:{e['client']}",
               "--listen-peer-urls", f"http://{HOST}:{e['peer']}",
               "--initial-advertise-peer-urls", f"http://{HOST}:{e['peer']}",
               "--initial-cluster", names, "--initial-cluster-token", self.s["scope"],
               "--initial-cluster-state", "new",
               # A busy two-core machine: slower heartbeats than the 100/1000 ms default.
               "--heartbeat-interval", "250", "--election-timeout", "2500",
               "--logger", "zap", "--log-outputs", "stderr"]
        self.spawn(e["name"], cmd, os.path.join(self.dir, f"{e['name']}.log"), as_postgres=False)
        e["killed"] = False

    def start_node(self, n):
        self.spawn(n["name"], [self.s["patroni"], os.path.join(self.dir, n["name"], "patroni.yml")],
                   os.path.join(self.dir, f"{n['name']}.log"), as_postgres=True)
        n["killed"] = False

    def write_patroni_config(self, n):
        s = self.s
        ndir = os.path.join(self.dir, n["name"])
        sockdir = ndir if len(ndir) + len("/.s.PGSQL.65535.lock") < 100 else ""
        hba = ["local all all trust", f"host all all {HOST}/32 trust",
               f"host replication all {HOST}/32 trust"]
        cfg = {
            "scope": s["scope"],
            "namespace": "/service/",
            "name": n["name"],
            "restapi": {"listen": f"{HOST}:{n['rest']}", "connect_address": f"{HOST}:{n['rest']}"},
            "etcd3": {"hosts": self.etcd_endpoints()},
            "bootstrap": {
                "dcs": {
                    "ttl": s["ttl"], "loop_wait": s["loop_wait"], "retry_timeout": s["retry_timeout"],
                    "maximum_lag_on_failover": 1048576,
                    "synchronous_mode": s["synchronous_mode"],
                    "synchronous_mode_strict": False,
                    "postgresql": {
                        "use_pg_rewind": True, "use_slots": True,
                        "parameters": {
                            "wal_level": "replica", "hot_standby": "on", "wal_log_hints": "on",
                            "max_connections": 120, "max_wal_senders": 10,
                            "max_replication_slots": 10, "wal_keep_size": "128MB",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, "data-checksums"],
            },
            "postgresql": {
                "listen": f"{HOST}:{n['port']}",
                "connect_address": f"{HOST}:{n['port']}",
                "data_dir": os.path.join(ndir, "data"),
                "bin_dir": PGBIN,
                "pgpass": os.path.join(ndir, "pgpass"),
                "authentication": {"superuser": {"username": "postgres"},
                                   "replication": {"username": "postgres"},
                                   "rewind": {"username": "postgres"}},
                "pg_hba": hba,
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
                "parameters": {
                    "unix_socket_directories": sockdir,
                    "shared_buffers": "64MB",
                    "synchronous_commit": "on",
                    "log_line_prefix": "%m [%p] %q%u@%d ",
                    "log_min_messages": "warning",
                },
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
            "watchdog": {"mode": "off"},
        }
        path = os.path.join(ndir, "patroni.yml")
        with open(path, "w") as f:
            json.dump(cfg, f, indent=1)  # JSON is YAML
        os.chmod(path, 0o644)

    # ---- views
    def rest(self, n, path="patroni", timeout=1.5):
        try:
            status, js = http("GET", f"http://{HOST}:{n['rest']}/{path}", timeout=timeout)
            return js if isinstance(js, dict) else None
        except OSError:
            return None

    def dcs(self):
        """Leader and sync standby as etcd holds them (None, None if etcd does not answer)."""
        base = f"/service/{self.s['scope']}/"
        try:
            kv = etcd_range(self.etcd_endpoints(), base, prefix=True)
        except Fail:
            return None, None, False
        leader = kv.get(base + "leader")
        sync = None
        if base + "sync" in kv:
            try:
                sync = json.loads(kv[base + "sync"]).get("sync_standby")
            except ValueError:
                pass
        return leader, sync, True

    def leader(self):
        leader, _, ok = self.dcs()
        if leader:
            return self.node(leader)
        # etcd unreachable: the node that says it is the primary.
        for n in self.nodes:
            r = None if n.get("killed") else self.rest(n)
            if r and r.get("role") in ("master", "primary"):
                return n
        raise Fail("no leader (etcd has no leader key and no node says it is the primary)")

    def status(self):
        leader, sync, dcs_ok = self.dcs()
        members, timeline, replication = [], None, []
        for n in self.nodes:
            r = None if n.get("killed") else self.rest(n)
            role = (r or {}).get("role")
            if role == "master":
                role = "primary"
            m = {"name": n["name"], "host": HOST, "port": n["port"], "rest": f"{HOST}:{n['rest']}",
                 "alive": bool(self.cg_pids(n["name"])), "killed": bool(n.get("killed")),
                 "partitioned": self.s.get("partitioned") == n["name"],
                 "role": role, "state": (r or {}).get("state"), "timeline": (r or {}).get("timeline"),
                 "in_recovery": None}
            if m["alive"]:
                q = psql(n["port"], "SELECT pg_is_in_recovery()", timeout=5, check=False)
                if q.returncode == 0:
                    m["in_recovery"] = q.stdout.strip() == "t"
            members.append(m)
            if n["name"] == leader and r:
                timeline = r.get("timeline")
                replication = [{"application_name": x.get("application_name"), "state": x.get("state"),
                                "sync_state": x.get("sync_state")} for x in r.get("replication") or []]
        etcd = []
        for e in self.s["etcd"]:
            info = {"name": e["name"], "endpoint": f"{HOST}:{e['client']}", "killed": bool(e.get("killed")),
                    "alive": bool(self.cg_pids(e["name"]))}
            if info["alive"]:
                try:
                    st, js = http("POST", f"http://{HOST}:{e['client']}/v3/maintenance/status", {}, 1.0)
                    if st == 200:
                        info["raft_leader"] = js.get("leader") == js.get("header", {}).get("member_id")
                except OSError:
                    pass
            etcd.append(info)
        return {"leader": leader, "sync_standby": sync, "timeline": timeline, "dcs_reachable": dcs_ok,
                "synchronous_mode": self.s["synchronous_mode"], "partitioned": self.s.get("partitioned"),
                "replication": replication, "members": members, "etcd": etcd,
                "pgbouncer": self.s.get("pgbouncer")}

    def healthy(self, nodes=3):
        st = self.status()
        if not st["leader"]:
            return False, st, "no leader key"
        lm = next(m for m in st["members"] if m["name"] == st["leader"])
        if lm["role"] != "primary" or lm["state"] != "running":
            return False, st, f"leader {lm['name']} is {lm['role']}/{lm['state']}"
        streaming = [r for r in st["replication"] if r["state"] == "streaming"]
        if len(streaming) < nodes - 1:
            return False, st, f"{len(streaming)} standbys streaming"
        if self.s["synchronous_mode"]:
            if not any(r["sync_state"] == "sync" for r in streaming) or not st["sync_standby"]:
                return False, st, "no synchronous standby yet"
        return True, st, "ok"

    def wait_healthy(self, timeout, nodes=3):
        deadline = time.time() + timeout
        why = "?"
        while time.time() < deadline:
            reap()
            ok, st, why = self.healthy(nodes)
            if ok:
                return st
            time.sleep(0.5)
        raise Fail(f"not healthy after {timeout}s: {why}")

    # ---- faults
    def partition(self, name):
        target = self.node(name)
        others = [n for n in self.nodes if n["name"] != name]
        mine = {target["port"], target["rest"]}
        theirs = {p for n in others for p in (n["port"], n["rest"])}
        theirs |= {p for e in self.s["etcd"] for p in (e["client"], e["peer"])}
        lvl = self.s["cgroup_level"] + 1

        def ports(s):
            return "{ " + ", ".join(str(p) for p in sorted(s)) + " }"
        rules_out = [f'socket cgroupv2 level {lvl} "{self.nft_cg(name)}" tcp dport {ports(theirs)} drop']
        rules_in = [f'socket cgroupv2 level {lvl} "{self.nft_cg(name)}" tcp sport {ports(theirs)} drop']
        for o in others:
            rules_out.append(f'socket cgroupv2 level {lvl} "{self.nft_cg(o["name"])}" tcp dport {ports(mine)} drop')
            rules_in.append(f'socket cgroupv2 level {lvl} "{self.nft_cg(o["name"])}" tcp sport {ports(mine)} drop')
        table = self.s["nft_table"]
        script = (f"table inet {table} {{}}\ndelete table inet {table}\n"
                  f"table inet {table} {{\n"
                  f" chain out {{ type filter hook output priority -10; policy accept;\n  "
                  + "\n  ".join(r + " comment \"partition\"" for r in rules_out) + "\n }\n"
                  f" chain inp {{ type filter hook input priority -10; policy accept;\n  "
                  + "\n  ".join(rules_in) + "\n }\n}\n")
        r = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True)
        if r.returncode != 0:
            raise Fail(f"nft: {r.stderr.strip()}\n{script}")
        # Established connections would otherwise linger until TCP gives up:
        # the rules drop their packets from now on, both ways.
        self.s["partitioned"] = name
        self.save()

    def unpartition(self):
        table = self.s["nft_table"]
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)
        self.s["partitioned"] = None

    def etcd_raft_leader(self):
        for e in self.s["etcd"]:
            if e.get("killed"):
                continue
            try:
                st, js = http("POST", f"http://{HOST}:{e['client']}/v3/maintenance/status", {}, 1.5)
                if st == 200 and js.get("leader") == js.get("header", {}).get("member_id"):
                    return e
            except OSError:
                pass
        return None

    # ---- pgbouncer
    def start_pgbouncer(self, pool_mode, ignore):
        self.cg_kill("pgb")
        d = os.path.join(self.dir, "pgbouncer")
        os.makedirs(d, exist_ok=True)
        old = self.s.get("pgbouncer") or {}
        port = old.get("port") if old.get("port") and port_free(old["port"]) else pick_ports(1)[0]
        leader = self.leader()
        with open(os.path.join(d, "userlist.txt"), "w") as f:
            f.write('"postgres" ""\n"stateseal" ""\n')
        ini = f"""[databases]
test = host={HOST} port={leader['port']} dbname=test
postgres = host={HOST} port={leader['port']} dbname=postgres

[pgbouncer]
listen_addr = {HOST}
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {d}/userlist.txt
admin_users = postgres
stats_users = postgres
pool_mode = {pool_mode}
max_client_conn = 400
default_pool_size = 20
ignore_startup_parameters = {ignore}
pidfile = {d}/pgbouncer.pid
logfile = {d}/pgbouncer.log
"""
        with open(os.path.join(d, "pgbouncer.ini"), "w") as f:
            f.write(ini)
        run(["chown", "-R", "postgres:postgres", d])
        self.spawn("pgb", ["pgbouncer", os.path.join(d, "pgbouncer.ini")],
                   os.path.join(self.dir, "pgbouncer.out"), as_postgres=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            reap()
            try:
                socket.create_connection((HOST, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise Fail(f"pgbouncer does not listen on {port}: see {d}/pgbouncer.log")
        self.s["pgbouncer"] = {"port": port, "pool_mode": pool_mode, "backend": f"{HOST}:{leader['port']}",
                               "backend_node": leader["name"], "ignore_startup_parameters": ignore,
                               "url": f"postgres://postgres@{HOST}:{port}/test"}
        self.save()
        return self.s["pgbouncer"]

    # ---- teardown
    def teardown(self, purge=False):
        self.unpartition()
        self.cg_kill("", wait=15)
        for sub in [n["name"] for n in self.nodes] + [e["name"] for e in self.s["etcd"]] + ["pgb", ""]:
            try:
                os.rmdir(self.cg(sub))
            except OSError:
                pass
        try:
            os.rmdir(os.path.dirname(self.s["cgroup"]))
        except OSError:
            pass
        # A postmaster killed with SIGKILL leaves its SysV segment behind: removed
        # only if its key is still the one in postmaster.pid and nothing is attached.
        for n in self.nodes:
            pidfile = os.path.join(self.dir, n["name"], "data", "postmaster.pid")
            try:
                key, shmid = open(pidfile).read().splitlines()[6].split()
                # ipcs -m columns: key shmid owner perms bytes nattch
                for row in run(["ipcs", "-m"], check=False).stdout.splitlines():
                    f = row.split()
                    if (len(f) >= 6 and f[1] == shmid and f[0] == f"0x{int(key):08x}"
                            and f[5] == "0"):
                        run(["ipcrm", "-m", shmid], check=False)
            except (OSError, IndexError, ValueError):
                pass
        for name in [n["name"] for n in self.nodes] + [e["name"] for e in self.s["etcd"]]:
            shutil.rmtree(os.path.join(self.dir, name, "data") if name.startswith("n")
                          else os.path.join(self.dir, name), ignore_errors=True)
        self.s["down"] = True
        self.save()
        if purge:
            shutil.rmtree(self.dir, ignore_errors=True)


ABORT = [lambda: None]  # raises Fail when the supervisor must stop (signal, watched process gone)


def reap():
    ABORT[0]()
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# --------------------------------------------------------------------------- up / supervisor


def check_reachable_by_postgres(d):
    p = d
    while p != "/":
        st = os.stat(p)
        if not st.st_mode & 0o001:
            raise Fail(f"{p} is not searchable by other users (mode {oct(st.st_mode & 0o777)}): the "
                       "postgres user must reach the cluster directory; use a directory under /tmp "
                       "or chmod o+x the path")
        p = os.path.dirname(p)


def cmd_up(a):
    if os.geteuid() != 0:
        raise Fail("must run as root (cgroup v2, nftables, and PostgreSQL runs as user postgres)")
    a.patroni = shutil.which(a.patroni) or a.patroni
    for tool in (a.patroni, "etcd", "setpriv", f"{PGBIN}/postgres", "nft"):
        if not shutil.which(tool):
            raise Fail(f"{tool} not found (Debian: patroni etcd-server util-linux postgresql-15 nftables)")
    r = run([a.patroni, "--version"], check=False)
    if r.returncode != 0:
        raise Fail(f"{a.patroni} --version: {r.stderr.strip() or r.stdout.strip()}")
    down_stale()
    d = os.path.abspath(a.dir)
    os.makedirs(d, exist_ok=True)
    if os.path.exists(os.path.join(d, STATE)):
        old = json.load(open(os.path.join(d, STATE)))
        if not old.get("down") and pid_alive(old.get("supervisor_pid")):
            raise Fail(f"{d} already holds a running cluster (supervisor {old['supervisor_pid']})")
    for f in (STATE, READY):
        try:
            os.remove(os.path.join(d, f))
        except FileNotFoundError:
            pass
    os.chmod(d, 0o755)
    check_reachable_by_postgres(d)
    watch = a.watch_pid if a.watch_pid is not None else os.getppid()

    if a.detach:
        r, w = os.pipe()
        if os.fork() > 0:
            os.close(w)
            data = b""
            while True:
                chunk = os.read(r, 65536)
                if not chunk:
                    break
                data += chunk
            line = data.decode().strip()
            if not line:
                raise Fail(f"the supervisor gave no answer: see {d}/supervisor.log")
            print(line)
            sys.exit(0 if '"error"' not in line else 1)
        os.close(r)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        lf = os.open(os.path.join(d, "supervisor.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(lf, 2)
        nul = os.open(os.devnull, os.O_RDWR)
        os.dup2(nul, 0)
        wfile = os.fdopen(w, "w")
        os.dup2(nul, 1)
        emit = lambda obj: (wfile.write(json.dumps(obj, sort_keys=True) + "\n"), wfile.close())
    else:
        emit = out
    supervise(d, a, watch, emit)


def supervise(d, a, watch, emit):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphaned postmasters come back to us
    t0 = time.time()
    mnt, depth = cgroup2_mount()
    scope = f"ss{os.getpid()}x{random.SystemRandom().randrange(16**4):04x}"
    cgroup = os.path.join(mnt, CG_NAME, scope)
    if os.path.relpath(cgroup, "/sys/fs/cgroup").startswith(".."):
        raise Fail(f"cgroup2 is mounted at {mnt}, outside /sys/fs/cgroup: nft cannot name it")
    n_etcd = a.etcd_members
    ports = pick_ports(2 * len(NODES) + 2 * n_etcd)
    nodes = [{"name": name, "port": ports[2 * i], "rest": ports[2 * i + 1]} for i, name in enumerate(NODES)]
    base = 2 * len(NODES)
    etcd = [{"name": f"e{i + 1}", "client": ports[base + 2 * i], "peer": ports[base + 2 * i + 1]}
            for i in range(n_etcd)]
    s = {"dir": d, "scope": scope, "supervisor_pid": os.getpid(),
         "supervisor_start": pid_start(os.getpid()), "watch_pid": watch, "watch_start": pid_start(watch),
         "cgroup": cgroup, "cgroup_level": depth + 2, "nft_table": f"ssp_{scope}",
         "synchronous_mode": not a.async_mode, "ttl": a.ttl, "loop_wait": a.loop_wait,
         "retry_timeout": a.retry_timeout, "patroni": a.patroni,
         "patroni_version": run([a.patroni, "--version"]).stdout.strip(), "nodes": nodes, "etcd": etcd, "partitioned": None,
         "pgbouncer": None, "down": False}
    with open(os.path.join(d, STATE), "w") as f:
        json.dump(s, f)
    c = Cluster(d)
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    watch_start = s["watch_start"]

    def abort():
        if stop["now"]:
            raise Fail("stopped by a signal while starting")
        if watch and (not pid_alive(watch) or pid_start(watch) != watch_start):
            raise Fail(f"the watched process {watch} is gone")
    ABORT[0] = abort

    try:
        for sub in [""] + [n["name"] for n in nodes] + [e["name"] for e in etcd] + ["pgb"]:
            os.makedirs(c.cg(sub), exist_ok=True)
        for e in etcd:
            c.start_etcd(e)
        deadline = time.time() + a.timeout
        while True:
            reap()
            ok = 0
            for e in etcd:
                try:
                    st, js = http("GET", f"http://{HOST}:{e['client']}/health", timeout=1)
                    ok += st == 200 and isinstance(js, dict) and js.get("health") == "true"
                except OSError:
                    pass
            if ok == n_etcd:
                break
            if time.time() > deadline:
                raise Fail(f"etcd not healthy after {a.timeout}s: see {d}/e*.log")
            time.sleep(0.3)
        for n in nodes:
            ndir = os.path.join(d, n["name"])
            os.makedirs(ndir, exist_ok=True)
            c.write_patroni_config(n)
            run(["chown", "-R", "postgres:postgres", ndir])
            os.chmod(ndir, 0o700)
        for n in nodes:
            c.start_node(n)
        c.save()
        # The leader first, then the database, then full health.
        while True:
            reap()
            leader, _, _ = c.dcs()
            if leader:
                r = c.rest(c.node(leader))
                if r and r.get("role") in ("master", "primary") and r.get("state") == "running":
                    break
            if time.time() > deadline:
                raise Fail(f"no leader after {a.timeout}s: see {d}/n*.log")
            time.sleep(0.5)
        lp = c.node(leader)["port"]
        r = psql(lp, "SELECT 1 FROM pg_database WHERE datname = 'test'")
        if r.stdout.strip() != "1":
            psql(lp, "CREATE DATABASE test")
        st = c.wait_healthy(max(10, deadline - time.time()))
        ports_ = [n["port"] for n in nodes]
        hosts = ",".join(f"{HOST}:{p}" for p in ports_)
        ready = {"dir": d, "scope": scope, "supervisor_pid": os.getpid(),
                 "synchronous_mode": s["synchronous_mode"],
                 "nodes": [{"name": n["name"], "host": HOST, "port": n["port"], "rest": f"{HOST}:{n['rest']}"}
                           for n in nodes],
                 "etcd": c.etcd_endpoints(), "leader": st["leader"], "sync_standby": st["sync_standby"],
                 "timeline": st["timeline"], "patroni": s["patroni_version"],
                 "url": f"postgres://postgres@{hosts}/test?target_session_attrs=read-write",
                 "kv": (f"host={','.join(HOST for _ in ports_)} port={','.join(map(str, ports_))} "
                        f"user=postgres dbname=test target_session_attrs=read-write"),
                 "seconds": round(time.time() - t0, 1)}
        with open(os.path.join(d, READY), "w") as f:
            f.write(json.dumps(ready, sort_keys=True) + "\n")
        emit(ready)
        ABORT[0] = lambda: None
    except BaseException as e:
        ABORT[0] = lambda: None
        msg = str(e) if isinstance(e, Fail) else f"{type(e).__name__}: {e}"
        log(f"up failed: {msg}")
        try:
            c.teardown()
        finally:
            try:
                emit({"error": msg, "dir": d})
            except Exception:
                pass
        sys.exit(1)

    serve(c, watch, stop)


def serve(c, watch, stop):
    """The supervisor's loop: one command at a time, in this (main) thread, so
    that every process it starts keeps a live parent thread (--pdeathsig)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + c.s["scope"])
    sock.listen(16)
    watch_start = c.s.get("watch_start")
    reason = "down"
    while True:
        reap()
        if stop["now"]:
            reason = "signal"
            break
        if watch and (not pid_alive(watch) or pid_start(watch) != watch_start):
            reason = f"the watched process {watch} is gone"
            break
        try:
            r, _, _ = select.select([sock], [], [], 0.5)
        except InterruptedError:
            continue
        if not r:
            continue
        conn, _ = sock.accept()
        conn.settimeout(30)
        try:
            req = json.loads(conn.makefile().readline())
            c.s = Cluster(c.dir).s
            try:
                resp = handle(c, req)
            except Fail as e:
                resp = {"error": str(e)}
            except Exception as e:  # keep supervising whatever a command did
                resp = {"error": f"{type(e).__name__}: {e}"}
            conn.sendall((json.dumps(resp, sort_keys=True) + "\n").encode())
            if req.get("cmd") == "down":
                conn.close()
                return finish(c, sock, "down", req.get("purge"))
        except (OSError, ValueError) as e:
            log(f"control connection: {e}")
        finally:
            conn.close()
    finish(c, sock, reason, False)


def finish(c, sock, reason, purge):
    log(f"tearing down: {reason}")
    sock.close()
    c.teardown(purge=bool(purge))
    reap()
    sys.exit(0)


def handle(c, req):
    cmd = req["cmd"]
    if cmd == "status":
        return c.status()
    if cmd == "down":
        return {"down": c.dir}
    if cmd in ("kill-primary", "kill-node"):
        n = c.leader() if cmd == "kill-primary" else c.node(req["name"])
        at = time.time()
        c.cg_kill(n["name"])
        n["killed"] = True
        c.save()
        return {"killed": n["name"], "at": at}
    if cmd == "start-node":
        n = c.node(req["name"])
        if c.cg_pids(n["name"]):
            return {"started": None, "running": n["name"]}
        c.start_node(n)
        c.save()
        return {"started": n["name"]}
    if cmd in ("partition-primary", "partition-node"):
        n = c.leader() if cmd == "partition-primary" else c.node(req["name"])
        c.partition(n["name"])
        return {"partitioned": n["name"], "at": time.time()}
    if cmd == "kill-etcd-member":
        if req.get("name"):
            e = next((x for x in c.s["etcd"] if x["name"] == req["name"]), None)
            if not e:
                raise Fail(f"no etcd member {req['name']!r}")
        else:
            e = c.etcd_raft_leader() or next((x for x in c.s["etcd"] if not x.get("killed")), None)
        if not e:
            raise Fail("no etcd member left to kill")
        c.cg_kill(e["name"])
        e["killed"] = True
        c.save()
        return {"killed_etcd": e["name"], "endpoint": f"{HOST}:{e['client']}", "at": time.time()}
    if cmd == "heal":
        healed = {"partition": c.s.get("partitioned"), "nodes": [], "etcd": []}
        c.unpartition()
        for e in c.s["etcd"]:
            if e.get("killed") or not c.cg_pids(e["name"]):
                c.start_etcd(e)
                healed["etcd"].append(e["name"])
        for n in c.nodes:
            if n.get("killed") or not c.cg_pids(n["name"]):
                c.start_node(n)
                healed["nodes"].append(n["name"])
        c.save()
        return healed
    if cmd == "switchover":
        leader, sync, _ = c.dcs()
        if not leader:
            raise Fail("no leader to switch over from")
        body = {"leader": leader}
        cand = req.get("to") or (sync if c.s["synchronous_mode"] else None)
        if cand:
            body["candidate"] = cand
        at = time.time()
        status, js = http("POST", f"http://{HOST}:{c.node(leader)['rest']}/switchover", body, timeout=60)
        if status != 200:
            raise Fail(f"switchover refused: HTTP {status}: {js}")
        return {"from": leader, "candidate": cand, "answer": js, "at": at}
    if cmd == "pgbouncer":
        return c.start_pgbouncer(req.get("pool_mode") or "transaction", req.get("ignore") or "")
    raise Fail(f"unknown command {cmd}")


# --------------------------------------------------------------------------- client side


def ask(d, req, timeout=120):
    c = Cluster(d)
    if c.s.get("down"):
        raise Fail(f"the cluster in {c.dir} is down")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect("\0" + c.s["scope"])
    except OSError as e:
        raise Fail(f"the supervisor of {c.dir} does not answer ({e}); run `down` to clean up")
    s.sendall((json.dumps(req) + "\n").encode())
    line = s.makefile().readline()
    s.close()
    if not line:
        raise Fail("the supervisor closed the connection without an answer")
    resp = json.loads(line)
    if "error" in resp:
        raise Fail(resp["error"])
    return resp


def wait_leader_change(d, old, timeout):
    c = Cluster(d)
    t0 = time.time()
    while time.time() - t0 < timeout:
        leader, _, _ = c.dcs()
        if leader and leader != old:
            r = c.rest(c.node(leader))
            if r and r.get("role") in ("master", "primary") and r.get("state") == "running":
                return leader, time.time()
        time.sleep(0.2)
    raise Fail(f"no new leader within {timeout}s")


def down_stale():
    """Clusters whose supervisor died without tearing down (SIGKILL): their
    Patroni and etcd died with it (pdeathsig) but postmasters may linger."""
    try:
        mnt, _ = cgroup2_mount()
    except Fail:
        return []
    root = os.path.join(mnt, CG_NAME)
    gone = []
    if not os.path.isdir(root):
        return gone
    for scope in os.listdir(root):
        path = os.path.join(root, scope)
        if not os.path.isdir(path) or not scope.startswith("ss"):
            continue
        try:
            pid = int(scope[2:].split("x")[0])
        except ValueError:
            continue
        if pid_alive(pid):
            try:
                if "cluster.py" in open(f"/proc/{pid}/cmdline").read():
                    continue
            except OSError:
                pass
        try:
            with open(os.path.join(path, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass
        time.sleep(0.3)
        for sub in sorted(os.listdir(path), reverse=True):
            if os.path.isdir(os.path.join(path, sub)):
                try:
                    os.rmdir(os.path.join(path, sub))
                except OSError:
                    pass
        try:
            os.rmdir(path)
        except OSError:
            pass
        subprocess.run(["nft", "delete", "table", "inet", f"ssp_{scope}"], capture_output=True)
        gone.append(scope)
    return gone


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up")
    up.add_argument("dir")
    up.add_argument("--async", dest="async_mode", action="store_true",
                    help="synchronous_mode: false (the negative control)")
    up.add_argument("--etcd-members", type=int, choices=(1, 3), default=3)
    up.add_argument("--ttl", type=int, default=15)
    up.add_argument("--loop-wait", type=int, default=3)
    up.add_argument("--retry-timeout", type=int, default=5)
    up.add_argument("--timeout", type=float, default=300)
    up.add_argument("--watch-pid", type=int, default=None,
                    help="tear down when this process ends (default: the parent; 0: never)")
    up.add_argument("--detach", action="store_true")
    up.add_argument("--patroni", default=os.environ.get("STATESEAL_PATRONI", "patroni"),
                    help="the patroni executable (default: $STATESEAL_PATRONI, else patroni on PATH)")
    for name in ("status", "partition-primary", "down-stale"):
        p = sub.add_parser(name)
        if name != "down-stale":
            p.add_argument("dir")
    for name in ("wait-ready", "wait-healthy"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        p.add_argument("--timeout", type=float, default=300)
        p.add_argument("--nodes", type=int, default=3)
    p = sub.add_parser("kill-primary")
    p.add_argument("dir")
    p.add_argument("--wait", action="store_true", help="until another node leads; prints the seconds")
    p.add_argument("--timeout", type=float, default=180)
    for name in ("kill-node", "start-node", "partition-node"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        p.add_argument("name")
    p = sub.add_parser("switchover")
    p.add_argument("dir")
    p.add_argument("--to")
    p.add_argument("--timeout", type=float, default=120)
    p = sub.add_parser("kill-etcd-member")
    p.add_argument("dir")
    p.add_argument("name", nargs="?")
    p = sub.add_parser("heal")
    p.add_argument("dir")
    p.add_argument("--wait", action="store_true")
    p.add_argument("--timeout", type=float, default=300)
    p = sub.add_parser("pgbouncer")
    p.add_argument("dir")
    p.add_argument("--pool-mode", default="transaction", choices=("session", "transaction", "statement"))
    p.add_argument("--ignore-startup-parameters", default="")
    p = sub.add_parser("down")
    p.add_argument("dir")
    p.add_argument("--purge", action="store_true", help="also remove DIR")
    a = ap.parse_args()

    try:
        if a.cmd == "up":
            cmd_up(a)
        elif a.cmd == "down-stale":
            out({"torn_down": down_stale()})
        elif a.cmd == "wait-ready":
            path = os.path.join(os.path.abspath(a.dir), READY)
            t0 = time.time()
            while not os.path.exists(path):
                if time.time() - t0 > a.timeout:
                    raise Fail(f"no {path} after {a.timeout}s")
                st = os.path.join(os.path.abspath(a.dir), STATE)
                if os.path.exists(st) and time.time() - t0 > 5:
                    s = json.load(open(st))
                    if s.get("down") or not pid_alive(s.get("supervisor_pid")):
                        raise Fail("the supervisor ended before the cluster was ready")
                time.sleep(0.3)
            sys.stdout.write(open(path).read())
        elif a.cmd == "status":
            out(Cluster(a.dir).status())
        elif a.cmd == "wait-healthy":
            t0 = time.time()
            st = Cluster(a.dir).wait_healthy(a.timeout, a.nodes)
            st["seconds"] = round(time.time() - t0, 2)
            out(st)
        elif a.cmd == "kill-primary":
            r = ask(a.dir, {"cmd": "kill-primary"})
            if a.wait:
                new, t = wait_leader_change(a.dir, r["killed"], a.timeout)
                r.update(new_leader=new, seconds=round(t - r["at"], 2))
            out(r)
        elif a.cmd in ("kill-node", "start-node", "partition-node"):
            out(ask(a.dir, {"cmd": a.cmd, "name": a.name}))
        elif a.cmd == "partition-primary":
            out(ask(a.dir, {"cmd": a.cmd}))
        elif a.cmd == "switchover":
            r = ask(a.dir, {"cmd": "switchover", "to": a.to}, timeout=a.timeout)
            new, t = wait_leader_change(a.dir, r["from"], a.timeout)
            r.update(new_leader=new, seconds=round(t - r["at"], 2))
            out(r)
        elif a.cmd == "kill-etcd-member":
            out(ask(a.dir, {"cmd": a.cmd, "name": a.name}))
        elif a.cmd == "heal":
            r = ask(a.dir, {"cmd": "heal"})
            if a.wait:
                t0 = time.time()
                st = Cluster(a.dir).wait_healthy(a.timeout)
                r.update(leader=st["leader"], sync_standby=st["sync_standby"], seconds=round(time.time() - t0, 2))
            out(r)
        elif a.cmd == "pgbouncer":
            out(ask(a.dir, {"cmd": "pgbouncer", "pool_mode": a.pool_mode,
                            "ignore": a.ignore_startup_parameters}))
        elif a.cmd == "down":
            d = os.path.abspath(a.dir)
            if not os.path.exists(os.path.join(d, STATE)):
                out({"down": d, "note": "no cluster here"})
                return
            c = Cluster(d)
            sup = c.s.get("supervisor_pid")
            if not c.s.get("down") and pid_alive(sup) and pid_start(sup) == c.s.get("supervisor_start"):
                try:
                    ask(d, {"cmd": "down", "purge": False}, timeout=60)
                except Fail:
                    pass
                t0 = time.time()
                while pid_alive(sup) and time.time() - t0 < 30:
                    time.sleep(0.1)
                if pid_alive(sup):
                    os.kill(sup, signal.SIGKILL)
            # Whatever the supervisor did, make sure (idempotent).
            c = Cluster(d)
            c.teardown(purge=a.purge)
            out({"down": d})
    except Fail as e:
        out({"error": str(e)})
        sys.exit(1)


if __name__ == "__main__":
    main()
