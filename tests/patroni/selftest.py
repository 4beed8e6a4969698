#!/usr/bin/env python3
"""End-to-end check of cluster.py: every subcommand, and that each fault does
what it claims. Exits non-zero at the first broken claim. Root, ~3-4 minutes.

    selftest.py [--patroni PATH] [--keep DIR]

Claims checked:
  up           a leader, two streaming standbys, a synchronous one; writes work
               through the multi-host URL (psql, target_session_attrs=read-write)
  partition    the old primary stays reachable from a client (its port answers
               SELECT 1), yet its standbys stop streaming from it and its Patroni
               loses etcd: it demotes itself (pg_is_in_recovery() = t) and another
               node leads; the nft table exists while partitioned
  heal         the table is gone, all three nodes stream again
  kill-primary the node's cgroup is empty (Patroni, postmaster, backends gone);
               another node leads; writes work again
  kill-etcd    etcd's raft leader dies; Patroni keeps its leader, writes work
  switchover   the leader changes to the synchronous standby
  down         no process, cgroup, nft table or SysV segment of the cluster is
               left; a second down is harmless
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PSQL = "/usr/lib/postgresql/15/bin/psql"


def cli(*args, timeout=400):
    r = subprocess.run([sys.executable, os.path.join(HERE, "cluster.py"), *args],
                       capture_output=True, text=True, timeout=timeout)
    js = json.loads((r.stdout.strip().splitlines() or ["{}"])[-1])
    if r.returncode != 0 or "error" in js:
        raise AssertionError(f"cluster.py {' '.join(args)}: {js.get('error') or r.stderr}")
    return js


def psql(target, sql, timeout=30):
    env = dict(os.environ, PGCONNECT_TIMEOUT="3")
    return subprocess.run([PSQL, target, "-X", "-w", "-At", "-c", sql], capture_output=True,
                          text=True, timeout=timeout, env=env)


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        raise AssertionError(what)


def wait(pred, timeout, what, every=0.5):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(every)
    check(False, f"{what} (within {timeout}s)")


def node_url(node):
    return f"postgres://postgres@{node['host']}:{node['port']}/test"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--patroni", default=os.environ.get("STATESEAL_PATRONI", "patroni"))
    ap.add_argument("--keep", help="use this directory and keep its logs")
    a = ap.parse_args()
    d = a.keep or tempfile.mkdtemp(prefix="ssp-selftest-")
    os.makedirs(d, exist_ok=True)
    sup = subprocess.Popen([sys.executable, os.path.join(HERE, "cluster.py"), "up", d, "--patroni", a.patroni],
                           stdout=subprocess.PIPE, stderr=open(os.path.join(d, "..", os.path.basename(d) + ".err"), "w"),
                           text=True)
    passed = False
    ready = {}
    try:
        ready = json.loads(sup.stdout.readline() or "{}")
        check("url" in ready, f"up printed its JSON line ({ready.get('error', 'ready')}, {ready.get('seconds')} s)")
        nodes = {n["name"]: n for n in ready["nodes"]}
        url = ready["url"]
        check(psql(url, "CREATE TABLE st (id int PRIMARY KEY)").returncode == 0, "a write through the multi-host URL")
        st = cli("status", d)
        check(st["sync_standby"] and sum(r["state"] == "streaming" for r in st["replication"]) == 2,
              f"leader {st['leader']}, sync standby {st['sync_standby']}, 2 streaming")

        # partition
        old = st["leader"]
        cli("partition-primary", d)
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        check(f"ssp_{ready['scope']}" in tables, "the partition's nft table exists")
        check(psql(node_url(nodes[old]), "SELECT 1").stdout.strip() == "1",
              f"a client still reaches the partitioned {old}")
        wait(lambda: psql(node_url(nodes[old]), "SELECT pg_is_in_recovery()").stdout.strip() == "t", 120,
             f"the partitioned {old} demotes itself (lost etcd)")
        new = wait(lambda: (lambda s: s["leader"] not in (None, old) and s["leader"])(cli("status", d)), 120,
                   "another node leads")
        check(True, f"{new} leads")
        rows = psql(node_url(nodes[new]),
                    "SELECT count(*) FROM pg_stat_replication WHERE application_name = '%s'" % old).stdout.strip()
        check(rows == "0", f"{old} does not stream from the new leader while partitioned")
        check(psql(url, "INSERT INTO st VALUES (1)").returncode == 0, "a write through the URL after the failover")
        h = cli("heal", d, "--wait")
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        check(f"ssp_{ready['scope']}" not in tables, f"heal removed the table; healthy in {h['seconds']} s")

        # kill -9 of the primary
        old = cli("status", d)["leader"]
        k = cli("kill-primary", d, "--wait")
        cg = os.path.join(json.load(open(os.path.join(d, "cluster.json")))["cgroup"], old, "cgroup.procs")
        check(open(cg).read().strip() == "", f"kill-primary emptied {old}'s cgroup")
        check(k["new_leader"] != old, f"{k['new_leader']} leads {k['seconds']} s after the kill")
        wait(lambda: psql(url, "INSERT INTO st VALUES (2)").returncode == 0, 60, "a write after the kill")
        h = cli("heal", d, "--wait")
        check(True, f"{old} restarted and streams; healthy in {h['seconds']} s")

        # an etcd member
        before = cli("status", d)
        e = cli("kill-etcd-member", d)
        time.sleep(15)
        after = cli("status", d)
        check(after["leader"] == before["leader"] and after["timeline"] == before["timeline"],
              f"etcd {e['killed_etcd']} (raft leader) killed: Patroni's leader {after['leader']} unchanged")
        check(psql(url, "INSERT INTO st VALUES (3)").returncode == 0, "a write with one etcd member down")
        cli("heal", d, "--wait")

        # switchover
        st = cli("status", d)
        s = cli("switchover", d)
        check(s["new_leader"] == st["sync_standby"], f"switchover {s['from']} -> {s['new_leader']} in {s['seconds']} s")
        check(psql(url, "INSERT INTO st VALUES (4)").returncode == 0, "a write after the switchover")
        cli("wait-healthy", d)
        passed = True
    finally:
        cli("down", d)
        sup.wait(timeout=60)
        scope = json.load(open(os.path.join(d, "cluster.json")))["scope"]
        left = [ln for ln in subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True,
                                             text=True).stdout.splitlines()
                if d + "/" in ln or ready.get("scope", "?") in ln]
        check(not left, f"down: no process of the cluster left {left}")
        check(not os.path.exists(f"/sys/fs/cgroup/unified/stateseal-patroni/{scope}")
              and not os.path.exists(f"/sys/fs/cgroup/stateseal-patroni/{scope}"), "down: its cgroup is gone")
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        check(f"ssp_{scope}" not in tables, "down: no nft table")
        shm = subprocess.run(["ipcs", "-m"], capture_output=True, text=True).stdout.splitlines()
        check(not any(len(f.split()) >= 6 and f.split()[2] == "postgres" and f.split()[5] == "0" for f in shm),
              "down: no orphaned SysV segment owned by postgres")
        cli("down", d)
        check(True, "a second down is harmless")
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
    print("selftest: " + ("1 passed, 0 failed" if passed else "0 passed, 1 failed"))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
