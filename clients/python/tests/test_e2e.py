"""End to end with the real SDK: two MCP server replicas behind a
round-robin front, the real client with an elicitation callback."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import logging
import os
from contextlib import asynccontextmanager
from typing import Annotated

import anyio
import httpx2
import mcp_types as types
import pytest
import uvicorn
from mcp import Client
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.resolve import Elicit, Resolve
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from stateseal_mcp import RequestStateClient, StatesealBoundary, install

from conftest import free_port, listener, start_stateseal

pytestmark = pytest.mark.anyio


class Confirm(BaseModel):
    confirm: bool


def ask(amount: int) -> Elicit[Confirm]:
    return Elicit(f"Transfer {amount}?", Confirm)


def ask_memo(text: str) -> Elicit[Confirm]:
    return Elicit(f"Store {len(text)} characters?", Confirm)


#: Tools whose next confirmed execution raises once (shared by the replicas).
FAIL_ONCE: set[str] = set()


#: The boundaries of the running deployment's replicas.
BOUNDARIES: list[StatesealBoundary] = []


async def drained() -> None:
    """Waits for every Commit the replicas run beside their answers."""
    for b in BOUNDARIES:
        await b.drain()


def replica(
    tag: str,
    stateseal_addr: str,
    served: list,
    bearer: str | None = None,
    reask: bool = True,
    credentials=None,
    **boundary_options,
) -> MCPServer:
    server = MCPServer("transfer-service")

    @server.tool()
    async def transfer(amount: int, confirm: Annotated[Confirm, Resolve(ask)]) -> str:
        return f"transferred {amount}" if confirm.confirm else "cancelled"

    @server.tool()
    async def memo(text: str, confirm: Annotated[Confirm, Resolve(ask_memo)]) -> str:
        return f"stored {len(text)} characters" if confirm.confirm else "cancelled"

    @server.tool()
    async def steps(ctx: Context) -> types.InputRequiredResult | str:
        # Hand-rolled MRTR: round 1 asks a name, round 2 a color, then done.
        state = json.loads(ctx.request_state) if ctx.request_state else {}
        answers = ctx.input_responses or {}

        def content(key):
            a = answers.get(key)
            a = a.model_dump(mode="json", by_alias=True, exclude_none=True) if hasattr(a, "model_dump") else a
            return a.get("content") if isinstance(a, dict) and a.get("action") == "accept" else None

        def ask_for(key, next_state):
            return types.InputRequiredResult.model_validate(
                {
                    "resultType": "input_required",
                    "inputRequests": {
                        key: {
                            "method": "elicitation/create",
                            "params": {
                                "message": f"{key}?",
                                "requestedSchema": {
                                    "type": "object",
                                    "properties": {key: {"type": "string"}},
                                    "required": [key],
                                },
                            },
                        }
                    },
                    "requestState": json.dumps(next_state),
                }
            )

        if state.get("at") == "name" and (content("name") or {}).get("name"):
            for hook in ON_SECOND_ROUND:
                hook()
            return ask_for("color", {"at": "color", "name": content("name")["name"]})
        if state.get("at") == "color" and (content("color") or {}).get("color"):
            return f"{state['name']} likes {content('color')['color']}"
        return ask_for("name", {"at": "name"})

    @server.tool()
    async def pay(amount: int, confirm: Annotated[Confirm, Resolve(ask)]) -> str:
        if "pay" in FAIL_ONCE:
            FAIL_ONCE.discard("pay")
            raise RuntimeError("payment backend hiccup")
        return f"paid {amount}" if confirm.confirm else "cancelled"

    @server.tool()
    async def slow(amount: int, confirm: Annotated[Confirm, Resolve(ask)]) -> str:
        # The body of a side-effecting tool: counted each time it runs. The
        # first run waits for SLOW["gate"] when the test set one.
        SLOW["runs"] += 1
        if SLOW["runs"] == 1 and SLOW["gate"] is not None:
            await SLOW["gate"].wait()
        for hook in SLOW["on_return"]:
            # A hook may be a coroutine function (awaited: the answer
            # waits for it).
            if inspect.isawaitable(started := hook()):
                await started
        return f"slow {amount}" if confirm.confirm else "cancelled"

    @server.tool()
    async def wipe(ctx: Context) -> types.InputRequiredResult | str:
        # Hand-rolled MRTR that asks without a requestState of its own (the
        # specification allows it) and trusts the answers it is handed, as a
        # handler behind a boundary that guarantees them may.
        a = (ctx.input_responses or {}).get("confirm")
        a = a.model_dump(mode="json", by_alias=True, exclude_none=True) if hasattr(a, "model_dump") else a
        if isinstance(a, dict) and a.get("action") == "accept" and (a.get("content") or {}).get("confirm") is True:
            WIPED.append((tag, ctx.request_state))
            return "wiped"
        return types.InputRequiredResult.model_validate(
            {
                "resultType": "input_required",
                "inputRequests": {
                    "confirm": {
                        "method": "elicitation/create",
                        "params": {
                            "message": "Wipe everything?",
                            "requestedSchema": {
                                "type": "object",
                                "properties": {"confirm": {"type": "boolean"}},
                                "required": ["confirm"],
                            },
                        },
                    }
                },
            }
        )

    @server.tool()
    async def close_account(ctx: Context) -> types.InputRequiredResult | str:
        # Hand-rolled MRTR whose first round asks nothing: "still working,
        # call again", a requestState and no questions (CLOSE_ROUND: no
        # `inputRequests`, or an empty one). On the retry it trusts a
        # `confirm` answer, as a handler behind a boundary that guarantees
        # its answers may.
        a = (ctx.input_responses or {}).get("confirm")
        a = a.model_dump(mode="json", by_alias=True, exclude_none=True) if hasattr(a, "model_dump") else a
        if isinstance(a, dict) and a.get("action") == "accept" and (a.get("content") or {}).get("ok") is True:
            CLOSED.append(tag)
            return "ACCOUNT CLOSED"
        if ctx.request_state == "working":
            return "still working"
        return types.InputRequiredResult.model_validate(
            {"resultType": "input_required", "requestState": "working", **CLOSE_ROUND}
        )

    client = RequestStateClient(stateseal_addr, bearer=bearer, credentials=credentials)
    boundary = StatesealBoundary(client, audience="transfer-service", reask=reask, **boundary_options)
    BOUNDARIES.append(boundary)
    install(server, boundary)

    async def record(ctx, call_next):
        if ctx.method == "tools/call":
            served.append((tag, (ctx.params or {}).get("requestState") is not None))
        return await call_next(ctx)

    server.middleware.insert(0, record)

    async def inner(ctx, call_next):
        # What the handler side sees, after the boundary.
        if ctx.method == "tools/call" and (ctx.params or {}).get("inputResponses") is not None:
            SEEN_ANSWERS.append(ctx.params["inputResponses"])
        return await call_next(ctx)

    server.middleware.append(inner)
    return server


#: inputResponses as the handlers saw them (after the boundary).
SEEN_ANSWERS: list = []
#: Called when the `steps` tool is about to answer its second round.
ON_SECOND_ROUND: list = []
#: How often the `slow` tool's body ran, the event its first run waits for,
#: and what each run calls just before it returns.
SLOW: dict = {"runs": 0, "gate": None, "on_return": []}
#: (replica tag, the requestState the handler saw) each time `wipe`'s body ran.
WIPED: list = []
#: What `close_account`'s first round carries besides its requestState
#: ({} or {"inputRequests": {}}), and the replica each time it acted.
CLOSE_ROUND: dict = {}
CLOSED: list = []


def front(backends: list[str]) -> Starlette:
    """Round robin over the replicas for every tools/call (as a load balancer
    would); everything else goes to the first replica."""
    rr = itertools.cycle(backends)
    http = httpx2.AsyncClient(timeout=30)

    async def proxy(request: Request) -> Response:
        body = await request.body()
        target = backends[0]
        try:
            if json.loads(body or b"{}").get("method") == "tools/call":
                target = next(rr)
        except (ValueError, AttributeError):
            pass
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        r = await http.request(request.method, target + "/mcp", content=body, headers=headers)
        drop = {"content-length", "transfer-encoding", "connection", "content-encoding"}
        return Response(r.content, status_code=r.status_code, headers={k: v for k, v in r.headers.items() if k.lower() not in drop})

    return Starlette(routes=[Route("/mcp", proxy, methods=["GET", "POST", "DELETE"])])


@asynccontextmanager
async def deployment(
    stateseal_addr: str,
    bearer: str | None = None,
    reask: bool = True,
    credentials=None,
    *,
    addrs: tuple[str, str] | None = None,
    **boundary_options,
):
    """Replicas A and B behind the round-robin front. `addrs`: a stateseal
    address for each replica (default: `stateseal_addr` for both);
    `boundary_options`: more StatesealBoundary options."""
    served: list = []
    BOUNDARIES.clear()
    socks = [listener(), listener(), listener()]
    ports = [s.getsockname()[1] for s in socks]
    apps = [
        replica(tag, addr, served, bearer, reask, credentials, **boundary_options).streamable_http_app(
            stateless_http=True, json_response=True
        )
        for tag, addr in zip(("A", "B"), addrs or (stateseal_addr, stateseal_addr))
    ]
    apps.append(front([f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"]))
    # Idle connections are kept open far longer than any client here keeps
    # them (httpx: 5 s), so a client never reuses one the server is closing
    # (uvicorn's default, 5 s too, races with it after an idle pause).
    servers = [
        uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", timeout_keep_alive=60)
        )
        for app, port in zip(apps, ports)
    ]
    async with anyio.create_task_group() as tg:
        for s, sock in zip(servers, socks):
            tg.start_soon(s.serve, [sock])
        with anyio.fail_after(20):
            while not all(s.started for s in servers):
                await anyio.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{ports[2]}/mcp", served
        finally:
            for s in servers:
                s.should_exit = True
    for sock in socks:
        sock.close()


async def accept(context, params):
    return types.ElicitResult(action="accept", content={"confirm": True})


async def test_sdk_retry_loop_completes_across_replicas(stateseal):
    async with deployment(stateseal) as (url, served):
        async with Client(url, elicitation_callback=accept) as client:
            result = await client.call_tool("transfer", {"amount": 42})
        assert not result.is_error, result
        assert "transferred 42" in json.dumps(result.model_dump(mode="json"))
        calls = [s for s in served]
        assert calls[0][1] is False and calls[1][1] is True, calls
        # The retry carrying requestState was served by the other replica.
        assert calls[0][0] != calls[1][0], calls


async def first_round(client) -> types.InputRequiredResult:
    r = await client.session.call_tool("transfer", {"amount": 42}, allow_input_required=True)
    assert isinstance(r, types.InputRequiredResult), r
    assert r.request_state
    return r


def answers(r: types.InputRequiredResult) -> dict:
    return {key: {"action": "accept", "content": {"confirm": True}} for key in r.input_requests}


def assert_already_used(e: MCPError) -> None:
    """REPLAYED under on_replay="error": the earlier retry went through."""
    assert (e.error.code, e.error.message, e.error.data) == (
        types.INVALID_PARAMS,
        "requestState already used",
        {"reason": "request_state_used"},
    ), e.error


def assert_in_progress(e: MCPError) -> None:
    """IN_USE under on_replay="error": retry later."""
    assert (e.error.code, e.error.message, e.error.data) == (
        types.INTERNAL_ERROR,
        "Request in progress; retry later",
        {"reason": "in_progress"},
    ), e.error


async def test_a_replay_is_asked_again_never_executed_with_on_replay_reask(stateseal):
    async with deployment(stateseal, on_replay="reask") as (url, served):
        async with Client(url, elicitation_callback=accept) as client:
            r = await first_round(client)
            done = await client.session.call_tool(
                "transfer", {"amount": 42}, input_responses=answers(r), request_state=r.request_state
            )
            assert "transferred 42" in json.dumps(done.model_dump(mode="json"))
            # The replay gets a fresh question (a new requestState), not a
            # second transfer.
            again = await client.session.call_tool(
                "transfer",
                {"amount": 42},
                input_responses=answers(r),
                request_state=r.request_state,
                allow_input_required=True,
            )
            assert isinstance(again, types.InputRequiredResult), again
            assert again.request_state and again.request_state != r.request_state


async def test_a_replay_is_refused_when_reask_is_off(stateseal):
    async with deployment(stateseal, reask=False, on_replay="reask") as (url, _):
        async with Client(url, elicitation_callback=accept) as client:
            r = await first_round(client)
            await client.session.call_tool(
                "transfer", {"amount": 42}, input_responses=answers(r), request_state=r.request_state
            )
            with pytest.raises(MCPError) as e:
                await client.session.call_tool(
                    "transfer", {"amount": 42}, input_responses=answers(r), request_state=r.request_state
                )
            assert e.value.error.code == types.INVALID_PARAMS
            assert e.value.error.message == "Invalid or expired requestState"


async def test_the_commit_runs_beside_the_answer_and_a_replay_waits_for_it(stateseal, monkeypatch):
    """Every Commit is held until the test lets it go: the answer goes out
    before it lands, the token stays held meanwhile (the handler never runs
    twice), and a replay on the other replica of this process waits for
    that Commit and gets "already used" rather than "in progress"."""
    commit = RequestStateClient.commit
    gate = asyncio.Event()
    landed: list[str] = []

    async def held_commit(self, reservation, **kw):
        await gate.wait()
        await commit(self, reservation, **kw)
        landed.append(reservation)

    monkeypatch.setattr(RequestStateClient, "commit", held_commit)
    async with deployment(stateseal) as (url, served):
        async with Client(url, elicitation_callback=accept) as client:
            r = await first_round(client)  # on A
            retry = {"input_responses": answers(r), "request_state": r.request_state}
            done = await client.session.call_tool("transfer", {"amount": 42}, **retry)  # on B
            assert "transferred 42" in text_of(done), done
            assert landed == [], "the answer waited for the Commit"
            # On A, while B's Commit is held: it waits for it. The Commit
            # is let go after 1 s, longer than the 375 ms an Open would
            # otherwise retry IN_USE for.
            replay = asyncio.ensure_future(
                error_of(client.session.call_tool("transfer", {"amount": 42}, **retry))
            )
            await asyncio.sleep(1.0)
            gate.set()
            assert_already_used(await replay)
            assert len(landed) == 1
            await drained()
    assert [tag for tag, with_state in served if with_state] == ["B", "A"], served


async def test_each_commit_rides_the_next_durable_open(stateseal, monkeypatch):
    """The Commit of a round trip waits for the next durable Open of its
    replica and is carried by it (`OpenRequest.commit`): no Commit of its
    own, and the token is used. drain() sends what is still waiting at once,
    each on its own."""
    commit, open_ = RequestStateClient.commit, RequestStateClient.open
    alone: list[str] = []
    carried: list[str] = []

    async def counted_commit(self, reservation, **kw):
        alone.append(reservation)
        await commit(self, reservation, **kw)

    async def counted_open(self, *args, commit=(), **kwargs):
        carried.extend(commit)
        return await open_(self, *args, commit=commit, **kwargs)

    monkeypatch.setattr(RequestStateClient, "commit", counted_commit)
    monkeypatch.setattr(RequestStateClient, "open", counted_open)
    async with deployment(stateseal) as (url, served):
        for b in BOUNDARIES:
            # No timer sends a Commit on its own during the test, however
            # slow the machine (the option itself is bounded at 0.25 s).
            b._commit_delay = 3600.0
        async with Client(url, elicitation_callback=accept) as client:
            retries = []
            for _ in range(2):
                r = await first_round(client)  # on A
                retries.append({"input_responses": answers(r), "request_state": r.request_state})
                done = await client.session.call_tool("transfer", {"amount": 42}, **retries[-1])  # on B
                assert "transferred 42" in text_of(done), done
            assert len(carried) == 1 and alone == [], (carried, alone)
            # The first round trip's token is used: committed by the carry.
            assert_already_used(await error_of(client.session.call_tool("transfer", {"amount": 42}, **retries[0])))
            await asyncio.wait_for(drained(), 10)
            assert len(alone) == 1 and alone[0] not in carried, (carried, alone)
            assert_already_used(await error_of(client.session.call_tool("transfer", {"amount": 42}, **retries[1])))
    assert [tag for tag, with_state in served if with_state] == ["B", "B", "A", "B"], served


async def test_a_failed_handler_does_not_burn_the_retry(stateseal):
    FAIL_ONCE.clear()
    FAIL_ONCE.add("pay")
    async with deployment(stateseal) as (url, served):
        async with Client(url, elicitation_callback=accept) as client:
            r = await client.session.call_tool("pay", {"amount": 5}, allow_input_required=True)
            assert isinstance(r, types.InputRequiredResult), r
            # The handler raises after stateseal opened the token: released.
            failed = await client.session.call_tool(
                "pay", {"amount": 5}, input_responses=answers(r), request_state=r.request_state
            )
            assert failed.is_error, failed
            # The corrected retry with the same state and answers succeeds.
            done = await client.session.call_tool(
                "pay", {"amount": 5}, input_responses=answers(r), request_state=r.request_state
            )
            assert "paid 5" in json.dumps(done.model_dump(mode="json")), done
            # And it was consumed by that success.
            with pytest.raises(MCPError) as e:
                await client.session.call_tool(
                    "pay", {"amount": 5}, input_responses=answers(r), request_state=r.request_state
                )
            assert_already_used(e.value)


async def test_an_at_most_once_target_spends_the_token_even_when_its_handler_fails(stateseal):
    """The operator's choice (DESIGN guarantee 11): a target listed in
    `at_most_once` is consumed before its handler runs, so a failed handler
    costs the user's retry, where the default (reserve, above) gives it
    back."""
    FAIL_ONCE.clear()
    FAIL_ONCE.add("pay")
    async with deployment(stateseal, at_most_once=["pay"]) as (url, served):
        async with Client(url, elicitation_callback=accept) as client:
            r = await client.session.call_tool("pay", {"amount": 5}, allow_input_required=True)
            assert isinstance(r, types.InputRequiredResult), r
            failed = await client.session.call_tool(
                "pay", {"amount": 5}, input_responses=answers(r), request_state=r.request_state
            )
            assert failed.is_error, failed
            assert "pay" not in FAIL_ONCE, "the handler ran (and failed)"
            with pytest.raises(MCPError) as e:
                await client.session.call_tool(
                    "pay", {"amount": 5}, input_responses=answers(r), request_state=r.request_state
                )
            assert_already_used(e.value)


async def test_changed_arguments_or_modified_state_are_rejected(stateseal):
    async with deployment(stateseal) as (url, _):
        async with Client(url, elicitation_callback=accept) as client:
            r = await first_round(client)
            tampered = r.request_state[:-2] + ("A" if r.request_state[-2] != "A" else "B") + r.request_state[-1]
            for args, state in (({"amount": 4200}, r.request_state), ({"amount": 42}, tampered)):
                with pytest.raises(MCPError) as e:
                    await client.session.call_tool(
                        "transfer", args, input_responses=answers(r), request_state=state
                    )
                assert e.value.error.code == types.INVALID_PARAMS
            # Neither attempt burned the token: the genuine retry still completes.
            done = await client.session.call_tool(
                "transfer", {"amount": 42}, input_responses=answers(r), request_state=r.request_state
            )
            assert "transferred 42" in json.dumps(done.model_dump(mode="json"))


async def test_stateseal_unreachable_is_a_retryable_internal_error(tmp_path):
    # A stateseal address where nothing listens.
    dead = f"127.0.0.1:{free_port()}"
    async with deployment(dead) as (url, _):
        async with Client(url, elicitation_callback=accept) as client:
            with pytest.raises(MCPError) as e:
                await client.session.call_tool("transfer", {"amount": 42}, allow_input_required=True)
            assert e.value.error.code == types.INTERNAL_ERROR
            assert "Temporarily unavailable" in e.value.error.message


async def test_rejection_reasons_stay_in_the_server_log(stateseal, caplog):
    async with deployment(stateseal) as (url, _):
        async with Client(url, elicitation_callback=accept) as client:
            r = await first_round(client)
            with pytest.raises(MCPError) as e:
                await client.session.call_tool(
                    "transfer", {"amount": 1}, input_responses=answers(r), request_state=r.request_state
                )
            # The client sees only the SDK's frozen message; the reason is logged here.
            assert "REJECTED" not in json.dumps(e.value.error.model_dump(mode="json"))
            assert any("REJECTED" in rec.getMessage() for rec in caplog.records)


async def test_bearer_credentials(tmp_path):
    import hashlib

    tenants = tmp_path / "tenants.json"
    digest = hashlib.sha256(b"s3cret-of-transfer").hexdigest()
    tenants.write_text(json.dumps({"tenants": [{"name": "transfer", "bearer_sha256": digest}]}))
    proc, addr = start_stateseal(tmp_path, "--auth", "bearer", "--tenants", str(tenants))
    try:
        async with deployment(addr, bearer="s3cret-of-transfer") as (url, _):
            async with Client(url, elicitation_callback=accept) as client:
                result = await client.call_tool("transfer", {"amount": 7})
            assert "transferred 7" in json.dumps(result.model_dump(mode="json"))
        async with deployment(addr, bearer="wrong-secret") as (url, _):
            async with Client(url, elicitation_callback=accept) as client:
                with pytest.raises(MCPError) as e:
                    await client.session.call_tool("transfer", {"amount": 7}, allow_input_required=True)
                assert e.value.error.code == types.INTERNAL_ERROR
    finally:
        proc.terminate()
        proc.wait(timeout=20)


async def test_answers_are_filtered_against_the_sealed_questions(stateseal):
    SEEN_ANSWERS.clear()
    async with deployment(stateseal) as (url, _):
        async with Client(url, elicitation_callback=accept) as client:
            r = await first_round(client)
            # An answer to a question nobody asked never reaches the handler.
            forged = {**answers(r), "admin_override": {"action": "accept", "content": {"admin": True}}}
            done = await client.session.call_tool(
                "transfer", {"amount": 42}, input_responses=forged, request_state=r.request_state
            )
            assert "transferred 42" in json.dumps(done.model_dump(mode="json")), done
            assert SEEN_ANSWERS[-1] == answers(r)
            # An answer of the wrong type is dropped and the request runs
            # afresh: a new question, no answers reach the handler.
            r = await first_round(client)
            seen = len(SEEN_ANSWERS)
            wrong = {key: {"action": "accept", "content": {"confirm": "yes"}} for key in r.input_requests}
            again = await client.session.call_tool(
                "transfer", {"amount": 42}, input_responses=wrong, request_state=r.request_state,
                allow_input_required=True,
            )
            assert isinstance(again, types.InputRequiredResult), again
            assert again.request_state != r.request_state
            assert len(SEEN_ANSWERS) == seen
            # The fresh question is answered normally.
            done = await client.session.call_tool(
                "transfer", {"amount": 42}, input_responses=answers(again), request_state=again.request_state
            )
            assert "transferred 42" in json.dumps(done.model_dump(mode="json")), done


async def test_big_integers_bind_exactly(stateseal):
    async with deployment(stateseal) as (url, _):
        async with Client(url, elicitation_callback=accept) as client:
            big = 2**53 + 1
            r = await client.session.call_tool("transfer", {"amount": big}, allow_input_required=True)
            assert isinstance(r, types.InputRequiredResult), r
            # 2^53 is the same double as 2^53+1, but not the same number.
            with pytest.raises(MCPError) as e:
                await client.session.call_tool(
                    "transfer", {"amount": 2**53}, input_responses=answers(r), request_state=r.request_state
                )
            assert e.value.error.code == types.INVALID_PARAMS
            done = await client.session.call_tool(
                "transfer", {"amount": big}, input_responses=answers(r), request_state=r.request_state
            )
            assert f"transferred {big}" in json.dumps(done.model_dump(mode="json"))


async def test_params_over_one_mebibyte_round_trip(stateseal):
    # Only the 32-byte digest goes to stateseal, so the size of the params
    # is the MCP server's business, as with the SDK's own boundary.
    async with deployment(stateseal) as (url, _):
        async with Client(url, elicitation_callback=accept) as client:
            text = "x" * (1_300_000)
            result = await client.call_tool("memo", {"text": text})
            assert not result.is_error, result
            assert "stored 1300000 characters" in json.dumps(result.model_dump(mode="json"))


def _pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and a client certificate
    with a URI SAN, made with `cryptography` (PEM bytes)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("test CA"))
        .issuer_name(name("test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn, san, server):
        key = ec.generate_private_key(ec.SECP256R1())
        usage = x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        pem_key = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cert.public_bytes(serialization.Encoding.PEM), pem_key

    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    server = leaf("stateseal", x509.IPAddress(ipaddress.ip_address("127.0.0.1")), True)
    client = leaf("transfer", x509.UniformResourceIdentifier("spiffe://test/transfer-service"), False)
    other = leaf("intruder", x509.UniformResourceIdentifier("spiffe://test/someone-else"), False)
    return ca_pem, server, client, other


async def test_mtls_credentials(tmp_path):
    import grpc

    ca_pem, (scert, skey), (ccert, ckey), (ocert, okey) = _pki(tmp_path)
    files = {}
    for n, data in (("ca.pem", ca_pem), ("server.pem", scert), ("server.key", skey)):
        files[n] = tmp_path / n
        files[n].write_bytes(data)
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "transfer", "uri": "spiffe://test/transfer-service"}]}))
    proc, addr = start_stateseal(
        tmp_path,
        "--auth", "mtls",
        "--tls-cert", str(files["server.pem"]),
        "--tls-key", str(files["server.key"]),
        "--tls-client-ca", str(files["ca.pem"]),
        "--tenants", str(tenants),
    )
    try:
        good = grpc.ssl_channel_credentials(ca_pem, ckey, ccert)
        async with deployment(addr, credentials=good) as (url, served):
            async with Client(url, elicitation_callback=accept) as client:
                result = await client.call_tool("transfer", {"amount": 9})
            assert "transferred 9" in json.dumps(result.model_dump(mode="json"))
            # Both rounds went through stateseal over mTLS, on two replicas.
            assert len({tag for tag, _ in served}) == 2, served
        # A certificate of the same CA naming no tenant: a configuration
        # problem between this server and stateseal, not the client's fault.
        bad = grpc.ssl_channel_credentials(ca_pem, okey, ocert)
        async with deployment(addr, credentials=bad) as (url, _):
            async with Client(url, elicitation_callback=accept) as client:
                with pytest.raises(MCPError) as e:
                    await client.session.call_tool("transfer", {"amount": 9}, allow_input_required=True)
                assert e.value.error.code == types.INTERNAL_ERROR
                assert e.value.error.message == "Internal error"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


async def start_relay(addr: str):
    """A TCP relay to stateseal. `state["lose_next"]`: the next bytes sent go
    through, their answers are lost and the connection drops 0.3 s later.
    `state["drop_next"] = n`: the next n sends (each on its own connection)
    are not forwarded and their connection drops at once.
    `state["flowing"].clear()`: nothing goes through either way (a network
    partition; the bytes wait in order) until `state["flowing"].set()`."""
    host, port = addr.rsplit(":", 1)
    state = {"lose_next": False, "lost": 0, "drop_next": 0, "dropped": 0, "flowing": asyncio.Event()}
    state["flowing"].set()
    open_writers: list = []

    async def handle(down_r, down_w):
        up_r, up_w = await asyncio.open_connection(host, int(port))
        open_writers.extend((down_w, up_w))
        losing = False

        async def pump_down():
            try:
                while data := await up_r.read(65536):
                    await state["flowing"].wait()
                    if not losing:
                        down_w.write(data)
                        await down_w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                down_w.close()

        task = asyncio.create_task(pump_down())
        try:
            while data := await down_r.read(65536):
                if state["drop_next"] > 0:
                    state["drop_next"] -= 1
                    state["dropped"] += 1
                    break
                if state["lose_next"] and not losing:
                    state["lose_next"] = False
                    state["lost"] += 1
                    losing = True
                    asyncio.get_running_loop().call_later(0.3, lambda: (down_w.close(), up_w.close()))
                await state["flowing"].wait()
                up_w.write(data)
                await up_w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            up_w.close()
            down_w.close()
            task.cancel()

    relay = await asyncio.start_server(handle, "127.0.0.1", 0)
    return relay, f"127.0.0.1:{relay.sockets[0].getsockname()[1]}", state, open_writers


async def stop_relay(relay, open_writers: list, stateseal) -> None:
    """Closes the relay and its connections (so stateseal sees them go),
    then stops stateseal."""
    relay.close()
    for w in open_writers:
        w.close()
    await asyncio.gather(*(w.wait_closed() for w in open_writers), return_exceptions=True)
    stateseal.terminate()
    stateseal.wait(timeout=20)


async def test_an_open_whose_answer_is_lost_is_retried_safely(tmp_path, caplog):
    """A relay between the MCP servers and stateseal forwards the Open but
    loses its answer and drops the connection: the boundary retries with the
    same attempt id, the handler runs once, the token is consumed once."""
    import logging

    proc, addr = start_stateseal(tmp_path)
    relay, relay_addr, state, open_writers = await start_relay(addr)
    try:
        caplog.set_level(logging.WARNING, logger="stateseal_mcp")
        async with deployment(relay_addr) as (url, _):
            async with Client(url, elicitation_callback=accept) as client:
                r = await first_round(client)
                state["lose_next"] = True
                done = await client.session.call_tool(
                    "transfer", {"amount": 42}, input_responses=answers(r), request_state=r.request_state
                )
                assert state["lost"] == 1
                assert "transferred 42" in json.dumps(done.model_dump(mode="json")), done
                assert any("retrying" in rec.getMessage() for rec in caplog.records), caplog.text
                # Consumed exactly once: the replay is refused.
                with pytest.raises(MCPError) as e:
                    await client.session.call_tool(
                        "transfer", {"amount": 42}, input_responses=answers(r), request_state=r.request_state
                    )
                assert_already_used(e.value)
    finally:
        await stop_relay(relay, open_writers, proc)


def test_nan_and_lone_surrogates_are_refused_cleanly():
    """Params that cannot be bound answer -32602 "Invalid params" (no
    traceback) — and only when they must be bound."""
    boundary = StatesealBoundary(RequestStateClient("127.0.0.1:9"), audience="a")
    for params in (
        {"name": "t", "arguments": {"x": float("nan")}},
        {"name": "t", "arguments": {"x": float("inf")}},
        {"name": "t\ud800", "arguments": {}},
        {"name": "t", "arguments": {"\udc00": 1}},
    ):
        with pytest.raises(MCPError) as e:
            boundary._digest("tools/call", params)
        assert e.value.error.code == types.INVALID_PARAMS
        assert e.value.error.message == "Invalid params"


async def test_a_failed_seal_of_the_next_round_gives_the_token_back(tmp_path):
    """stateseal unreachable between Open and the next round's Seal: the
    client gets a retryable error, the reservation is released, and the
    retry with the same state and answers goes on."""
    proc, addr = start_stateseal(tmp_path)
    relay, relay_addr, state, open_writers = await start_relay(addr)
    ON_SECOND_ROUND.clear()
    try:
        async with deployment(relay_addr) as (url, _):
            async with Client(url, elicitation_callback=accept) as client:
                r1 = await client.session.call_tool("steps", {}, allow_input_required=True)
                assert isinstance(r1, types.InputRequiredResult), r1
                name = {"name": {"action": "accept", "content": {"name": "Ann"}}}
                # The Seal of round 2 is the next thing sent to stateseal; the
                # first Release after it fails too (its new connection
                # drops): the boundary retries the Release, which waits for
                # the channel to reconnect.
                ON_SECOND_ROUND.append(lambda: state.update(drop_next=2))
                with pytest.raises(MCPError) as e:
                    await client.session.call_tool(
                        "steps", {}, input_responses=name, request_state=r1.request_state
                    )
                assert state["dropped"] == 2
                assert e.value.error.code == types.INTERNAL_ERROR
                assert e.value.error.message == "Temporarily unavailable; retry"
                ON_SECOND_ROUND.clear()
                # Released: the same retry goes on to round 2, then finishes.
                r2 = await client.session.call_tool(
                    "steps", {}, input_responses=name, request_state=r1.request_state, allow_input_required=True
                )
                assert isinstance(r2, types.InputRequiredResult), r2
                assert set(r2.input_requests or {}) == {"color"}, r2
                done = await client.session.call_tool(
                    "steps",
                    {},
                    input_responses={"color": {"action": "accept", "content": {"color": "blue"}}},
                    request_state=r2.request_state,
                )
                assert "Ann likes blue" in json.dumps(done.model_dump(mode="json")), done
    finally:
        await stop_relay(relay, open_writers, proc)


def ledger_args(ledger: str, capsys) -> tuple[str, ...]:
    """stateseal flags for the ledger under test. PostgreSQL needs
    STATESEAL_TEST_DATABASE_URL (CI sets it); without it the test is skipped,
    saying so on the terminal even under output capture."""
    if ledger == "sled":
        return ()
    url = os.environ.get("STATESEAL_TEST_DATABASE_URL")
    if not url:
        with capsys.disabled():
            print("\nSKIPPED: STATESEAL_TEST_DATABASE_URL is unset, so the PostgreSQL ledger is not tested")
        pytest.skip("STATESEAL_TEST_DATABASE_URL is unset")
    return ("--ledger", "postgres", "--database-url", url)


def text_of(result) -> str:
    return json.dumps(result.model_dump(mode="json"))


async def error_of(call) -> MCPError:
    """The JSON-RPC error `call` answers; fails, naming the result and how
    often `slow` ran, when it answers a result."""
    try:
        got = await call
    except MCPError as e:
        return e
    # Named without its requestState: a test never prints a whole token.
    what = "a fresh input_required" if isinstance(got, types.InputRequiredResult) else f"the result {text_of(got)}"
    pytest.fail(f"expected a JSON-RPC error, got {what} (slow ran {SLOW['runs']} times)")


@pytest.mark.parametrize("ledger", ["sled", "postgres"])
async def test_a_handler_slower_than_its_lease_runs_once(tmp_path, caplog, capsys, ledger):
    """stateseal grants 2 s leases; the handler runs for over 5 s. The
    boundary renews the lease while the handler runs, so the same retry
    (same requestState, same answers) replayed meanwhile gets the retryable
    "in progress" error instead of taking the token over, and replayed after
    the handler returned gets "requestState already used". The handler's
    body ran exactly once."""
    proc, addr = start_stateseal(tmp_path, "--default-lease-s", "2", *ledger_args(ledger, capsys))
    caplog.set_level(logging.INFO, logger="stateseal_mcp")
    SLOW.update(runs=0, gate=anyio.Event())
    outcome: dict = {}
    try:
        async with deployment(addr) as (url, served):
            try:
                async with Client(url, elicitation_callback=accept) as client:
                    r = await client.session.call_tool("slow", {"amount": 7}, allow_input_required=True)
                    assert isinstance(r, types.InputRequiredResult), r
                    retry = {"input_responses": answers(r), "request_state": r.request_state}

                    async def run_retry():
                        outcome["result"] = await client.session.call_tool("slow", {"amount": 7}, **retry)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(run_retry)
                        with anyio.fail_after(60):  # liveness only
                            while SLOW["runs"] == 0:
                                await anyio.sleep(0.05)
                        # Over two leases: without renewals the lease would
                        # have run out by now, and the replay would take the
                        # token over and run the handler again.
                        await anyio.sleep(5)
                        replay = client.session.call_tool("slow", {"amount": 7}, **retry, allow_input_required=True)
                        assert_in_progress(await error_of(replay))
                        SLOW["gate"].set()
                    assert "slow 7" in text_of(outcome["result"]), outcome
                    replay = client.session.call_tool("slow", {"amount": 7}, **retry, allow_input_required=True)
                    assert_already_used(await error_of(replay))
            finally:
                SLOW["gate"].set()  # never leave a handler waiting at shutdown
        assert SLOW["runs"] == 1, SLOW
        # The retry and both replays were served across the two replicas.
        assert [tag for tag, with_state in served if with_state] == ["B", "A", "B"], served
        # No reservation lost, no token taken over.
        messages = [rec.getMessage() for rec in caplog.records]
        lost = [m for m in messages if "reservation lost" in m or "taken over" in m]
        assert not lost, caplog.text
        assert any("IN_USE" in rec.getMessage() for rec in caplog.records), caplog.text
    finally:
        SLOW["gate"] = None
        proc.terminate()
        proc.wait(timeout=20)


async def test_a_holder_cut_off_from_stateseal_loses_its_lease(tmp_path, caplog):
    """Replica B holds the reservation, then cannot reach stateseal (a relay
    holds its traffic) for longer than the lease: its renewals fail
    (WARNING), and the replay on replica A takes the token over after the
    lease and runs the handler again. When B's handler returns, its result
    stands and its Commit answers LEASE_EXPIRED: an ERROR log says the token
    was taken over. (The README's "what at most once means": reserve mode
    holds only while the holder reaches stateseal.)"""
    proc, addr = start_stateseal(tmp_path, "--default-lease-s", "2")
    relay, relay_addr, state, open_writers = await start_relay(addr)
    caplog.set_level(logging.WARNING, logger="stateseal_mcp")
    SLOW.update(runs=0, gate=anyio.Event())
    outcome: dict = {}
    try:
        async with deployment(addr, addrs=(addr, relay_addr)) as (url, served):
            try:
                async with Client(url, elicitation_callback=accept) as client:
                    r = await client.session.call_tool("slow", {"amount": 8}, allow_input_required=True)
                    assert isinstance(r, types.InputRequiredResult), r
                    retry = {"input_responses": answers(r), "request_state": r.request_state}

                    async def run_retry():
                        outcome["result"] = await client.session.call_tool("slow", {"amount": 8}, **retry)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(run_retry)  # on B, through the relay
                        with anyio.fail_after(60):
                            while SLOW["runs"] == 0:
                                await anyio.sleep(0.05)
                        state["flowing"].clear()
                        # Longer than the lease, and than the 5 s timeout of
                        # the renewal stuck in the relay.
                        await anyio.sleep(7)
                        taken_over = await client.session.call_tool("slow", {"amount": 8}, **retry)  # on A
                        assert "slow 8" in text_of(taken_over), taken_over
                        state["flowing"].set()
                        SLOW["gate"].set()
                    # B's handler ran too: its result stands, and its
                    # Commit, beside the answer, finds the token taken.
                    assert "slow 8" in text_of(outcome["result"]), outcome
                    await drained()
            finally:
                state["flowing"].set()
                SLOW["gate"].set()
        assert [tag for tag, with_state in served if with_state] == ["B", "A"], served
        assert SLOW["runs"] == 2, SLOW
        messages = [(rec.levelno, rec.getMessage()) for rec in caplog.records]
        assert any(lvl == logging.WARNING and "renew failed" in m for lvl, m in messages), caplog.text
        assert any(lvl == logging.ERROR and "taken over" in m for lvl, m in messages), caplog.text
    finally:
        SLOW["gate"] = None
        await stop_relay(relay, open_writers, proc)


async def raw_call(url: str, method: str, params: dict) -> dict:
    """One JSON-RPC request as a 2026-07-28 client sends it, written by
    hand so that params the SDK client never sends (`requestState: null`)
    go on the wire."""
    from mcp_types import CLIENT_CAPABILITIES_META_KEY, CLIENT_INFO_META_KEY, PROTOCOL_VERSION_META_KEY
    from mcp_types.version import LATEST_MODERN_VERSION

    meta = {
        PROTOCOL_VERSION_META_KEY: LATEST_MODERN_VERSION,
        CLIENT_INFO_META_KEY: {"name": "raw", "version": "1"},
        CLIENT_CAPABILITIES_META_KEY: {"elicitation": {"form": {}}},
    }
    name = params.get("uri") if method == "resources/read" else params.get("name")
    async with httpx2.AsyncClient(timeout=30) as http:
        r = await http.post(
            url,
            json={"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": meta}},
            headers={
                "accept": "application/json, text/event-stream",
                "mcp-protocol-version": LATEST_MODERN_VERSION,
                "mcp-method": method,
                "mcp-name": name,
            },
        )
    assert r.status_code == 200, (r.status_code, r.text[:500])
    return r.json()


async def test_answers_without_a_token_never_reach_the_handler(stateseal, caplog):
    """inputResponses without a sealed requestState (absent, or null) answer
    no question this server asked: the boundary removes them, so a handler
    that trusts its answers asks instead of acting. The handler asks without
    a requestState of its own, so the boundary mints one: the genuine retry
    carries it, runs once, and the handler sees no requestState."""
    SEEN_ANSWERS.clear()
    WIPED.clear()
    caplog.set_level(logging.DEBUG, logger="stateseal_mcp")
    forged = {"confirm": {"action": "accept", "content": {"confirm": True}}}
    async with deployment(stateseal) as (url, _):
        async with Client(url, elicitation_callback=accept) as client:
            # requestState absent.
            r = await client.session.call_tool("wipe", {}, input_responses=forged, allow_input_required=True)
            assert isinstance(r, types.InputRequiredResult), r
            # requestState null (the SDK client never sends a null, so raw).
            for tool in ("wipe", "transfer"):
                args = {"amount": 3} if tool == "transfer" else {}
                body = await raw_call(
                    url, "tools/call", {"name": tool, "arguments": args, "inputResponses": forged, "requestState": None}
                )
                assert body.get("result", {}).get("resultType") == "input_required", body
            assert WIPED == [] and SEEN_ANSWERS == [], (WIPED, SEEN_ANSWERS)
            assert any("inputResponses without requestState" in rec.getMessage() for rec in caplog.records)
            # The question went out with a token minted by the boundary, and
            # answers that come with it go through, once.
            assert r.request_state, r
            done = await client.session.call_tool("wipe", {}, input_responses=answers(r), request_state=r.request_state)
            assert "wiped" in text_of(done), done
            assert len(SEEN_ANSWERS) == 1, SEEN_ANSWERS
            assert [state for _, state in WIPED] == [None], WIPED
            with pytest.raises(MCPError) as e:
                await client.session.call_tool("wipe", {}, input_responses=answers(r), request_state=r.request_state)
            assert_already_used(e.value)
            assert len(WIPED) == 1, WIPED


@pytest.mark.parametrize("round_one", [{}, {"inputRequests": {}}], ids=["no-input-requests", "empty-input-requests"])
async def test_a_round_that_asks_nothing_lets_no_answer_through(stateseal, caplog, round_one):
    """Issue 58, finding 1: a first round that answers input_required with
    only a requestState ("still working, call again") is sealed with a
    manifest of no questions, so the retry's forged answer never reaches
    the handler, and the tool does not act."""
    SEEN_ANSWERS.clear()
    CLOSED.clear()
    CLOSE_ROUND.clear()
    CLOSE_ROUND.update(round_one)
    caplog.set_level(logging.INFO, logger="stateseal_mcp")
    forged = {"confirm": {"action": "accept", "content": {"ok": True}}}
    try:
        async with deployment(stateseal) as (url, _):
            async with Client(url, elicitation_callback=accept) as client:
                r = await client.session.call_tool("close_account", {}, allow_input_required=True)
                assert isinstance(r, types.InputRequiredResult), r
                assert r.request_state and not r.input_requests, r.input_requests
                done = await client.session.call_tool(
                    "close_account", {}, input_responses=forged, request_state=r.request_state
                )
                assert "still working" in text_of(done), done
                # The token is spent all the same: its replay is refused.
                with pytest.raises(MCPError) as e:
                    await client.session.call_tool(
                        "close_account", {}, input_responses=forged, request_state=r.request_state
                    )
                assert_already_used(e.value)
        assert CLOSED == [], "the tool acted on an answer to a question nobody asked"
        assert all(not seen for seen in SEEN_ANSWERS), SEEN_ANSWERS
        assert any(
            'inputResponses["confirm"] dropped' in rec.getMessage() and "UNASKED" in rec.getMessage()
            for rec in caplog.records
        ), caplog.text
    finally:
        CLOSE_ROUND.clear()


@pytest.mark.parametrize("on_replay", ["error", "reask"])
async def test_the_replay_reaction(stateseal, on_replay):
    """The same retry sent again while the first runs (IN_USE) and after it
    completed (REPLAYED). "error" (the default): the retryable "in
    progress" error, then "requestState already used". "reask": a fresh
    question each time. Either way the body runs once."""
    options = {} if on_replay == "error" else {"on_replay": on_replay}
    SLOW.update(runs=0, gate=anyio.Event())
    outcome: dict = {}
    try:
        async with deployment(stateseal, **options) as (url, _):
            try:
                async with Client(url, elicitation_callback=accept) as client:
                    r = await client.session.call_tool("slow", {"amount": 9}, allow_input_required=True)
                    assert isinstance(r, types.InputRequiredResult), r
                    retry = {"input_responses": answers(r), "request_state": r.request_state}

                    async def replay():
                        if on_replay == "error":
                            return await error_of(
                                client.session.call_tool("slow", {"amount": 9}, **retry, allow_input_required=True)
                            )
                        again = await client.session.call_tool(
                            "slow", {"amount": 9}, **retry, allow_input_required=True
                        )
                        assert isinstance(again, types.InputRequiredResult), again
                        assert again.request_state and again.request_state != r.request_state
                        return again

                    async def run_retry():
                        outcome["result"] = await client.session.call_tool("slow", {"amount": 9}, **retry)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(run_retry)
                        with anyio.fail_after(60):
                            while SLOW["runs"] == 0:
                                await anyio.sleep(0.05)
                        during = await replay()
                        SLOW["gate"].set()
                    assert "slow 9" in text_of(outcome["result"]), outcome
                    after = await replay()
                    if on_replay == "error":
                        assert_in_progress(during)
                        assert_already_used(after)
            finally:
                SLOW["gate"].set()
        assert SLOW["runs"] == 1, SLOW
    finally:
        SLOW["gate"] = None


async def test_a_commit_whose_connection_drops_is_retried(tmp_path, caplog):
    """The connection to stateseal drops under the Commit (when the handler
    returns, a relay holds what its replica sends, then drops the
    connections 2 s later, so the Commit never reaches stateseal): the
    answer goes out at once (the Commit runs beside it), the boundary
    retries the Commit (it is idempotent), so the token is consumed and the
    replay gets "already used", not "in progress" until the lease runs
    out."""
    proc, addr = start_stateseal(tmp_path)
    relay, relay_addr, state, open_writers = await start_relay(addr)
    caplog.set_level(logging.WARNING, logger="stateseal_mcp")

    def drop_connections():
        for w in list(open_writers):
            w.close()
        state["dropped"] += 1
        state["flowing"].set()

    def hold_then_drop():
        state["flowing"].clear()
        asyncio.get_running_loop().call_later(2, drop_connections)

    SLOW.update(runs=0, gate=None, on_return=[hold_then_drop])
    try:
        async with deployment(addr, addrs=(addr, relay_addr)) as (url, served):
            async with Client(url, elicitation_callback=accept) as client:
                r = await client.session.call_tool("slow", {"amount": 4}, allow_input_required=True)
                assert isinstance(r, types.InputRequiredResult), r
                retry = {"input_responses": answers(r), "request_state": r.request_state}
                done = await client.session.call_tool("slow", {"amount": 4}, **retry)  # on B, through the relay
                assert "slow 4" in text_of(done), done
                # The answer went out while the relay still held the
                # Commit, which runs beside it, through the drop and the
                # retry.
                assert state["dropped"] == 0
                SLOW["on_return"] = []
                # On A, while B's Commit is held: the token is still B's.
                # In progress, or already used if the hold ended first.
                e = await error_of(client.session.call_tool("slow", {"amount": 4}, **retry, allow_input_required=True))
                assert e.error.data in ({"reason": "in_progress"}, {"reason": "request_state_used"}), e.error
                # On B: it waits for its own Commit, then answers.
                replay = client.session.call_tool("slow", {"amount": 4}, **retry, allow_input_required=True)
                assert_already_used(await error_of(replay))
                await drained()
                assert state["dropped"] == 1
        assert [tag for tag, with_state in served if with_state] == ["B", "A", "B"], served
        assert SLOW["runs"] == 1, SLOW
        messages = [rec.getMessage() for rec in caplog.records]
        assert any("commit" in m and "retrying" in m for m in messages), caplog.text
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text
    finally:
        SLOW.update(gate=None, on_return=[])
        await stop_relay(relay, open_writers, proc)
