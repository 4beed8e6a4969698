#!/usr/bin/env python3
"""Measurements on a cluster started by cluster.py (standard library only).

    measure.py failover DIR [--runs 3] [--fault kill|partition|switchover]
        Time from the fault on the primary to the first successful write
        (INSERT ... ON CONFLICT DO NOTHING) through the multi-host URL with
        target_session_attrs=read-write, by psql in a loop (one new connection
        per try, PGCONNECT_TIMEOUT=2). Heals and waits for full health between runs.

    measure.py loss DIR [--writers 8] [--before 5] [--after 10] [--runs 1] [--fault kill|partition]
        Writers insert unique ids through the multi-host URL (own wire client,
        autocommit); an id is "acknowledged" when its CommandComplete arrived.
        The primary is killed (-9, whole node) or partitioned from its standbys
        and etcd (clients still reach it) mid-stream; after the failover
        the acknowledged ids are looked up on the new primary. Prints the count
        of acknowledged ids missing there.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pgwire  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PSQL = "/usr/lib/postgresql/15/bin/psql"


def cluster(*args, timeout=400):
    r = subprocess.run([sys.executable, os.path.join(HERE, "cluster.py"), *args],
                       capture_output=True, text=True, timeout=timeout)
    line = (r.stdout.strip().splitlines() or ["{}"])[-1]
    js = json.loads(line)
    if r.returncode != 0 or "error" in js:
        raise SystemExit(f"cluster.py {' '.join(args)}: {js.get('error', r.stderr)}")
    return js


def psql(url, sql, timeout=10):
    env = dict(os.environ, PGCONNECT_TIMEOUT="2")
    return subprocess.run([PSQL, url, "-X", "-w", "-At", "-v", "ON_ERROR_STOP=1", "-c", sql],
                          capture_output=True, text=True, timeout=timeout, env=env)


def failover(a):
    ready = json.load(open(os.path.join(a.dir, "ready.json")))
    url = ready["url"]
    r = psql(url, "CREATE TABLE IF NOT EXISTS failover_probe (id bigint PRIMARY KEY)")
    assert r.returncode == 0, r.stderr
    results = []
    i = 0
    for run in range(a.runs):
        cluster("wait-healthy", a.dir, "--timeout", "300")
        # Writes succeed before the fault.
        for _ in range(3):
            i += 1
            r = psql(url, f"INSERT INTO failover_probe VALUES ({i}) ON CONFLICT DO NOTHING")
            assert r.returncode == 0, r.stderr
        victim_name = cluster("status", a.dir)["leader"]
        victim_port = next(n["port"] for n in ready["nodes"] if n["name"] == victim_name)
        box = {}
        if a.fault == "kill":
            at = cluster("kill-primary", a.dir)["at"]
        elif a.fault == "partition":
            at = cluster("partition-primary", a.dir)["at"]
        else:
            # The switchover call blocks until Patroni reports it done: in a
            # thread, while the writes go on.
            at = time.time()
            th = threading.Thread(target=lambda: box.update(cluster("switchover", a.dir)))
            th.start()
        tries, errors, on_victim = 0, {}, 0
        while True:
            i += 1
            tries += 1
            r = psql(url, f"INSERT INTO failover_probe VALUES ({i}) ON CONFLICT DO NOTHING; "
                          "SELECT inet_server_port()", timeout=60)
            now = time.time()
            if r.returncode == 0:
                port = int(r.stdout.split()[-1])
                if port != victim_port:
                    break
                on_victim += 1  # the old primary, before the fault took effect
            else:
                key = (r.stderr.strip().splitlines() or ["?"])[-1][:160]
                errors[key] = errors.get(key, 0) + 1
            time.sleep(0.05)
            if now - at > 300:
                raise SystemExit("no successful write within 300 s")
        if a.fault == "switchover":
            th.join()
        st = cluster("status", a.dir)
        res = {"run": run + 1, "fault": a.fault, "victim": victim_name,
               "seconds_to_first_write": round(now - at, 2), "tries": tries,
               "writes_on_old_primary_after_fault": on_victim, "new_leader": st["leader"],
               "timeline": st["timeline"], "errors_seen": errors}
        if a.fault == "switchover":
            res["patroni_switchover_seconds"] = box.get("seconds")
        print(json.dumps(res, sort_keys=True), flush=True)
        results.append(res)
        h = cluster("heal", a.dir, "--wait", "--timeout", "300")
        print(json.dumps({"healed_in_seconds": h.get("seconds")}), flush=True)
    secs = [r["seconds_to_first_write"] for r in results]
    print(json.dumps({"summary": a.fault, "runs": secs, "min": min(secs), "max": max(secs),
                      "mean": round(sum(secs) / len(secs), 2)}), flush=True)


def loss(a):
    ready = json.load(open(os.path.join(a.dir, "ready.json")))
    hosts = [(n["host"], n["port"]) for n in ready["nodes"]]
    c = pgwire.connect_read_write(hosts)
    c.query("CREATE TABLE IF NOT EXISTS loss_probe (id bigint PRIMARY KEY)")
    c.close()
    totals = []
    for run in range(a.runs):
        cluster("wait-healthy", a.dir, "--timeout", "300")
        acked = [[] for _ in range(a.writers)]
        failed = [0] * a.writers
        stop = threading.Event()

        def writer(w):
            seq = 0
            conn = None
            while not stop.is_set():
                try:
                    if conn is None:
                        conn = pgwire.connect_read_write(hosts, timeout=3)
                    seq += 1
                    ident = (run + 1) * 10**12 + w * 10**9 + seq
                    _, tag = conn.query(f"INSERT INTO loss_probe VALUES ({ident}) ON CONFLICT DO NOTHING")
                    if tag == "INSERT 0 1":
                        acked[w].append(ident)
                except (OSError, ConnectionError, pgwire.PgError):
                    failed[w] += 1
                    if conn is not None:
                        try:
                            conn.close()
                        except OSError:
                            pass
                    conn = None
                    time.sleep(0.05)
            if conn is not None:
                conn.close()

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(a.writers)]
        for t in threads:
            t.start()
        time.sleep(a.before)
        before = sum(len(x) for x in acked)
        if a.fault == "kill":
            k = cluster("kill-primary", a.dir)
        else:
            k = cluster("partition-primary", a.dir)
            k["killed"] = k["partitioned"]
        # Until a new primary takes writes, then a while longer.
        t0 = time.time()
        while time.time() - t0 < 300:
            n = sum(len(x) for x in acked)
            time.sleep(0.5)
            if sum(len(x) for x in acked) > n and cluster("status", a.dir)["leader"] not in (None, k["killed"]):
                break
        time.sleep(a.after)
        stop.set()
        for t in threads:
            t.join()
        all_acked = [i for x in acked for i in x]
        st = cluster("status", a.dir)
        # Read on the new leader itself (an isolated old primary may still be read-write).
        lp = next(n["port"] for n in ready["nodes"] if n["name"] == st["leader"])
        c = pgwire.Conn("127.0.0.1", lp)
        rows, _ = c.query(f"SELECT id FROM loss_probe WHERE id >= {(run + 1) * 10**12} AND id < {(run + 2) * 10**12}")
        c.close()
        present = {int(r[0]) for r in rows}
        lost = [i for i in all_acked if i not in present]
        res = {"run": run + 1, "synchronous_mode": ready["synchronous_mode"], "fault": a.fault,
               "victim": k["killed"],
               "new_leader": st["leader"], "acked": len(all_acked), "acked_before_kill": before,
               "present_on_new_primary": len(present), "acked_but_lost": len(lost),
               "lost_sample": sorted(lost)[:5], "failed_statements": sum(failed)}
        print(json.dumps(res, sort_keys=True), flush=True)
        totals.append(len(lost))
        cluster("heal", a.dir, "--wait", "--timeout", "300")
    print(json.dumps({"summary": "loss", "synchronous_mode": ready["synchronous_mode"], "lost_per_run": totals}),
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("failover")
    p.add_argument("dir")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--fault", choices=("kill", "partition", "switchover"), default="kill")
    p = sub.add_parser("loss")
    p.add_argument("dir")
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--before", type=float, default=5)
    p.add_argument("--after", type=float, default=10)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--fault", choices=("kill", "partition"), default="kill")
    a = ap.parse_args()
    {"failover": failover, "loss": loss}[a.cmd](a)


if __name__ == "__main__":
    main()
