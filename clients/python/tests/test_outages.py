"""At most once through outages (issue 57): a handler that returned has its
Commit kept (retried, its lease renewed) until it lands, so an outage of
the Commit path shorter than `commit_window` never runs it a second time.

Each test is what a user of the package sees: the real stateseal binary
(closed-mode audit log, the default, or the PostgreSQL ledger), two SDK
replicas behind the round-robin front, the real SDK client, a 3 s lease, and
a tool whose side effect is counted (`slow` of test_e2e). The outage starts
as the handler returns (the handler itself starts it just before), lasts
2 s (shorter than the lease) or 5 s (longer), and then the user replays the
same retry, sending it again while it is answered "in progress" or
"temporarily unavailable" as a client would: it is refused as already used,
and the side effect happened once.

Last, a Renew that hangs (issue 58, finding 5): abandoned within the lease,
and the next one lands, so a handler slower than the lease still runs once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import anyio
import grpc
import mcp_types as types
import pytest
import uvicorn
from mcp import Client
from mcp.shared.exceptions import MCPError

from stateseal_mcp import RequestStateClient, StatesealBoundary, StatesealError

from conftest import listener, start_stateseal
from test_e2e import (
    BOUNDARIES,
    SLOW,
    accept,
    answers,
    assert_already_used,
    assert_in_progress,
    deployment,
    error_of,
    replica,
    start_relay,
    stop_relay,
    text_of,
)

pytestmark = pytest.mark.anyio

#: The lease the boundary asks for, in seconds.
LEASE = 3
#: Liveness bounds only (generous: a busy 2-core machine); no assertion
#: depends on them being tight.
DEADLINE = 90


def unavailable_here(why: str) -> NoReturn:
    """This machine cannot run the test: a failure under
    STATESEAL_FAIL_ON_SKIP=1, else a skip that says so even under output
    capture (CI fails on any SKIPPED)."""
    if os.environ.get("STATESEAL_FAIL_ON_SKIP") == "1":
        pytest.fail(f"SKIPPED under STATESEAL_FAIL_ON_SKIP=1: {why}")
    print(f"\nSKIPPED: {why}")
    pytest.skip(why)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (mounting needs root): the audit log's disk, filled to
    make it fail. Unmounted afterwards (stop its writer first)."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        unavailable_here(f"cannot mount a tmpfs for the audit log ({mounted.stderr.strip()}): run as root")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


class PgProxy:
    """A TCP proxy in front of PostgreSQL that can go down: every
    connection through it is cut (both sides), and new ones are cut as soon
    as they are accepted, until it comes up again."""

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._up = True
        self._transports: set[asyncio.WriteTransport] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def down(self) -> None:
        self._up = False
        for t in list(self._transports):
            t.abort()
        self._transports.clear()

    def up(self) -> None:
        self._up = True

    async def close(self) -> None:
        """Stops listening, cuts every connection and waits for their
        handlers to end (none is left to the event loop's teardown)."""
        if self._server is not None:
            self._server.close()
        self.down()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=DEADLINE)
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        if not self._up:
            down_w.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self._upstream)
        except OSError:
            down_w.transport.abort()
            return
        if not self._up:  # went down while connecting
            up_w.transport.abort()
            down_w.transport.abort()
            return
        pair = (down_w.transport, up_w.transport)
        self._transports.update(pair)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.transport.abort()

        try:
            await asyncio.gather(pump(down_r, up_w), pump(up_r, down_w))
        finally:
            self._transports.difference_update(pair)


async def fill(disk: Path) -> None:
    """Fills `disk` until it has no room left (dd stops at ENOSPC)."""
    dd = await asyncio.create_subprocess_exec(
        "dd", "if=/dev/zero", f"of={disk / 'filler'}", "bs=64k",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    await dd.wait()


async def until_the_sink_fails(addr: str) -> int:
    """Seals throwaway states until stateseal answers AUDIT_UNAVAILABLE: the
    audit file's last page may still hold a few lines after the disk is
    full, and the outage starts when the sink has failed a write. Returns
    how many Seals still got through."""
    probe = RequestStateClient(addr)
    try:
        with anyio.fail_after(DEADLINE):
            for n in range(10_000):
                try:
                    await probe.seal(subject="probe", method="tools/call", params_digest=bytes(32), state=b"x")
                except StatesealError as e:
                    assert e.reason == "AUDIT_UNAVAILABLE", e.reason
                    return n
        pytest.fail("the audit sink never failed on a full disk")
    finally:
        await probe.close()


async def replay_until_answered(client: Client, retry: dict[str, Any], amount: int):
    """The user's replay of the same retry, sent again while it is answered
    with a retryable error ("in progress", "temporarily unavailable") as a
    client would: what it is answered in the end (an MCPError, or the
    result of the handler running again)."""
    with anyio.fail_after(DEADLINE):
        while True:
            try:
                return await client.session.call_tool("slow", {"amount": amount}, **retry, allow_input_required=True)
            except MCPError as e:
                retryable = e.error.data == {"reason": "in_progress"} or (
                    e.error.code == types.INTERNAL_ERROR and e.error.message == "Temporarily unavailable; retry"
                )
                if not retryable:
                    return e
            await anyio.sleep(0.25)


async def one_outage(
    addr: str,
    seconds: float,
    start: Callable[[], Awaitable[None]],
    end: Callable[[], None],
    caplog,
    amount: int,
) -> None:
    """The round trip whose handler starts the outage (`start`, awaited
    just before it returns); `end` ends it `seconds` later. Then the user's
    replay is refused as already used, and the body ran once."""
    ended = anyio.Event()

    async def outage() -> None:
        await start()
        SLOW["on_return"] = []

        def over() -> None:
            end()
            ended.set()

        asyncio.get_running_loop().call_later(seconds, over)

    SLOW.update(runs=0, gate=None, on_return=[outage])
    try:
        async with deployment(addr, lease_seconds=LEASE) as (url, served):
            async with Client(url, elicitation_callback=accept) as client:
                r = await client.session.call_tool("slow", {"amount": amount}, allow_input_required=True)
                assert isinstance(r, types.InputRequiredResult), r
                retry: dict[str, Any] = {"input_responses": answers(r), "request_state": r.request_state}
                done = await client.session.call_tool("slow", {"amount": amount}, **retry)  # on B
                assert f"slow {amount}" in text_of(done), done
                with anyio.fail_after(DEADLINE):
                    await ended.wait()
                replay = await replay_until_answered(client, retry, amount)
                if not isinstance(replay, MCPError):
                    what = "a fresh input_required" if isinstance(replay, types.InputRequiredResult) else "a result"
                    pytest.fail(f"the replay got {what}: the handler ran {SLOW['runs']} times")
                assert_already_used(replay)
                for b in BOUNDARIES:
                    assert await b.drain(DEADLINE), "a Commit is still kept"
        assert SLOW["runs"] == 1, SLOW
        assert [tag for tag, with_state in served if with_state][0] == "B", served
        # The Commit landed: no ERROR (no Commit given up, no token taken
        # over, no false "reservation lost" from a renewal that raced it).
        errors = [rec.getMessage() for rec in caplog.records if rec.name == "stateseal_mcp" and rec.levelno >= logging.ERROR]
        assert errors == [], errors
    finally:
        SLOW.update(gate=None, on_return=[])


@pytest.mark.parametrize("seconds", [2, 5])
async def test_an_audit_sink_outage_as_the_handler_returns_runs_it_once(tmp_path, small_disk, caplog, seconds):
    """The closed-mode audit log (the default) on a disk that fills up as
    the handler returns, for 2 s and for 5 s (a 3 s lease)."""
    caplog.set_level(logging.INFO, logger="stateseal_mcp")
    log = small_disk / "audit.log"
    proc, addr = start_stateseal(tmp_path, "--audit-log", str(log))

    async def start() -> None:
        await fill(small_disk)
        assert await until_the_sink_fails(addr) < 1_000

    try:
        await one_outage(addr, seconds, start, (small_disk / "filler").unlink, caplog, amount=11)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def database_url(capsys) -> str:
    url = os.environ.get("STATESEAL_TEST_DATABASE_URL")
    if not url:
        with capsys.disabled():
            unavailable_here("STATESEAL_TEST_DATABASE_URL is unset, so the PostgreSQL ledger outage is not tested")
    return url


@pytest.mark.parametrize("seconds", [2, 5])
async def test_a_ledger_outage_as_the_handler_returns_runs_it_once(tmp_path, caplog, capsys, seconds):
    """The PostgreSQL ledger, reached through a proxy that goes down as the
    handler returns (every connection cut, new ones refused), for 2 s and
    for 5 s (a 3 s lease)."""
    url = urlsplit(database_url(capsys))
    proxy = PgProxy(url.hostname or "127.0.0.1", url.port or 5432)
    await proxy.start()
    userinfo = url.netloc.rpartition("@")[0]
    through = urlunsplit(url._replace(netloc=f"{userinfo + '@' if userinfo else ''}127.0.0.1:{proxy.port}"))
    caplog.set_level(logging.INFO, logger="stateseal_mcp")
    # Started off the event loop: the proxy runs on it, and stateseal
    # connects through it before it says it listens.
    proc, addr = await anyio.to_thread.run_sync(
        start_stateseal, tmp_path, "--ledger", "postgres", "--database-url", through
    )

    async def start() -> None:
        proxy.down()

    try:
        await one_outage(addr, seconds, start, proxy.up, caplog, amount=12)
    finally:
        proc.terminate()
        await anyio.to_thread.run_sync(proc.wait, 20)
        await proxy.close()
    # The outage was seen: the Commit was retried until it landed.
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("commit" in m and "retrying" in m for m in messages), messages
    assert any("commit" in m and "landed after" in m for m in messages), messages


def test_the_commit_window_is_validated():
    client = RequestStateClient("127.0.0.1:9")
    StatesealBoundary(client, audience="a", lease_seconds=30, commit_window=30)
    for bad in (0, -1, float("nan"), float("inf"), True, "60"):
        with pytest.raises(ValueError):
            StatesealBoundary(client, audience="a", commit_window=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease_seconds"):
        StatesealBoundary(client, audience="a", lease_seconds=30, commit_window=10)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            StatesealBoundary(client, audience="a", max_pending=bad)  # type: ignore[arg-type]


async def test_commits_past_max_pending_are_counted_and_tried_once(stateseal, caplog, monkeypatch):
    """With `max_pending=1` and every Commit held: the first round trip's
    Commit is kept, the second's finds the bound reached (an ERROR, counted
    in `overflowed`) and is tried once, which lands too once let go."""
    commit = RequestStateClient.commit
    gate = asyncio.Event()

    async def held_commit(self, reservation, **kw):
        await gate.wait()
        await commit(self, reservation, **kw)

    monkeypatch.setattr(RequestStateClient, "commit", held_commit)
    caplog.set_level(logging.INFO, logger="stateseal_mcp")
    async with deployment(stateseal, max_pending=1, commit_delay=0) as (url, served):
        async with Client(url, elicitation_callback=accept) as client:
            retries = []
            for _ in range(2):
                r = await client.session.call_tool("transfer", {"amount": 6}, allow_input_required=True)  # on A
                assert isinstance(r, types.InputRequiredResult), r
                retries.append({"input_responses": answers(r), "request_state": r.request_state})
                done = await client.session.call_tool("transfer", {"amount": 6}, **retries[-1])  # on B
                assert "transferred 6" in text_of(done), done
            _, b = BOUNDARIES
            assert (BOUNDARIES[0].overflowed, b.overflowed) == (0, 1)
            assert any(
                rec.levelno == logging.ERROR and "not kept" in rec.getMessage() and "max_pending" in rec.getMessage()
                for rec in caplog.records
            ), caplog.text
            gate.set()
            assert await b.drain(DEADLINE)
            for retry in retries:
                with pytest.raises(MCPError) as e:
                    await client.session.call_tool("transfer", {"amount": 6}, **retry)
                assert_already_used(e.value)
    assert [tag for tag, with_state in served if with_state][:2] == ["B", "B"], served


def failing_commits_and_renewals(monkeypatch) -> dict[str, bool]:
    """Every Commit and Renew fails LEDGER_UNAVAILABLE (a ledger outage as
    the boundary sees it) while the returned `{"on": ...}` says so."""
    commit, renew = RequestStateClient.commit, RequestStateClient.renew
    outage = {"on": True}

    def down() -> StatesealError:
        return StatesealError("LEDGER_UNAVAILABLE", grpc.StatusCode.UNAVAILABLE, "test outage")

    async def failing_commit(self, reservation, **kw):
        if outage["on"]:
            raise down()
        await commit(self, reservation, **kw)

    async def failing_renew(self, reservation, lease_seconds=0, **kw):
        if outage["on"]:
            raise down()
        return await renew(self, reservation, lease_seconds, **kw)

    monkeypatch.setattr(RequestStateClient, "commit", failing_commit)
    monkeypatch.setattr(RequestStateClient, "renew", failing_renew)
    return outage


async def test_a_replay_here_never_takes_over_a_token_whose_commit_is_kept(stateseal, caplog, monkeypatch):
    """Every Commit and Renew fails (a ledger outage as the boundary sees
    it) until the test ends the outage; the lease (2 s) runs out meanwhile.
    The user's replay reaching this process then would take the token over
    and run the handler again: it waits for the kept Commit, and is
    answered "in progress" while that Commit has not landed. Once it lands,
    the replay is refused as already used; the body ran once."""
    outage = failing_commits_and_renewals(monkeypatch)
    caplog.set_level(logging.INFO, logger="stateseal_mcp")
    SLOW.update(runs=0, gate=None, on_return=[])
    async with deployment(stateseal, lease_seconds=2) as (url, served):
        async with Client(url, elicitation_callback=accept) as client:
            r = await client.session.call_tool("slow", {"amount": 13}, allow_input_required=True)  # on A
            assert isinstance(r, types.InputRequiredResult), r
            retry: dict[str, Any] = {"input_responses": answers(r), "request_state": r.request_state}
            done = await client.session.call_tool("slow", {"amount": 13}, **retry)  # on B
            assert "slow 13" in text_of(done), done
            # Past the 2 s lease, which no renewal extended.
            await anyio.sleep(3)
            replay = await error_of(
                client.session.call_tool("slow", {"amount": 13}, **retry, allow_input_required=True)
            )  # on A
            assert_in_progress(replay)
            outage["on"] = False
            assert_already_used(await replay_until_answered(client, retry, 13))
            for b in BOUNDARIES:
                assert await b.drain(DEADLINE)
    assert SLOW["runs"] == 1, SLOW
    assert [tag for tag, with_state in served if with_state][:2] == ["B", "A"], served
    messages = [(rec.levelno, rec.getMessage()) for rec in caplog.records]
    assert any(lvl == logging.WARNING and "renew failed" in m for lvl, m in messages), caplog.text
    assert any("commit" in m and "landed after" in m for _, m in messages), caplog.text
    assert not [m for lvl, m in messages if lvl >= logging.ERROR], caplog.text


async def test_an_open_on_its_way_as_the_handler_answers_never_runs_it_again(stateseal, caplog, monkeypatch):
    """The nemesis's finding (seed 16257906604647455624): an Open sent
    before this process's handler of the same token answered, and decided
    once that handler's lease had run out in an outage, took the token over
    and ran the handler again while the first run's Commit was still kept.
    Every Commit and Renew fails (as above); the second call's Open is held
    on its way from before the handler answers until past the 2 s lease.
    It gets the token; the handler does not run again, and the call is
    answered "in progress". Once the outage ends, the replay is refused as
    already used; the body ran once."""
    open_ = RequestStateClient.open
    opens = {"n": 0}
    sent, let_go = asyncio.Event(), asyncio.Event()

    async def held_open(self, *args, **kw):
        opens["n"] += 1
        if opens["n"] == 2:
            # The second call's Open, on its way.
            sent.set()
            await let_go.wait()
        return await open_(self, *args, **kw)

    outage = failing_commits_and_renewals(monkeypatch)
    monkeypatch.setattr(RequestStateClient, "open", held_open)
    caplog.set_level(logging.INFO, logger="stateseal_mcp")
    SLOW.update(runs=0, gate=asyncio.Event(), on_return=[])
    async with deployment(stateseal, lease_seconds=2) as (url, served):
        async with Client(url, elicitation_callback=accept) as client:
            r = await client.session.call_tool("slow", {"amount": 17}, allow_input_required=True)
            assert isinstance(r, types.InputRequiredResult), r
            retry: dict[str, Any] = {"input_responses": answers(r), "request_state": r.request_state}
            first = asyncio.create_task(client.session.call_tool("slow", {"amount": 17}, **retry))
            with anyio.fail_after(DEADLINE):
                while SLOW["runs"] == 0:
                    await anyio.sleep(0.02)
            second = asyncio.create_task(
                error_of(client.session.call_tool("slow", {"amount": 17}, **retry, allow_input_required=True))
            )
            with anyio.fail_after(DEADLINE):
                await sent.wait()
            SLOW["gate"].set()
            assert "slow 17" in text_of(await first)
            # Past the 2 s lease, which no renewal extended.
            await anyio.sleep(3)
            let_go.set()
            assert_in_progress(await second)
            outage["on"] = False
            assert_already_used(await replay_until_answered(client, retry, 17))
            for b in BOUNDARIES:
                assert await b.drain(DEADLINE)
    assert SLOW["runs"] == 1, SLOW
    assert "not run again" in caplog.text, caplog.text


@asynccontextmanager
async def two_replicas(addrs: tuple[str, str], **boundary_options):
    """Replicas A and B of test_e2e (no front: each test call names the
    replica it reaches), B's boundary reaching stateseal at `addrs[1]`.
    Yields their MCP URLs."""
    served: list = []
    BOUNDARIES.clear()
    socks = [listener(), listener()]
    ports = [s.getsockname()[1] for s in socks]
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                replica(tag, addr, served, **boundary_options).streamable_http_app(
                    stateless_http=True, json_response=True
                ),
                host="127.0.0.1",
                port=port,
                log_level="warning",
                lifespan="on",
                timeout_keep_alive=60,
            )
        )
        for tag, addr, port in zip(("A", "B"), addrs, ports)
    ]
    async with anyio.create_task_group() as tg:
        for s, sock in zip(servers, socks):
            tg.start_soon(s.serve, [sock])
        with anyio.fail_after(20):
            while not all(s.started for s in servers):
                await anyio.sleep(0.05)
        try:
            yield tuple(f"http://127.0.0.1:{p}/mcp" for p in ports)
        finally:
            for s in servers:
                s.should_exit = True
    for sock in socks:
        sock.close()


async def test_a_hung_renewal_is_abandoned_within_the_lease_and_retried(tmp_path, caplog, monkeypatch):
    """Issue 58, finding 5: a Renew that hangs is abandoned within the lease
    (its deadline is a third of the lease, not the client's 5 s timeout),
    and the next one goes at once.

    Replica B reaches stateseal round robin through two relays, the way a
    headless service's replicas are reached; its handler runs longer than
    the 3 s lease. As it starts, the second relay stops forwarding (a
    replica that hangs): every Renew sent its way hangs. For at least 7 s
    (a hung Renew with the 5 s timeout, sent a third of a lease after the
    last one landed, outlasts the lease) the user's replay is sent again
    and again to replica A: each is answered "in progress", because the
    renewal after each abandoned one, through the first relay, lands in
    time. Once the handler returned, the replay is refused as already used;
    the body ran once."""
    proc, addr = start_stateseal(tmp_path)
    relays = [await start_relay(addr) for _ in range(2)]
    hung = relays[1][2]["flowing"]
    renew = RequestStateClient.renew
    #: B's renewals: (started, ended, None or the failure's reason), on the
    #: loop's clock.
    renewals: list[tuple[float, float, str | None]] = []

    async def recorded_renew(self, reservation, lease_seconds=0, **kw):
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            lease = await renew(self, reservation, lease_seconds, **kw)
        except StatesealError as e:
            if self._target.startswith("ipv4:"):
                renewals.append((started, loop.time(), e.reason))
            raise
        if self._target.startswith("ipv4:"):
            renewals.append((started, loop.time(), None))
        return lease

    def abandoned_then_renewed() -> bool:
        hung_ends = [end for _, end, reason in renewals if reason == "DEADLINE_EXCEEDED"]
        return bool(hung_ends) and any(reason is None and start >= hung_ends[0] for start, _, reason in renewals)

    monkeypatch.setattr(RequestStateClient, "renew", recorded_renew)
    caplog.set_level(logging.INFO, logger="stateseal_mcp")
    SLOW.update(runs=0, gate=anyio.Event(), on_return=[])
    b_target = "ipv4:" + ",".join(r[1] for r in relays)
    outcome: dict = {}
    replays = 0
    try:
        async with two_replicas((addr, b_target), lease_seconds=LEASE) as (url_a, url_b):
            # gRPC's default authority for a list of addresses is the list,
            # which HTTP/2 refuses; a DNS name would be its own authority.
            BOUNDARIES[1]._client._options.append(("grpc.default_authority", "stateseal"))
            try:
                async with Client(url_a, elicitation_callback=accept) as on_a, Client(
                    url_b, elicitation_callback=accept
                ) as on_b:
                    r = await on_a.session.call_tool("slow", {"amount": 14}, allow_input_required=True)
                    assert isinstance(r, types.InputRequiredResult), r
                    retry: dict[str, Any] = {"input_responses": answers(r), "request_state": r.request_state}

                    async def run_retry() -> None:
                        outcome["result"] = await on_b.session.call_tool("slow", {"amount": 14}, **retry)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(run_retry)
                        with anyio.fail_after(DEADLINE):
                            while SLOW["runs"] == 0:
                                await anyio.sleep(0.05)
                        hung.clear()
                        loop = asyncio.get_running_loop()
                        held_since = loop.time()
                        with anyio.fail_after(DEADLINE):
                            while loop.time() - held_since < 7 or not abandoned_then_renewed():
                                replay = on_a.session.call_tool(
                                    "slow", {"amount": 14}, **retry, allow_input_required=True
                                )
                                assert_in_progress(await error_of(replay))
                                replays += 1
                                await anyio.sleep(0.25)
                        hung.set()
                        SLOW["gate"].set()
                    assert "slow 14" in text_of(outcome["result"]), outcome
                    assert await BOUNDARIES[1].drain(DEADLINE), "a Commit is still kept"
                    replay = on_a.session.call_tool("slow", {"amount": 14}, **retry, allow_input_required=True)
                    assert_already_used(await error_of(replay))
            finally:
                hung.set()
                SLOW["gate"].set()  # never leave a handler waiting at shutdown
        assert SLOW["runs"] == 1, SLOW
        assert replays >= 2, replays
        # A Renew was abandoned well within the lease (its deadline is a
        # third of it), and a later one landed.
        hung_for = [end - start for start, end, reason in renewals if reason == "DEADLINE_EXCEEDED"]
        assert hung_for and max(hung_for) < LEASE, renewals
        assert abandoned_then_renewed(), renewals
        messages = [(rec.levelno, rec.getMessage()) for rec in caplog.records if rec.name == "stateseal_mcp"]
        assert any(lvl == logging.WARNING and "renew failed" in m and "DEADLINE_EXCEEDED" in m for lvl, m in messages)
        assert not [m for lvl, m in messages if lvl >= logging.ERROR], caplog.text
    finally:
        SLOW["gate"] = None
        relays[1][0].close()
        await stop_relay(relays[0][0], relays[0][3] + relays[1][3], proc)


async def test_a_commit_try_against_a_hung_stateseal_is_abandoned_within_the_lease(tmp_path, caplog, monkeypatch):
    """Review F4: each try of a Commit is abandoned after a third of the
    lease, not the client's 5 s timeout, so the lease is renewed before
    the next try (no Renew goes while a try is in flight). Both replicas
    reach stateseal through a relay that stops forwarding as the handler
    returns (a stateseal that hangs): the first try (no commit delay: sent
    at once) hangs and is abandoned well within the 3 s lease. Let go, a
    later try lands: the replay is refused as already used, and the body
    ran once."""
    proc, addr = start_stateseal(tmp_path)
    relay, relay_addr, state, open_writers = await start_relay(addr)
    hung = state["flowing"]
    commit = RequestStateClient.commit
    #: Each Commit try: (started, ended, None or the failure's reason).
    tries: list[tuple[float, float, str | None]] = []

    async def recorded_commit(self, reservation, **kw):
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await commit(self, reservation, **kw)
        except StatesealError as e:
            tries.append((started, loop.time(), e.reason))
            raise
        tries.append((started, loop.time(), None))

    monkeypatch.setattr(RequestStateClient, "commit", recorded_commit)
    caplog.set_level(logging.INFO, logger="stateseal_mcp")
    SLOW.update(runs=0, gate=None, on_return=[hung.clear])
    try:
        async with deployment(relay_addr, lease_seconds=LEASE, commit_delay=0) as (url, served):
            async with Client(url, elicitation_callback=accept) as client:
                r = await client.session.call_tool("slow", {"amount": 15}, allow_input_required=True)
                assert isinstance(r, types.InputRequiredResult), r
                retry: dict[str, Any] = {"input_responses": answers(r), "request_state": r.request_state}
                done = await client.session.call_tool("slow", {"amount": 15}, **retry)  # on B
                assert "slow 15" in text_of(done), done
                SLOW["on_return"] = []
                with anyio.fail_after(DEADLINE):
                    while not any(reason == "DEADLINE_EXCEEDED" for _, _, reason in tries):
                        await anyio.sleep(0.05)
                hung.set()
                for b in BOUNDARIES:
                    assert await b.drain(DEADLINE), "a Commit is still kept"
                replay = client.session.call_tool("slow", {"amount": 15}, **retry, allow_input_required=True)
                assert_already_used(await error_of(replay))
        assert SLOW["runs"] == 1, SLOW
        hung_for = [end - start for start, end, reason in tries if reason == "DEADLINE_EXCEEDED"]
        # Its deadline is a third of the lease (the client's timeout: 5 s).
        assert hung_for and max(hung_for) < LEASE, tries
        assert tries[-1][2] is None, tries
    finally:
        hung.set()
        SLOW.update(gate=None, on_return=[])
        await stop_relay(relay, open_writers, proc)
