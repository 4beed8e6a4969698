# Sourced by benches/h2load.sh and benches/h2profile.sh: the tools they need,
# one release stateseal server on a temporary directory (loopback only) with
# the gRPC-framed request bodies written by the load bench, and one h2load
# run that must succeed in full.

# h2_require TOOL:DEBIAN_PACKAGE ...: exits 2 naming the package to install.
h2_require() {
    local tool
    for tool in "$@"; do
        command -v "${tool%%:*}" >/dev/null || {
            echo "${tool%%:*} is not installed (Debian: apt-get install ${tool#*:})" >&2
            exit 2
        }
    done
}

# Sets BENCH, SERVER (STATESEAL_BIN, or this checkout's release build), WORK,
# PORT and PID; the server's bodies are in $WORK/bodies. EXTRA_PIDS (set by
# the caller after this) are stopped with the server on exit. Arguments, if
# any, are a command the server runs under (valgrind, say); `{WORK}` in them
# becomes $WORK.
h2_start_server() {
    BENCH=$(cargo bench --bench load --no-run 2>&1 | sed -n 's/.*Executable.*(\(.*\)).*/\1/p' | tail -1)
    SERVER=${STATESEAL_BIN:-target/release/stateseal}   # another build to compare
    [ -x "$BENCH" ] && [ -x "$SERVER" ] || { echo "build failed" >&2; exit 1; }
    WORK=$(mktemp -d)
    PORT=$(h2_free_port)
    local wrap=("${@//\{WORK\}/$WORK}")
    # STATESEAL_SERVER_ARGS: more flags for the server ({WORK} is the run's
    # temporary directory), e.g. "--audit-log {WORK}/audit.log".
    local extra=()
    read -r -a extra <<<"${STATESEAL_SERVER_ARGS:-}"
    extra=("${extra[@]//\{WORK\}/$WORK}")
    "${wrap[@]}" "$SERVER" serve --listen "127.0.0.1:$PORT" --data-dir "$WORK/data" "${extra[@]}" 2>"$WORK/server.log" &
    PID=$!
    EXTRA_PIDS=
    trap 'kill $PID $EXTRA_PIDS 2>/dev/null; wait $PID $EXTRA_PIDS 2>/dev/null; rm -rf "$WORK"' EXIT
    # Up to 30 s: a server under valgrind starts slowly.
    for _ in $(seq 300); do
        grep -q "addr=" "$WORK/server.log" 2>/dev/null && break
        sleep 0.1
    done
    "$BENCH" --bench --addr "127.0.0.1:$PORT" --h2load-bodies "$WORK/bodies" 2>/dev/null
}

# The request path of each scenario, and the body it sends.
declare -A PATHS=(
    [noop]=/grpc.health.v1.Health/Check
    [seal]=/stateseal.v1.RequestState/Seal
    [seal_json]=/stateseal.v1.RequestState/Seal
    [open]=/stateseal.v1.RequestState/Open
    [echo-noop]=/grpc.health.v1.Health/Check
    [echo]=/stateseal.v1.RequestState/Seal
    [a-noop]=/grpc.health.v1.Health/Check
    [a-seal]=/stateseal.v1.RequestState/Seal
    [a-open]=/stateseal.v1.RequestState/Open
)
declare -A BODY=([noop]=noop [seal]=seal [seal_json]=seal_json [open]=open [echo-noop]=noop [echo]=seal
    [a-noop]=noop [a-seal]=seal [a-open]=open)

# A free TCP port on 127.0.0.1.
h2_free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# h2_start_another NAME BINARY [FLAGS...]: one more server on the keyset of
# the first ($WORK/data-NAME, log $WORK/NAME.log), stopped with it; sets
# H2_PID and H2_ADDR. Fails (after 30 s at most) if it exits before it
# listens.
h2_start_another() {
    local name=$1 bin=$2 port
    shift 2
    port=$(h2_free_port)
    "$bin" serve --listen "127.0.0.1:$port" --data-dir "$WORK/data-$name" \
        --keyset "$WORK/data/keyset.json" "$@" 2>"$WORK/$name.log" &
    H2_PID=$!
    H2_ADDR=127.0.0.1:$port
    EXTRA_PIDS="$EXTRA_PIDS $H2_PID"
    for _ in $(seq 300); do
        grep -q "addr=" "$WORK/$name.log" 2>/dev/null && return 0
        kill -0 "$H2_PID" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# h2_start_audited: a second server of the same build and keyset with an
# audit log (closed mode, the default: each answer waits for its line),
# every Seal logged (--audit-sample-seals 1); sets AUD_PID and AUD_ADDR
# (empty when the build has no audit log).
h2_start_audited() {
    AUD_ADDR=
    # A build without --audit-log (to compare with): no audited rows.
    if h2_start_another audited "$SERVER" --audit-log "$WORK/audit.log" --audit-sample-seals 1; then
        AUD_ADDR=$H2_ADDR
    fi
    AUD_PID=$H2_PID
}

# Server CPU ticks (utime + stime) of PID, and their rate per second.
h2_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
H2_HZ=$(getconf CLK_TCK)

# h2_cpu_per_call TICKS CALLS DECIMALS: server CPU µs per call.
h2_cpu_per_call() {
    awk -v d="$1" -v hz="$H2_HZ" -v n="$2" -v f="%.$3f" 'BEGIN {printf f, d * 1e6 / hz / n}'
}

# The calls per second of the last h2_run.
h2_rate() { sed -n 's/^finished in .*, \([0-9.]*\) req\/s.*/\1/p' <<<"$H2OUT"; }

# h2_run SCENARIO ADDR REQUESTS [h2load options]: h2load's output in $H2OUT;
# exits unless every request succeeded.
h2_run() {
    local sc=$1 addr=$2 n=$3
    shift 3
    [ -n "${PATHS[$sc]:-}" ] || { echo "unknown scenario $sc (${!PATHS[*]})" >&2; exit 1; }
    H2OUT=$(h2load -n "$n" -c 4 -m 32 -t 1 \
        -H 'content-type: application/grpc' -H 'te: trailers' \
        --data="$WORK/bodies/${BODY[$sc]}.bin" "$@" "http://$addr${PATHS[$sc]}")
    local succeeded
    succeeded=$(sed -n 's/^requests: .* \([0-9]*\) succeeded.*/\1/p' <<<"$H2OUT")
    [ "$succeeded" = "$n" ] || { echo "$sc: only $succeeded of $n succeeded" >&2; echo "$H2OUT" >&2; exit 1; }
}
