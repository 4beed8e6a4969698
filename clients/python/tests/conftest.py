"""Real parts only: the stateseal binary, MCP servers built with the real
`mcp` SDK over streamable HTTP on 127.0.0.1, and the real `mcp` client."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def stateseal_bin() -> Path:
    p = Path(os.environ.get("STATESEAL_BIN", REPO / "target" / "debug" / "stateseal"))
    if not p.exists():
        pytest.fail(f"stateseal binary not found at {p}: run `cargo build` first or set STATESEAL_BIN")
    return p


@pytest.fixture
def anyio_backend():
    return "asyncio"


def start_stateseal(tmp_path, *extra: str):
    """Starts a stateseal process on 127.0.0.1; returns (process, address)."""
    proc = subprocess.Popen(
        [str(stateseal_bin()), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "STATESEAL_LOG"},
    )
    addr = None
    assert proc.stderr is not None
    for line in proc.stderr:
        if "listening" in line and "addr=" in line:
            addr = next(w for w in line.split() if w.startswith("addr="))[5:]
            break
    assert addr, "stateseal did not start"
    # Keep draining stderr so the process never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, addr


@pytest.fixture
def stateseal(tmp_path):
    """A stateseal process on 127.0.0.1; yields its address."""
    proc, addr = start_stateseal(tmp_path)
    yield addr
    proc.terminate()
    proc.wait(timeout=20)


# Its own generator: a seed given to the global one does not repeat ports.
_PORTS = random.SystemRandom()
# Ports handed out in this process: two calls before either port is bound
# (three replicas of one deployment) never get the same one.
_GIVEN: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, chosen below the kernel's ephemeral
    range (``net.ipv4.ip_local_port_range``), where no ``listen(0)`` and no
    outgoing connection of another test is given a port: so no port the
    kernel hands out takes it before it is used, and no connection to it can
    connect to itself. Where that range starts too low to leave room, any
    free port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    if low > 11_024:
        for _ in range(100):
            port = _PORTS.randrange(low - 10_000, low)
            if port in _GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                _GIVEN.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listener() -> socket.socket:
    """A socket already listening on 127.0.0.1 at a `free_port()`, for a
    server started in this process (``uvicorn.Server.serve(sockets=[...])``):
    nothing can take its port between the choice and the server's start."""
    for _ in range(100):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", free_port()))
        except OSError:
            s.close()
            continue
        s.listen(128)
        return s
    raise OSError("no free port to listen on")
