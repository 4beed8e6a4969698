#!/usr/bin/env bash
# Builds the real deploy/Dockerfile and runs the image as an operator would:
#   --read-only --user 65532 --cap-drop ALL --security-opt no-new-privileges
# then checks: the default command refuses at once, naming the auth flags;
# with bearer auth over TLS (the README's quick start) gRPC health answers and
# a Seal/Open round trip succeeds through the published port; `docker stop`
# ends it gracefully (exit 0) within the grace period. Prints the image size.
#
# Needs root (it installs Debian's docker.io and debootstrap when missing and
# starts dockerd if none answers) and PYTHON: a Python with the stateseal-mcp
# package installed (.ci/run passes its test venv).
#
# No registry can be pulled from on the CI machines, so the builder base the
# Dockerfile names (rust:1.95-bookworm) is made locally first: a Debian
# bookworm root from debootstrap with the Rust 1.95.0 toolchain from rustup,
# plus this machine's extra CA certificates so HTTPS fetches inside the build
# work here. That stand-in is CI's business; the Dockerfile users run is the
# one in deploy/. Ports are published on 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${PYTHON:?set PYTHON to a python with stateseal-mcp installed}"
BASE=rust:1.95-bookworm
# Names of this run's own: another run on the same docker daemon (a second
# checkout's CI) must neither collide with nor remove this one's container.
run_id="$$-$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')"
IMAGE="stateseal:ci-$run_id"
NAME="stateseal-image-test-$run_id"
work=$(mktemp -d)
started_dockerd=""

cleanup() {
  docker rm -f -v "$NAME" >/dev/null 2>&1 || true
  docker image rm "$IMAGE" >/dev/null 2>&1 || true
  # Stop the daemon this run started, unless another run's container is on it.
  if [ -n "$started_dockerd" ] && [ -z "$(docker ps -q 2>/dev/null)" ]; then
    kill "$started_dockerd" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$started_dockerd" 2>/dev/null || break; sleep 1; done
  fi
  if mountpoint -q "$work/root/proc" 2>/dev/null; then umount "$work/root/proc"; fi
  rm -rf "$work"
}
trap cleanup EXIT

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  dockerd >"$work/dockerd.log" 2>&1 &
  started_dockerd=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { cat "$work/dockerd.log"; echo "FATAL: dockerd did not start"; exit 1; }
fi

echo "--- stand-in builder base $BASE (debootstrap + rustup)"
t0=$(date +%s)
root="$work/root"
# The Debian archive this machine itself installs from (its apt sources).
archive=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$archive" ] || archive=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$archive" ] || { echo "FATAL: no Debian archive in this machine's apt sources"; exit 1; }
debootstrap --variant=minbase --include=ca-certificates,curl,gcc,libc6-dev \
  bookworm "$root" "$archive" >"$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log"; exit 1; }
cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$root" update-ca-certificates >/dev/null 2>&1
cp /etc/resolv.conf "$root/etc/resolv.conf"
mount -t proc proc "$root/proc"
# This machine's own rustup, run as rustup-init; it fetches the toolchain
# from its default distribution server.
cp "$(readlink -f "$(command -v rustup)")" "$root/tmp/rustup-init"
chroot "$root" /bin/sh -ec '
  chmod +x /tmp/rustup-init
  RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo \
    /tmp/rustup-init -y -q --no-modify-path --profile minimal --default-toolchain 1.95.0 >/dev/null 2>&1
  rm /tmp/rustup-init'
umount "$root/proc"
: >"$root/etc/resolv.conf"
tar -C "$root" -c . | docker import \
  --change 'ENV RUSTUP_HOME=/usr/local/rustup' \
  --change 'ENV CARGO_HOME=/usr/local/cargo' \
  --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'LABEL description="local stand-in for the rust:1.95-bookworm builder base (stateseal CI)"' \
  - "$BASE" >/dev/null
rm -rf "$root"
echo "stand-in base made in $(($(date +%s) - t0)) s"

echo "--- docker build -f deploy/Dockerfile"
t0=$(date +%s)
DOCKER_BUILDKIT=0 docker build -q -f deploy/Dockerfile -t "$IMAGE" . >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log"; echo "FATAL: image build failed"; exit 1; }
size=$(docker image inspect "$IMAGE" --format '{{.Size}}')
echo "image built in $(($(date +%s) - t0)) s; size $size bytes ($((size / 1024 / 1024)) MiB)"

hardened=(--read-only --user 65532 --cap-drop ALL --security-opt no-new-privileges)

echo "--- the default command refuses at once and names the auth flags"
set +e
out=$(timeout 30 docker run --rm "${hardened[@]}" "$IMAGE" 2>&1)
rc=$?
set -e
if [ "$rc" -eq 0 ] || ! grep -qF -- '--auth bearer --tenants FILE --tls-cert FILE --tls-key FILE' <<<"$out"; then
  echo "FATAL: default command: exit $rc, output: $out"
  exit 1
fi
echo "refused (exit $rc) naming --auth bearer/--auth mtls and their files"

echo "--- bearer over TLS, as the README's quick start"
conf="$work/conf"
mkdir -p "$conf"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
  -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
  -keyout "$conf/tls.key" -out "$conf/tls.crt" 2>/dev/null
secret=$(openssl rand -hex 32)
printf '{ "tenants": [ { "name": "demo", "bearer_sha256": "%s" } ] }\n' \
  "$(printf %s "$secret" | sha256sum | cut -d' ' -f1)" >"$conf/tenants.json"
# Readable by the image's uid 65532 and by no one else (as the README says).
chmod 0600 "$conf"/*
chown 65532:65532 "$conf"/*
chmod 0755 "$conf"
docker run -d --name "$NAME" "${hardened[@]}" \
  -p 127.0.0.1::50051 -p 127.0.0.1::8081 -v "$conf:/etc/stateseal:ro" "$IMAGE" \
  serve --auth bearer --tenants /etc/stateseal/tenants.json \
  --tls-cert /etc/stateseal/tls.crt --tls-key /etc/stateseal/tls.key >/dev/null
grpc_port=$(docker port "$NAME" 50051/tcp | head -1 | sed 's/.*://')
health_port=$(docker port "$NAME" 8081/tcp | head -1 | sed 's/.*://')

STATESEAL_SECRET="$secret" "$PYTHON" - "$grpc_port" "$health_port" "$conf/tls.crt" <<'PY'
import asyncio, os, sys, time
import grpc
from stateseal_mcp.client import RequestStateClient

grpc_port, health_port, ca = sys.argv[1], sys.argv[2], sys.argv[3]

def health():
    # grpc.health.v1.Health/Check with an empty request; SERVING is field 1 = 1.
    deadline = time.monotonic() + 30
    while True:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
                check = ch.unary_unary("/grpc.health.v1.Health/Check")
                if check(b"", timeout=2) == b"\x08\x01":
                    return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            sys.exit("FATAL: health never answered SERVING")
        time.sleep(0.5)

async def roundtrip():
    creds = grpc.ssl_channel_credentials(open(ca, "rb").read())
    c = RequestStateClient(f"127.0.0.1:{grpc_port}", credentials=creds, bearer=os.environ["STATESEAL_SECRET"])
    params = '{"name":"transfer","arguments":{"amount":5}}'
    s = await c.seal(subject="alice", method="tools/call", state=b"step-1", params_json=params, single_use=True)
    o = await c.open(s.request_state, subject="alice", method="tools/call", params_json=params)
    assert o.state == b"step-1" and o.consumed, o
    try:
        await c.open(s.request_state, subject="alice", method="tools/call", params_json=params)
        sys.exit("FATAL: a consumed token opened twice")
    except Exception as e:
        assert getattr(e, "reason", None) == "REPLAYED", e
    bad = RequestStateClient(f"127.0.0.1:{grpc_port}", credentials=creds, bearer="wrong")
    try:
        await bad.seal(subject="alice", method="tools/call", state=b"x", params_json=params)
        sys.exit("FATAL: a wrong bearer secret was accepted")
    except Exception as e:
        assert e.code == grpc.StatusCode.UNAUTHENTICATED, e
    await c.close()
    await bad.close()

health()
print("health: SERVING")
asyncio.run(roundtrip())
print("Seal/Open round trip through the published port: ok (replay REPLAYED, wrong secret UNAUTHENTICATED)")
PY

echo "--- docker stop (grace period 10 s)"
t0=$(date +%s)
docker stop -t 10 "$NAME" >/dev/null
took=$(($(date +%s) - t0))
code=$(docker inspect "$NAME" --format '{{.State.ExitCode}}')
if [ "$code" != 0 ] || [ "$took" -ge 10 ]; then
  docker logs "$NAME" 2>&1 | tail -20
  echo "FATAL: docker stop: exit code $code after $took s"
  exit 1
fi
echo "stopped in $took s, exit code 0"
echo "image test ok: $IMAGE, $size bytes"
