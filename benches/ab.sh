#!/usr/bin/env bash
# Throughput of two server builds, alternated: each run starts the build on
# a fresh data directory on 127.0.0.1:50995 and drives it with the bundled
# load bench (against the no-op of the same server, in the same run).
#
#   benches/ab.sh OLD_BINARY NEW_BINARY [ROUNDS, default 2] [SCENARIOS, default flow,reserve]
#
# A build of another commit: git worktree add /tmp/old REV && (cd /tmp/old &&
# CARGO_TARGET_DIR=/tmp/old-target cargo build --release --bin stateseal).
# Give it a copy of this tree's build (cp target/release/stateseal /tmp/new):
# its `cargo bench --no-run` below rebuilds target/release/stateseal with the
# dev-dependencies' features (tokio's test-util).
set -euo pipefail
old=${1:?old binary}
new=${2:?new binary}
rounds=${3:-2}
scenarios=${4:-flow,reserve}
cd "$(dirname "$0")/.."
cargo bench --bench load --no-run >/dev/null 2>&1
data=$(mktemp -d)
trap 'rm -rf "$data"' EXIT
for round in $(seq 1 "$rounds"); do
  for which in old new; do
    bin=$old
    [ "$which" = new ] && bin=$new
    rm -rf "$data/d"
    "$bin" serve --listen 127.0.0.1:50995 --data-dir "$data/d" --max-ledger-records 0 >"$data/server.log" 2>&1 &
    pid=$!
    sleep 2
    echo "== $which, round $round ($bin)"
    cargo bench --bench load -- --addr 127.0.0.1:50995 --server-pid "$pid" --server-data-dir "$data/d" \
      --scenarios "$scenarios" --duration 3 --rounds 1 2>&1 | grep -E '^(scenario|noop|flow|reserve|reserve_carried|consume|open_reserve|commit|seal|seal_json|open) ' || true
    kill "$pid"
    wait "$pid" 2>/dev/null || true
  done
done
