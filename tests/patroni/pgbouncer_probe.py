#!/usr/bin/env python3
"""What the ledger's way of talking to PostgreSQL meets through PgBouncer, and
ways to recognise PgBouncer at start. Standard library only (pgwire.py).

    pgbouncer_probe.py CLUSTER_DIR       (after `cluster.py pgbouncer CLUSTER_DIR`)

Each check runs against PgBouncer and, as the control, directly against the
primary PgBouncer points at. Prints one JSON line per check.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pgwire import Conn, PgError  # noqa: E402


def report(check, target, **kw):
    print(json.dumps({"check": check, "target": target, **kw}, sort_keys=True), flush=True)


def attempt(fn):
    try:
        return {"ok": True, "result": fn()}
    except PgError as e:
        return {"ok": False, "error": str(e), "sqlstate": e.code}
    except (OSError, ConnectionError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def main():
    d = os.path.abspath(sys.argv[1])
    st = json.load(open(os.path.join(d, "cluster.json")))
    pgb = st["pgbouncer"]
    host, port = pgb["backend"].split(":")
    targets = {"pgbouncer": ("127.0.0.1", pgb["port"]), "direct": (host, int(port))}

    for name, (h, p) in targets.items():
        # 1. The startup options PgLedger::connect sends (tokio-postgres puts them in `options`).
        r = attempt(lambda: Conn(h, p, options="-c statement_timeout=1500 -c lock_timeout=1000 "
                                            "-c synchronous_commit=on").query("SHOW statement_timeout")[0])
        report("startup options (-c statement_timeout ...)", name, **r)

        # 2. tokio-postgres prepare()/prepare_cached(): Parse "s0" + Describe + Sync, then later
        #    Bind/Execute + Sync. A second client holds the server in a transaction in between.
        a, b = Conn(h, p), Conn(h, p)
        pid_a = a.query("SELECT pg_backend_pid()")[0][0][0]
        r_prep = attempt(lambda: a.prepare("s0", "SELECT 1")[1])
        if not r_prep["ok"]:
            # A server connection keeps what an earlier client (long gone) prepared.
            report("A prepares s0 on a fresh client connection", name, a_backend_pid=pid_a, **r_prep)
            a.query("DEALLOCATE s0")
            a.prepare("s0", "SELECT 1")
        b.query("BEGIN")
        pid_b = b.query("SELECT pg_backend_pid()")[0][0][0]
        r_exec = attempt(lambda: a.execute("s0")[0])
        r_dup = attempt(lambda: b.prepare("s0", "SELECT 2")[1])
        b.query("ROLLBACK")
        report("named statement s0 prepared by A, executed while B is in a transaction", name,
               a_backend_pid=pid_a, b_backend_pid_in_its_transaction=pid_b,
               a_execute_s0=r_exec, b_prepare_s0=r_dup)
        a.close()
        b.close()

        # 2b. Two processes' statements with the same name: B binds "s9" and runs A's statement.
        a, b, c = Conn(h, p), Conn(h, p), Conn(h, p)
        a.prepare("s9", "SELECT 'the statement A prepared'")
        c.query("BEGIN")                       # C takes the server A used
        b.prepare("s9", "SELECT 'the statement B prepared'")   # B: another server
        c.query("COMMIT")                      # A's server is free again, released last
        r = attempt(lambda: b.execute("s9")[0])
        report("B prepares s9, then executes s9", name, b_gets=r)
        for x in (a, b, c):
            x.close()

        # 3. query_typed(): unnamed statement, Parse/Bind/Describe/Execute in one Sync.
        a, b = Conn(h, p), Conn(h, p)
        b.query("BEGIN")
        r = attempt(lambda: a.unnamed("SELECT $1::int + 1", [41])[0])
        b.query("ROLLBACK")
        report("unnamed statement (query_typed) while another client is in a transaction", name, **r)
        a.close()
        b.close()

        # 4. Session state: SET outside a transaction (the ledger's VACUUM path) seen by another client.
        a, b = Conn(h, p), Conn(h, p)
        a.query("SET statement_timeout = 123456")
        leaked = b.query("SHOW statement_timeout")[0][0][0]
        a.query("RESET statement_timeout")
        report("SET by client A, SHOW by client B", name, b_sees=leaked)
        a.close()
        b.close()

        # Recognition (a): the process id of BackendKeyData against pg_backend_pid().
        c = Conn(h, p)
        real = int(c.query("SELECT pg_backend_pid()")[0][0][0])
        report("recognise: BackendKeyData pid vs pg_backend_pid()", name,
               backend_key_pid=c.backend_pid, pg_backend_pid=real, pooler=c.backend_pid != real,
               parameter_status=sorted(c.params))
        c.close()

        # Recognition (b): a second connection reuses the first one's server while the
        # first is still connected (transaction/statement pooling only). Only public SQL.
        a, b = Conn(h, p), Conn(h, p)
        hits = 0
        for _ in range(5):
            pa = a.query("SELECT pg_backend_pid()")[0][0][0]
            pb = b.query("SELECT pg_backend_pid()")[0][0][0]
            hits += pa == pb
        report("recognise: two open connections, same backend pid", name, rounds=5, same_pid_rounds=hits,
               transaction_pooling=hits > 0)
        a.close()
        b.close()

        # Recognition (c): the admin console database name.
        r = attempt(lambda: Conn(h, p, database="pgbouncer").query("SHOW VERSION")[0])
        report("recognise: connect to database 'pgbouncer', SHOW VERSION", name, **r)
        r = attempt(lambda: Conn(h, p, user="stateseal", database="pgbouncer").query("SHOW VERSION")[0])
        report("recognise: database 'pgbouncer' as a user not in admin_users/stats_users", name, **r)


if __name__ == "__main__":
    main()
