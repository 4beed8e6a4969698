#!/usr/bin/env bash
# Seal and Open against the no-op under h2load (nghttp2's load generator,
# with, beside them, the same calls to a second server of the same build
# whose audit log is on (closed mode: a-noop, a-seal, a-open), each ratio
# against the no-op of its own server, and a last table of audited against
# unaudited: the throughput ratio and the CPU per call it adds),
# Debian package nghttp2-client), whose client costs far less CPU than the
# bundled bench's tonic client. One release server on a temporary directory,
# loopback only; rounds interleave noop, seal, seal_json, open. Then the echo
# baseline (a tonic server in the load bench's binary with stateseal's
# transport settings, answering the seal request with a response of the
# token's size and doing nothing else): echo-noop (its health check) and
# echo (the seal request), each ratio against the no-op of its own server.
#
#   benches/h2load.sh [ROUNDS] [REQUESTS]        (defaults: 3 rounds, 100000 requests)
#
# Prints, per scenario and round: calls/s, the ratio to the no-op of the same
# round, p50/p99 latency (from h2load's per-request log), the server's CPU
# per call (utime + stime from /proc around the run) and response bytes per
# call (a failed call has none: the script stops if a scenario's calls carry
# no message). With more than one round, then per scenario the median and
# range across rounds of the ratio, of p99 against its round's no-op p99,
# and of the CPU per call.
set -euo pipefail
ROUNDS=${1:-3}
REQUESTS=${2:-100000}
cd "$(dirname "$0")/.."

. benches/h2common.sh
h2_require h2load:nghttp2-client
h2_start_server
"$BENCH" --bench --serve-echo >"$WORK/echo.out" 2>/dev/null &
ECHO_PID=$!
EXTRA_PIDS=$ECHO_PID
for _ in $(seq 50); do
    grep -q "addr=" "$WORK/echo.out" && break
    sleep 0.1
done
ECHO_ADDR=$(sed -n 's/^addr=//p' "$WORK/echo.out")
h2_start_audited

printf '%-6s %-10s %10s %7s %8s %8s %12s %10s\n' round scenario calls/s "× noop" "p50 µs" "p99 µs" "CPU µs/call" "bytes/call"
for r in $(seq "$ROUNDS"); do
    for sc in noop seal seal_json open a-noop a-seal a-open echo-noop echo; do
        case $sc in
            noop | echo-noop | a-noop) noop_rate= ;;
        esac
        case $sc in
            a-*) [ -n "$AUD_ADDR" ] || continue ;;
        esac
        case $sc in
            echo*) pid=$ECHO_PID addr=$ECHO_ADDR ;;
            a-*) pid=$AUD_PID addr=$AUD_ADDR ;;
            *) pid=$PID addr=127.0.0.1:$PORT ;;
        esac
        t0=$(h2_ticks $pid)
        h2_run "$sc" "$addr" "$REQUESTS" --log-file="$WORK/$sc.log"
        out=$H2OUT
        t1=$(h2_ticks $pid)
        rate=$(h2_rate)
        data=$(sed -n 's/^traffic: .* (\([0-9]*\)) data.*/\1/p' <<<"$out")
        per=$((data / REQUESTS))
        # A gRPC error carries its status in trailers and no message.
        [ "$per" -ge 6 ] || { echo "$sc: responses carry no message (a gRPC error?)" >&2; echo "$out" >&2; exit 1; }
        [ -n "$noop_rate" ] || noop_rate=$rate
        read -r p50 p99 < <(awk '{print $3}' "$WORK/$sc.log" | sort -n |
            awk '{a[NR]=$1} END {print a[int(NR*0.50)], a[int(NR*0.99)]}')
        cpu=$(h2_cpu_per_call $((t1 - t0)) "$REQUESTS" 1)
        ratio=$(awk -v a="$rate" -v b="$noop_rate" 'BEGIN {printf "%.2f", a / b}')
        printf '%-6s %-10s %10.0f %7s %8s %8s %12s %10s\n' "$r" "$sc" "$rate" "$ratio" "$p50" "$p99" "$cpu" "$per"
        echo "$r $sc $ratio $p99 $cpu" >>"$WORK/rows"   # for the summary
    done
done

# One round's ratio says little on a shared machine (the no-op alone moves by
# 20% between rounds), so the medians across rounds, with their ranges: the
# throughput ratio, p99 against the same round's no-op p99, and the server's
# CPU per call.
if [ "$ROUNDS" -gt 1 ]; then
    echo
    printf '%-10s %18s %20s %22s\n' scenario "× noop (range)" "p99 / noop p99" "CPU µs/call"
    awk '
        {
            side = ($2 ~ /^echo/) ? "e" : ($2 ~ /^a-/) ? "a" : "s"
            if ($2 == "noop" || $2 == "echo-noop" || $2 == "a-noop") p99noop[$1, side] = $4
            n[$2]++; x[$2, n[$2]] = $3; q[$2, n[$2]] = $4 / p99noop[$1, side]; c[$2, n[$2]] = $5
            if (!($2 in seen)) { seen[$2] = 1; order[++k] = $2 }
        }
        function med(a, s, m,    i, j, t, v) {
            for (i = 1; i <= m; i++) v[i] = a[s, i]
            for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
            lo = v[1]; hi = v[m]
            return m % 2 ? v[(m + 1) / 2] : (v[m / 2] + v[m / 2 + 1]) / 2
        }
        END {
            for (i = 1; i <= k; i++) {
                s = order[i]; m = n[s]
                v = med(x, s, m); r = sprintf("%.2f (%.2f-%.2f)", v, lo, hi)
                v = med(q, s, m); p = sprintf("%.2f (%.2f-%.2f)", v, lo, hi)
                v = med(c, s, m); u = sprintf("%.1f (%.1f-%.1f)", v, lo, hi)
                printf "%-10s %18s %20s %22s\n", s, r, p, u
            }
        }' "$WORK/rows"
fi

[ -n "$AUD_ADDR" ] || exit 0
# Audited against unaudited, each round's pair: calls/s of the audited call
# over the same call unaudited (its ratio to its own server's no-op, over the
# unaudited one's), and the server CPU per call the audit log adds.
echo
printf '%-8s %26s %28s\n' call "audited ÷ unaudited (range)" "CPU µs/call added (range)"
awk '
    { r[$1, $2] = $3; c[$1, $2] = $5; if ($1 > rounds) rounds = $1 }
    function med(v, m,    i, j, t) {
        for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
        lo = v[1]; hi = v[m]
        return m % 2 ? v[(m + 1) / 2] : (v[m / 2] + v[m / 2 + 1]) / 2
    }
    END {
        split("seal open", calls, " ")
        for (k = 1; k <= 2; k++) {
            s = calls[k]; delete x; delete d
            for (i = 1; i <= rounds; i++) { x[i] = r[i, "a-" s] / r[i, s]; d[i] = c[i, "a-" s] - c[i, s] }
            v = med(x, rounds); a = sprintf("%.2f (%.2f-%.2f)", v, lo, hi)
            v = med(d, rounds); b = sprintf("%+.1f (%+.1f to %+.1f)", v, lo, hi)
            printf "%-8s %26s %28s\n", s, a, b
        }
    }' "$WORK/rows"
