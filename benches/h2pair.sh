#!/usr/bin/env bash
# Paired h2load runs: every server called in turn, scenario by scenario,
# round after round, so each comparison is between runs seconds apart. On a
# shared machine, where one call's CPU moves by ±30% between runs, the
# medians of these pairs say more than any one run of benches/h2load.sh.
#
#   benches/h2pair.sh [ROUNDS] [REQUESTS]     (defaults: 16 rounds, 40000 requests)
#
# Servers, each on its own temporary data directory with one keyset: `plain`
# and `audited` (closed mode, every Seal logged) of this build
# (STATESEAL_BIN, or target/release/stateseal); with OLD_BIN=PATH also
# `old` (that build, unaudited). SCENARIOS (default "seal open") picks the
# calls. Needs h2load (Debian: nghttp2-client); loopback only.
#
# Prints each run (round, scenario, server, calls/s, server CPU µs per call
# from /proc/PID/stat), then per scenario the median and quartiles of each
# server's CPU per call, and of each pair, round by round: audited against
# plain (calls/s ratio, CPU added) and, with OLD_BIN, plain against old.
set -euo pipefail
ROUNDS=${1:-16}
REQUESTS=${2:-40000}
SCENARIOS=${SCENARIOS:-seal open}
cd "$(dirname "$0")/.."

. benches/h2common.sh
h2_require h2load:nghttp2-client
h2_start_server # the bodies and the keyset; its own server is `plain`

declare -A SPID SADDR
SERVERS=(plain audited)
SPID[plain]=$PID
SADDR[plain]=127.0.0.1:$PORT

# start NAME BINARY [FLAGS...]: one more server on the same keyset.
start() {
    h2_start_another "$@" || { echo "$1 did not start:" >&2; cat "$WORK/$1.log" >&2; exit 1; }
    SPID[$1]=$H2_PID
    SADDR[$1]=$H2_ADDR
}
start audited "$SERVER" --audit-log "$WORK/audit.log" --audit-sample-seals 1
if [ -n "${OLD_BIN:-}" ]; then
    start old "$OLD_BIN"
    SERVERS+=(old)
fi

# Warm-up: each server's connections, caches and allocator pages.
for s in "${SERVERS[@]}"; do
    for sc in $SCENARIOS; do h2_run "$sc" "${SADDR[$s]}" 10000; done
done

printf '%-6s %-6s %-8s %10s %12s\n' round call server calls/s "CPU µs/call"
for r in $(seq "$ROUNDS"); do
    for sc in $SCENARIOS; do
        for s in "${SERVERS[@]}"; do
            t0=$(h2_ticks "${SPID[$s]}")
            h2_run "$sc" "${SADDR[$s]}" "$REQUESTS"
            t1=$(h2_ticks "${SPID[$s]}")
            rate=$(h2_rate)
            cpu=$(h2_cpu_per_call $((t1 - t0)) "$REQUESTS" 2)
            printf '%-6s %-6s %-8s %10.0f %12s\n' "$r" "$sc" "$s" "$rate" "$cpu"
            echo "$r $sc $s $rate $cpu" >>"$WORK/rows"
        done
    done
done

echo
python3 - "$WORK/rows" <<'EOF'
import collections, statistics, sys

runs = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    r, sc, s, rate, cpu = line.split()
    runs[sc, int(r)][s] = (float(rate), float(cpu))
calls = list(dict.fromkeys(sc for sc, _ in runs))

def summary(values, fmt):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{fmt.format(statistics.median(values))} ({fmt.format(q[0])} to {fmt.format(q[2])})"

print(f"{'call':6} {'server or pair':20} {'calls/s ratio, median (quartiles)':>36} {'CPU µs/call':>28}")
for sc in calls:
    rounds = [v for (c, _), v in sorted(runs.items()) if c == sc]
    for s in rounds[0]:
        print(f"{sc:6} {s:20} {'':>36} {summary([v[s][1] for v in rounds], '{:.2f}'):>28}")
    for a, b, label in (("audited", "plain", "audited ÷ plain"), ("plain", "old", "plain ÷ old")):
        pairs = [v for v in rounds if a in v and b in v]
        if not pairs:
            continue
        ratio = summary([v[a][0] / v[b][0] for v in pairs], "{:.3f}")
        added = summary([v[a][1] - v[b][1] for v in pairs], "{:+.2f}")
        print(f"{sc:6} {label:20} {ratio:>36} {added:>28}")
EOF
