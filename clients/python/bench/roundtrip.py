"""Added latency of one MRTR round (input_required, then the retry that
completes) through stateseal, against the SDK's own boundary
(`RequestStateBoundary`, AES-256-GCM with a key ring), measured in one run
with the real SDK server and client over streamable HTTP on 127.0.0.1.

    STATESEAL_BIN=target/release/stateseal python clients/python/bench/roundtrip.py [rounds, default 300]

The variants run interleaved in blocks of 20, so machine noise hits both
alike. Run from the repository root with the test requirements and the
package installed (see clients/python/README.md).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated

import anyio
import uvicorn
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.resolve import Elicit, Resolve
from mcp.server.request_state import RequestStateSecurity
from pydantic import BaseModel

import mcp_types as types
from stateseal_mcp import RequestStateClient, StatesealBoundary, install


class Confirm(BaseModel):
    confirm: bool


def ask(amount: int) -> Elicit[Confirm]:
    return Elicit(f"Transfer {amount}?", Confirm)


def server(stateseal: str | None) -> MCPServer:
    s = MCPServer("bench", request_state_security=RequestStateSecurity(keys=[secrets.token_bytes(32)]))

    @s.tool()
    async def transfer(amount: int, confirm: Annotated[Confirm, Resolve(ask)]) -> str:
        return f"transferred {amount}" if confirm.confirm else "cancelled"

    if stateseal is not None:
        install(s, StatesealBoundary(RequestStateClient(stateseal), audience="bench"))
    return s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_stateseal(tmp: str) -> tuple[subprocess.Popen, str]:
    binary = os.environ.get("STATESEAL_BIN", str(Path(__file__).parents[3] / "target" / "release" / "stateseal"))
    proc = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", f"{tmp}/data"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "listening" in line and "addr=" in line:
            addr = next(w for w in line.split() if w.startswith("addr="))[5:]
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, addr
    raise SystemExit("stateseal did not start")


async def accept(context, params):
    return types.ElicitResult(action="accept", content={"confirm": True})


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start_stateseal(tmp)
        variants = [("SDK boundary (AES-GCM)", server(None)), ("stateseal (reserve+commit, manifest)", server(addr))]
        ports = [free_port() for _ in variants]
        servers = [
            uvicorn.Server(
                uvicorn.Config(
                    v.streamable_http_app(stateless_http=True, json_response=True),
                    host="127.0.0.1",
                    port=p,
                    log_level="warning",
                )
            )
            for (_, v), p in zip(variants, ports)
        ]
        times: list[list[float]] = [[] for _ in variants]
        async with anyio.create_task_group() as tg:
            for s in servers:
                tg.start_soon(s.serve)
            while not all(s.started for s in servers):
                await anyio.sleep(0.05)
            async with Client(f"http://127.0.0.1:{ports[0]}/mcp", elicitation_callback=accept) as c0, Client(
                f"http://127.0.0.1:{ports[1]}/mcp", elicitation_callback=accept
            ) as c1:
                clients = [c0, c1]
                for c in clients:
                    for i in range(20):
                        await c.call_tool("transfer", {"amount": i})
                for done in range(0, n, 20):
                    for v, c in enumerate(clients):
                        for i in range(20):
                            t0 = time.perf_counter()
                            r = await c.call_tool("transfer", {"amount": done + i})
                            times[v].append((time.perf_counter() - t0) * 1000)
                            if "transferred" not in json.dumps(r.model_dump(mode="json")):
                                raise SystemExit(f"{variants[v][0]}: round trip failed")
            for s in servers:
                s.should_exit = True
        proc.terminate()
        proc.wait(timeout=20)

    def q(xs: list[float], p: float) -> float:
        s = sorted(xs)
        return s[min(len(s) - 1, int(p * len(s)))]

    base = statistics.median(times[0])
    print(f"round trips per variant: {len(times[0])} (2 MCP requests each), python {sys.version.split()[0]}")
    print("variant | p50 ms | p90 ms | p99 ms | p50 vs SDK boundary")
    for (name, _), t in zip(variants, times):
        p50 = statistics.median(t)
        print(f"{name} | {p50:.2f} | {q(t, 0.9):.2f} | {q(t, 0.99):.2f} | {p50 - base:+.2f} ms (x{p50 / base:.2f})")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 300)
