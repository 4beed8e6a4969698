#!/usr/bin/env bash
# Server instructions per call under callgrind: a count, not a time, so two
# builds compare on a busy machine (valgrind counts the same instructions
# whatever else runs). One release server under `valgrind --tool=callgrind`
# on a temporary directory (loopback only); per scenario the counters are
# zeroed, h2load sends REQUESTS calls, and the dump's total is divided by
# them (every thread of the server: h2, tonic, the ledger writer).
#
#   benches/h2callgrind.sh [REQUESTS]                              (default 3000)
#   STATESEAL_BIN=/path/to/other/stateseal benches/h2callgrind.sh   (another build)
#
# Prints "scenario instructions-per-call" for noop, seal, seal_json, open,
# and noop again (the spread between the two noops is the noise).
set -euo pipefail
REQUESTS=${1:-3000}
cd "$(dirname "$0")/.."

. benches/h2common.sh
h2_require h2load:nghttp2-client valgrind:valgrind callgrind_control:valgrind
h2_start_server valgrind --tool=callgrind '--callgrind-out-file={WORK}/cg.%p'
for sc in noop seal seal_json open noop; do
    callgrind_control --zero "$PID" >/dev/null 2>&1
    h2_run "$sc" "127.0.0.1:$PORT" "$REQUESTS" -c 1 -m 8
    rm -f "$WORK"/cg.*.*
    callgrind_control --dump="$sc" "$PID" >/dev/null 2>&1
    for _ in $(seq 50); do
        ls "$WORK"/cg.*.* >/dev/null 2>&1 && break
        sleep 0.1
    done
    sleep 0.5
    f=$(ls -t "$WORK"/cg.*.* | head -1)
    ir=$(sed -n 's/^\(summary\|totals\): *\([0-9]*\).*/\2/p' "$f" | head -1)
    printf '%-10s %8d\n' "$sc" $((ir / REQUESTS))
done
