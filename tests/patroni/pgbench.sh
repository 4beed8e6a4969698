#!/usr/bin/env bash
# pgbench's single-row insert (INSERT ... ON CONFLICT DO NOTHING, random
# bigint key) on the primary of a cluster started by cluster.py, and on a
# single PostgreSQL 15 node with the same settings, for comparison.
#
#   tests/patroni/pgbench.sh CLUSTER_DIR [SECONDS] [CLIENTS...]
#
# CLUSTER_DIR holds a running cluster (its ready.json); the single node is
# made in CLUSTER_DIR.single and removed afterwards. Prints one line per run:
#   target=<sync-cluster|async-cluster|single> clients=N tps=X latency_ms=Y
set -euo pipefail
BIN=/usr/lib/postgresql/15/bin
HERE="$(cd "$(dirname "$0")" && pwd)"
dir="$(cd "$1" && pwd)"
secs="${2:-10}"
shift $(( $# >= 2 ? 2 : 1 ))
clients=("$@")
[ ${#clients[@]} -gt 0 ] || clients=(8 32)

script="$dir/pgbench-insert.sql"
cat >"$script" <<'SQL'
\set id random(1, 1000000000000)
INSERT INTO t VALUES (:id) ON CONFLICT DO NOTHING;
SQL
chmod 644 "$script"

leader_port() {
  python3 "$HERE/cluster.py" status "$dir" | python3 -c '
import json, sys
s = json.load(sys.stdin)
print(next(m["port"] for m in s["members"] if m["name"] == s["leader"]))'
}
mode="$(python3 -c 'import json,sys; print("sync" if json.load(open(sys.argv[1]))["synchronous_mode"] else "async")' "$dir/ready.json")"

# The single node: same initdb options and parameters as the Patroni nodes.
single="$dir.single"
sport="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
rm -rf "$single"; mkdir -p "$single"; chown postgres:postgres "$single"; chmod 700 "$single"
cleanup() { setpriv --reuid=postgres --regid=postgres --init-groups "$BIN/pg_ctl" -D "$single/data" -m immediate stop >/dev/null 2>&1 || true; rm -rf "$single"; }
trap cleanup EXIT
setpriv --reuid=postgres --regid=postgres --init-groups "$BIN/initdb" -D "$single/data" -U postgres \
  --auth=trust --encoding=UTF8 --locale=C.UTF-8 --data-checksums >/dev/null
setpriv --reuid=postgres --regid=postgres --init-groups "$BIN/pg_ctl" -D "$single/data" -w -l "$single/log" \
  -o "-c listen_addresses=127.0.0.1 -c port=$sport -c unix_socket_directories='' -c shared_buffers=64MB \
      -c max_connections=120 -c wal_level=replica -c wal_log_hints=on -c synchronous_commit=on" start >/dev/null
"$BIN/psql" -X -q -h 127.0.0.1 -p "$sport" -U postgres -d postgres -c 'CREATE DATABASE test'

run() { # target port clients
  "$BIN/psql" -X -q -h 127.0.0.1 -p "$2" -U postgres -d test \
    -c 'CREATE TABLE IF NOT EXISTS t (id bigint PRIMARY KEY)' -c 'TRUNCATE t' -c 'CHECKPOINT'
  out="$("$BIN/pgbench" -n -h 127.0.0.1 -p "$2" -U postgres -c "$3" -j 2 -T "$secs" -f "$script" test 2>&1)"
  tps="$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out")"
  lat="$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' <<<"$out")"
  echo "target=$1 clients=$3 seconds=$secs tps=$tps latency_ms=$lat"
}
for c in "${clients[@]}"; do
  run "$mode-cluster" "$(leader_port)" "$c"
  run single "$sport" "$c"
done
