"""Added latency of one MRTR round (input_required, then the retry that
completes) through stateseal, against the SDK's own boundary
(`RequestStateBoundary`, AES-256-GCM with a key ring), measured in one run
with the real SDK server and client over streamable HTTP on 127.0.0.1.

    STATESEAL_BIN=target/release/stateseal python clients/python/bench/roundtrip.py [rounds, default 300]

Four variants: the SDK's boundary; stateseal in its default two phases
(Open RESERVE, then the Commit, carried by the next round trip's Open or
sent on its own after the boundary's `commit_delay`); stateseal consuming
before the handler (`at_most_once`, one Open CONSUME and no Commit); and
the two phases with each Commit sent on its own at once (`commit_delay=0`).
The last two have a stateseal process each. They run interleaved in blocks of 20,
so machine noise hits all alike. Run from the repository root with the test requirements and the
package installed (see clients/python/README.md).

It then prints where the stateseal variant's time goes, per round trip
(mean over the measured round trips, in ms), each step timed where it runs:
- the middleware's own work: the boundary's time on the response path
  minus the steps below (and minus the handler and the SDK inside it);
- binding v2 (the params digest) and the subject, computed here;
- the manifest: the questions' JSON when sealing, the answers' JSON sent
  and the filtered answers parsed back;
- each RPC as the middleware awaits it: Seal and Open RESERVE on the
  response path, and how many Commits the next Open carried and how many
  went on their own;
- the server's handling of each RPC (the mean of its
  stateseal_request_duration_seconds histogram, scraped before and after)
  and its durable rounds (stateseal_ledger_consume_duration_seconds);
- the gRPC client and loopback: the RPCs as awaited minus the server's
  handling of them;
and, last, the same three calls (Seal, Open RESERVE, Commit) one after
another on an otherwise idle event loop: what the two calls on the response
path cost by themselves, against what they cost beside the MCP client and
server on one loop; then Seal and Open RESERVE 2 ms apart, beside a no-op
RPC spaced the same (the floor of any call from here).
The SDK's and uvicorn's per-request logs are turned off: they would cost
both variants alike.
"""

from __future__ import annotations

import contextlib
import json
import logging
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
import grpc
import uvicorn
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.resolve import Elicit, Resolve
from mcp.server.request_state import RequestStateSecurity
from pydantic import BaseModel

import mcp_types as types
import stateseal_mcp.middleware as middleware
from stateseal_mcp import RequestStateClient, StatesealBoundary, install


class Steps:
    """Time spent per named step while `on` (perf_counter, seconds)."""

    def __init__(self) -> None:
        self.on = False
        self.total: dict[str, float] = {}
        self.nesting = 0

    def add(self, name: str, dt: float) -> None:
        if self.on:
            self.total[name] = self.total.get(name, 0.0) + dt

    def sync(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        return timed

    def coro(self, name: str, fn):
        async def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        return timed


class TimedJson:
    """`json` as the middleware module sees it, its calls timed as the
    manifest step (the questions' and answers' JSON)."""

    def __init__(self, steps: Steps) -> None:
        self.dumps = steps.sync("manifest", json.dumps)
        self.loads = steps.sync("manifest", json.loads)


class TimedBoundary(StatesealBoundary):
    """The boundary, its time on the response path measured around the
    handler (and the SDK inside `call_next`), which is not its own."""

    steps: Steps

    async def __call__(self, ctx, call_next):
        steps = self.steps
        inner = 0.0

        async def timed_next(c):
            nonlocal inner
            t0 = time.perf_counter()
            try:
                return await call_next(c)
            finally:
                inner += time.perf_counter() - t0

        t0 = time.perf_counter()
        try:
            return await super().__call__(ctx, timed_next)
        finally:
            steps.add("boundary", time.perf_counter() - t0 - inner)


def instrument(boundary: TimedBoundary, client: RequestStateClient, steps: Steps) -> None:
    boundary.steps = steps
    middleware.params_digest = steps.sync("binding", middleware.params_digest)
    middleware.subject_for = steps.sync("binding", middleware.subject_for)
    middleware.json = TimedJson(steps)
    client.seal = steps.coro("rpc Seal", client.seal)
    timed_open = steps.coro("rpc Open", client.open)

    async def open_(*args, commit=(), **kwargs):
        steps.add("carried commits", len(commit))
        return await timed_open(*args, commit=commit, **kwargs)

    client.open = open_
    client.commit = steps.coro("rpc Commit", client.commit)
    client.renew = steps.coro("rpc Renew", client.renew)


def scrape(metrics_addr: str) -> dict[str, float]:
    """The server's request and ledger histograms: sum and count by name."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for prefix in ("stateseal_request_duration_seconds_", "stateseal_ledger_consume_duration_seconds_"):
            if line.startswith(prefix + "sum") or line.startswith(prefix + "count"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    return out


class Confirm(BaseModel):
    confirm: bool


def ask(amount: int) -> Elicit[Confirm]:
    return Elicit(f"Transfer {amount}?", Confirm)


def server(boundary: StatesealBoundary | None) -> MCPServer:
    s = MCPServer("bench", request_state_security=RequestStateSecurity(keys=[secrets.token_bytes(32)]))

    @s.tool()
    async def transfer(amount: int, confirm: Annotated[Confirm, Resolve(ask)]) -> str:
        return f"transferred {amount}" if confirm.confirm else "cancelled"

    if boundary is not None:
        install(s, boundary)
    return s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_stateseal(tmp: str, metrics: str) -> tuple[subprocess.Popen, str]:
    binary = os.environ.get("STATESEAL_BIN", str(Path(__file__).parents[3] / "target" / "release" / "stateseal"))
    proc = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", f"{tmp}/data", "--metrics-listen", metrics],
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
        metrics = f"127.0.0.1:{free_port()}"
        proc, addr = start_stateseal(tmp, metrics)
        steps = Steps()
        rsc = RequestStateClient(addr)
        boundary = TimedBoundary(rsc, audience="bench")
        instrument(boundary, rsc, steps)
        # The consume variant (targets in `at_most_once`: one Open CONSUME,
        # no Commit) has a stateseal of its own, so that the steps and the
        # server's histograms count the reserve variant alone.
        os.makedirs(f"{tmp}/consume")
        proc2, addr2 = start_stateseal(f"{tmp}/consume", f"127.0.0.1:{free_port()}")
        consume = StatesealBoundary(RequestStateClient(addr2), audience="bench", at_most_once=["transfer"])
        # The same two phases with each Commit sent on its own at once
        # (commit_delay=0), on a stateseal of its own too: what carrying
        # the Commit on the next Open saves, in the same run.
        os.makedirs(f"{tmp}/alone")
        proc3, addr3 = start_stateseal(f"{tmp}/alone", f"127.0.0.1:{free_port()}")
        alone = StatesealBoundary(RequestStateClient(addr3), audience="bench", commit_delay=0)
        variants = [
            ("SDK boundary (AES-GCM)", server(None)),
            ("stateseal (reserve+commit, manifest)", server(boundary)),
            ("stateseal (consume, at_most_once, manifest)", server(consume)),
            ("stateseal (reserve+commit, each Commit alone)", server(alone)),
        ]
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
        # After uvicorn's Config, which sets up logging.
        for name in ("httpx", "httpx2", "mcp", "uvicorn"):
            logging.getLogger(name).setLevel(logging.WARNING)
        times: list[list[float]] = [[] for _ in variants]
        async with anyio.create_task_group() as tg:
            for s in servers:
                tg.start_soon(s.serve)
            while not all(s.started for s in servers):
                await anyio.sleep(0.05)
            async with contextlib.AsyncExitStack() as stack:
                clients = [
                    await stack.enter_async_context(Client(f"http://127.0.0.1:{p}/mcp", elicitation_callback=accept))
                    for p in ports
                ]
                for c in clients:
                    for i in range(20):
                        await c.call_tool("transfer", {"amount": i})
                await settle(metrics)
                before = scrape(metrics)
                for done in range(0, n, 20):
                    for v, c in enumerate(clients):
                        steps.on = v == 1
                        for i in range(20):
                            t0 = time.perf_counter()
                            r = await c.call_tool("transfer", {"amount": done + i})
                            times[v].append((time.perf_counter() - t0) * 1000)
                            if "transferred" not in json.dumps(r.model_dump(mode="json")):
                                raise SystemExit(f"{variants[v][0]}: round trip failed")
                for b in (boundary, alone):
                    await b.drain()
                await settle(metrics)
                steps.on = False
                after = scrape(metrics)
            for s in servers:
                s.should_exit = True
        # The same calls from the same client on an otherwise idle event
        # loop: what the two calls on the response path cost by themselves.
        idle = await idle_calls(addr, n)
        spaced = await spaced_calls(addr, n)
        for p in (proc, proc2, proc3):
            p.terminate()
            p.wait(timeout=20)

    report_times(variants, times)
    report_steps(steps, before, after, len(times[1]))
    report_idle(idle)
    report_spaced(spaced)


async def idle_calls(addr: str, n: int) -> dict[str, list[float]]:
    """Seal (single use), Open RESERVE and Commit of one token after
    another, `n` times, from a fresh client on this otherwise idle loop: ms
    per call as awaited."""
    client = RequestStateClient(addr)
    out: dict[str, list[float]] = {"Seal": [], "Open RESERVE": [], "Commit": []}
    digest = bytes(32)
    for i in range(n + 20):
        t0 = time.perf_counter()
        sealed = await client.seal(
            subject="bench", method="tools/call", state=b"x" * 64, params_digest=digest, single_use=True
        )
        t1 = time.perf_counter()
        opened = await client.open(
            sealed.request_state, subject="bench", method="tools/call", params_digest=digest, reserve=True
        )
        t2 = time.perf_counter()
        await client.commit(opened.reservation)
        t3 = time.perf_counter()
        if i >= 20:  # after a warm-up
            for name, dt in (("Seal", t1 - t0), ("Open RESERVE", t2 - t1), ("Commit", t3 - t2)):
                out[name].append(dt * 1000)
    await client.close()
    return out


def report_calls(heading: str, calls: dict[str, list[float]]) -> None:
    print(f"{heading} ({len(calls['Seal'])} each):")
    print("call | p50 ms | p99 ms")
    for name, t in calls.items():
        print(f"{name} | {statistics.median(t):.3f} | {q(t, 0.99):.3f}")


def report_idle(idle: dict[str, list[float]]) -> None:
    report_calls("the same calls on an idle event loop, one after another", idle)
    floor = statistics.median(idle["Seal"]) + statistics.median(idle["Open RESERVE"])
    print(f"the response path's two calls at their idle p50 (Seal + Open RESERVE) | {floor:.3f}")


async def spaced_calls(addr: str, n: int) -> dict[str, list[float]]:
    """The same calls 2 ms apart, as on the response path (where the MCP
    work of the round trip separates them): each leaves an event loop that
    was waiting in the kernel for a server whose threads were parked.
    Beside them a no-op RPC (grpc.health.v1 Health/Check: no ledger, no
    crypto) on a grpc.aio channel of its own, spaced the same: what any
    call from this process costs on this machine."""
    client = RequestStateClient(addr)
    channel = grpc.aio.insecure_channel(addr)
    check = channel.unary_unary("/grpc.health.v1.Health/Check")
    out: dict[str, list[float]] = {"no-op (Health/Check)": [], "Seal": [], "Open RESERVE": []}
    digest = bytes(32)
    for i in range(n + 20):
        await anyio.sleep(0.002)
        t0 = time.perf_counter()
        await check(b"", timeout=5)
        t1 = time.perf_counter()
        await anyio.sleep(0.002)
        t2 = time.perf_counter()
        sealed = await client.seal(
            subject="bench", method="tools/call", state=b"x" * 64, params_digest=digest, single_use=True
        )
        t3 = time.perf_counter()
        await anyio.sleep(0.002)
        t4 = time.perf_counter()
        opened = await client.open(
            sealed.request_state, subject="bench", method="tools/call", params_digest=digest, reserve=True
        )
        t5 = time.perf_counter()
        await client.commit(opened.reservation)
        if i >= 20:  # after a warm-up
            for name, dt in (("no-op (Health/Check)", t1 - t0), ("Seal", t3 - t2), ("Open RESERVE", t5 - t4)):
                out[name].append(dt * 1000)
    await channel.close()
    await client.close()
    return out


def report_spaced(spaced: dict[str, list[float]]) -> None:
    report_calls("the same calls 2 ms apart, each from an idle event loop to an idle server", spaced)
    two = statistics.median(spaced["Seal"]) + statistics.median(spaced["Open RESERVE"])
    print(f"the response path's two calls 2 ms apart, at p50 (Seal + Open RESERVE) | {two:.3f}")
    print(f"two no-op calls 2 ms apart, at p50: the floor of any two calls | {2 * statistics.median(spaced['no-op (Health/Check)']):.3f}")


async def settle(metrics: str) -> None:
    """Waits until the server has handled every RPC sent so far (the count
    of its request histogram stops moving): a Commit off the response path
    may still be running."""
    last = None
    for _ in range(50):
        now = scrape(metrics)
        count = sum(v for k, v in now.items() if k.startswith("stateseal_request_duration_seconds_count"))
        if count == last:
            return
        last = count
        await anyio.sleep(0.05)


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def report_times(variants, times: list[list[float]]) -> None:
    base = statistics.median(times[0])
    print(f"round trips per variant: {len(times[0])} (2 MCP requests each), python {sys.version.split()[0]}")
    print("variant | p50 ms | p90 ms | p99 ms | p50 vs SDK boundary")
    for (name, _), t in zip(variants, times):
        p50 = statistics.median(t)
        print(f"{name} | {p50:.2f} | {q(t, 0.9):.2f} | {q(t, 0.99):.2f} | {p50 - base:+.2f} ms (x{p50 / base:.2f})")


def report_steps(steps: Steps, before: dict[str, float], after: dict[str, float], rounds: int) -> None:
    def server(rpc: str) -> tuple[float, float]:
        key = f'{{rpc="{rpc}"}}'
        s = after.get(f"stateseal_request_duration_seconds_sum{key}", 0) - before.get(
            f"stateseal_request_duration_seconds_sum{key}", 0)
        n = after.get(f"stateseal_request_duration_seconds_count{key}", 0) - before.get(
            f"stateseal_request_duration_seconds_count{key}", 0)
        return s, n

    ledger = [k for k in after if k.startswith("stateseal_ledger_consume_duration_seconds_sum")]
    durable = sum(after[k] - before.get(k, 0) for k in ledger)
    t = steps.total
    per = lambda secs: secs * 1000 / rounds  # noqa: E731
    on_path = ("Seal", "Open")
    own = t.get("boundary", 0) - sum(t.get(k, 0) for k in ("binding", "manifest")) - sum(
        t.get(f"rpc {r}", 0) for r in on_path)
    awaited = sum(t.get(f"rpc {r}", 0) for r in on_path)
    handled = sum(server(r)[0] for r in on_path)
    print(f"where the stateseal variant's time goes, ms per round trip (mean of {rounds}):")
    print("step | ms")
    print(f"boundary on the response path, in all | {per(t.get('boundary', 0)):.3f}")
    print(f"  its own work (not the steps below) | {per(own):.3f}")
    print(f"  binding v2 and subject | {per(t.get('binding', 0)):.3f}")
    print(f"  manifest: questions and answers JSON | {per(t.get('manifest', 0)):.3f}")
    for rpc in on_path:
        s, n = server(rpc)
        print(f"  {rpc} as awaited ({n / rounds:.2f} per round trip) | {per(t.get(f'rpc {rpc}', 0)):.3f}")
        print(f"    the server's handling of it | {per(s):.3f}")
    print(f"  gRPC client and loopback (awaited minus handled) | {per(awaited - handled):.3f}")
    carried = t.get("carried commits", 0)
    print(f"Commits carried by the next Open, per round trip | {carried / rounds:.2f}")
    for rpc in ("Commit", "Renew"):
        s, n = server(rpc)
        if rpc == "Commit":
            # The server counts a carried commit as a Commit (handled
            # beside the Open that carried it); the rest were sent alone.
            print(f"Commits sent alone, per round trip | {(n - carried) / rounds:.2f}")
            print(f"  the server's handling of every commit, carried or not | {per(s):.3f}")
            if n > carried:
                print(f"  a Commit sent alone, as awaited, per round trip | {per(t.get('rpc Commit', 0)):.3f}")
        elif n:
            print(f"off the response path: {rpc} as awaited ({n / rounds:.2f} per round trip) | "
                  f"{per(t.get(f'rpc {rpc}', 0)):.3f}")
            print(f"  the server's handling of it | {per(s):.3f}")
    print(f"the server's durable rounds (Open RESERVE and Commit, within their handling) | {per(durable):.3f}")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 300)
