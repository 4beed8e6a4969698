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
    PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
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

# h2_start_audited: a second server of the same build and keyset with an
# audit log (closed mode, the default: each answer waits for its line),
# every Seal logged (--audit-sample-seals 1); sets AUD_PID and AUD_ADDR
# (empty when the build has no audit log).
h2_start_audited() {
    local port
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    "$SERVER" serve --listen "127.0.0.1:$port" --data-dir "$WORK/data-audited" \
        --keyset "$WORK/data/keyset.json" --audit-log "$WORK/audit.log" \
        --audit-sample-seals 1 2>"$WORK/audited.log" &
    AUD_PID=$!
    EXTRA_PIDS="$EXTRA_PIDS $AUD_PID"
    AUD_ADDR=
    for _ in $(seq 300); do
        if grep -q "addr=" "$WORK/audited.log" 2>/dev/null; then
            AUD_ADDR=127.0.0.1:$port
            break
        fi
        # A build without --audit-log (to compare with): no audited rows.
        kill -0 "$AUD_PID" 2>/dev/null || break
        sleep 0.1
    done
}

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
