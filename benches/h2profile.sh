#!/usr/bin/env bash
# Where a scenario's server CPU goes beyond the no-op's, under h2load: the
# server is sampled by `perf record` (cpu-clock, 2,000 Hz, no call graphs)
# while h2load sends the same fixed requests as benches/h2load.sh, one run per
# scenario against one release server, and the samples are grouped by what
# the function belongs to (the crate of its path, or libc's allocator, its
# memcpy/memset, the kernel). A generated gRPC server counts as stateseal's
# (it is compiled into the crate); a generic function counts where its path
# starts, or where its trait's does (`<T as tower::Service>::call` is
# tower's).
#
#   benches/h2profile.sh [SCENARIOS] [REQUESTS]   (defaults: "seal open", 300000)
#
# Prints, per group, the server's CPU µs per call in the no-op and in each
# scenario, and the scenario's difference: samples × (1 / 2,000 s) / calls.
# A sample is CPU time of a server thread, so the columns add up to roughly
# the CPU per call of benches/h2load.sh. Needs h2load (Debian:
# nghttp2-client) and perf (Debian: linux-perf) with permission to sample
# another process (root, or kernel.perf_event_paranoid <= 1).
set -euo pipefail
SCENARIOS=${1:-seal open}
REQUESTS=${2:-300000}
FREQ=2000
cd "$(dirname "$0")/.."

. benches/h2common.sh
h2_require h2load:nghttp2-client perf:linux-perf
cargo build --release --quiet
h2_start_server

# Samples per group of one scenario's run, as "group<TAB>samples" lines.
profile() {
    local sc=$1 data="$WORK/$1.perf"
    perf record -q -F "$FREQ" -p "$PID" -o "$data" 2>"$WORK/perf.log" &
    local perf_pid=$!
    sleep 0.5 # perf attaches to every thread before the load starts
    h2_run "$sc" "127.0.0.1:$PORT" "$REQUESTS"
    kill -TERM "$perf_pid" # perf writes its file on SIGTERM too; a background job may ignore SIGINT
    wait "$perf_pid" || true
    [ -s "$data" ] || { echo "perf recorded nothing: $(cat "$WORK/perf.log")" >&2; exit 1; }
    perf report -i "$data" --no-children --sort dso,symbol -F sample,dso,sym -t $'\t' --stdio 2>/dev/null |
        awk -F'\t' '
            /^#/ || NF < 3 { next }
            {
                n = $1; dso = $2; sym = $3
                sub(/^\[[.k]\] +/, "", sym); gsub(/ +$/, "", sym)
                if (dso ~ /kernel|vdso/) g = "kernel"
                else if (sym ~ /malloc|free|_int_|consolidate|unlink_chunk|memalign|realloc|calloc|tcache/) g = "allocator (libc)"
                else if (sym ~ /^__mem(move|cpy|set)|^mem(move|cpy|set)/) g = "memcpy, memset (libc)"
                else if (dso ~ /libc|libm|ld-linux/) g = "libc, other"
                else {
                    c = sym; sub(/^[<&]+(mut )?/, "", c)
                    # <T as tower::Service>::call counts as tower
                    if (c ~ /^[A-Z][A-Za-z0-9_]* as /) { sub(/^[A-Z][A-Za-z0-9_]* as [<&]*/, "", c) }
                    sub(/::.*/, "", c); sub(/ .*/, "", c)
                    if (c ~ /^(chacha20|chacha20poly1305|poly1305|cipher|aead|universal_hash)$/) g = "AEAD (chacha20, poly1305)"
                    else if (c ~ /^(sha2|hmac|hkdf|digest)$/) g = "SHA-256, HMAC, HKDF"
                    else if (c == "base64") g = "base64"
                    else if (c ~ /^(rand|rand_chacha|rand_core)$/) g = "rand (the nonce)"
                    else if (c ~ /^(prost|tonic_prost)$/) g = "prost"
                    else if (c == "prometheus_client") g = "metrics (prometheus_client)"
                    else if (c ~ /^(stateseal|arc_swap|subtle)$/) g = "stateseal (with arc_swap, subtle)"
                    else if (c ~ /^(h2|hyper|hyper_util|http|http_body|http_body_util|httparse|tonic|tonic_health|tower|tower_service|tower_layer|axum|axum_core|matchit|percent_encoding|bytes)$/) g = "h2, hyper, tonic, tower, bytes"
                    else if (c ~ /^(tokio|tokio_util|mio|atomic_waker|slab|tracing|tracing_core|tracing_subscriber|std|parking_lot|parking_lot_core|futures_util|futures_core|futures_channel)$/) g = "tokio, std, tracing"
                    else if (c ~ /^(core|alloc|__rustc|hashbrown|indexmap|u8|u32|u64|usize|str)$/) g = "core, alloc, collections"
                    else g = "other (" c ")"
                }
                s[g] += n
            }
            END { for (g in s) printf "%s\t%d\n", g, s[g] }'
}

profile noop >"$WORK/noop.groups"
for sc in $SCENARIOS; do profile "$sc" >"$WORK/$sc.groups"; done

awk -F'\t' -v freq="$FREQ" -v n="$REQUESTS" -v scenarios="$SCENARIOS" '
    BEGIN { ns = split("noop " scenarios, sc, " ") }
    {
        file = FILENAME; sub(/.*\//, "", file); sub(/\.groups$/, "", file)
        us[file, $1] = $2 * 1e6 / freq / n; groups[$1] = 1
    }
    END {
        printf "%-48s", "server CPU µs per call"
        for (i = 1; i <= ns; i++) printf " %10s", sc[i]
        for (i = 2; i <= ns; i++) printf " %12s", sc[i] " - noop"
        printf "\n"
        for (g in groups) {
            line = sprintf("%-48s", g)
            for (i = 1; i <= ns; i++) { line = line sprintf(" %10.2f", us[sc[i], g]); total[i] += us[sc[i], g] }
            for (i = 2; i <= ns; i++) line = line sprintf(" %12.2f", us[sc[i], g] - us["noop", g])
            print line | "sort"
        }
        close("sort")
        printf "%-48s", "all"
        for (i = 1; i <= ns; i++) printf " %10.2f", total[i]
        for (i = 2; i <= ns; i++) printf " %12.2f", total[i] - total[1]
        printf "\n"
    }' $(for sc in noop $SCENARIOS; do echo "$WORK/$sc.groups"; done)
