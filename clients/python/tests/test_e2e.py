"""End to end with the real SDK: two MCP server replicas behind a
round-robin front, the real client with an elicitation callback."""

from __future__ import annotations

import asyncio
import itertools
import json
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

from conftest import free_port, start_stateseal

pytestmark = pytest.mark.anyio


class Confirm(BaseModel):
    confirm: bool


def ask(amount: int) -> Elicit[Confirm]:
    return Elicit(f"Transfer {amount}?", Confirm)


def ask_memo(text: str) -> Elicit[Confirm]:
    return Elicit(f"Store {len(text)} characters?", Confirm)


#: Tools whose next confirmed execution raises once (shared by the replicas).
FAIL_ONCE: set[str] = set()


def replica(
    tag: str,
    stateseal_addr: str,
    served: list,
    bearer: str | None = None,
    reask: bool = True,
    credentials=None,
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

    client = RequestStateClient(stateseal_addr, bearer=bearer, credentials=credentials)
    install(server, StatesealBoundary(client, audience="transfer-service", reask=reask))

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
async def deployment(stateseal_addr: str, bearer: str | None = None, reask: bool = True, credentials=None):
    served: list = []
    ports = [free_port(), free_port(), free_port()]
    apps = [
        replica(tag, stateseal_addr, served, bearer, reask, credentials).streamable_http_app(
            stateless_http=True, json_response=True
        )
        for tag in ("A", "B")
    ]
    apps.append(front([f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"]))
    servers = [
        uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
        for app, port in zip(apps, ports)
    ]
    async with anyio.create_task_group() as tg:
        for s in servers:
            tg.start_soon(s.serve)
        with anyio.fail_after(20):
            while not all(s.started for s in servers):
                await anyio.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{ports[2]}/mcp", served
        finally:
            for s in servers:
                s.should_exit = True


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


async def test_a_replay_is_asked_again_never_executed(stateseal):
    async with deployment(stateseal) as (url, served):
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
    async with deployment(stateseal, reask=False) as (url, _):
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
            again = await client.session.call_tool(
                "pay", {"amount": 5}, input_responses=answers(r), request_state=r.request_state,
                allow_input_required=True,
            )
            assert isinstance(again, types.InputRequiredResult), again


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
    are not forwarded and their connection drops at once."""
    host, port = addr.rsplit(":", 1)
    state = {"lose_next": False, "lost": 0, "drop_next": 0, "dropped": 0}
    open_writers: list = []

    async def handle(down_r, down_w):
        up_r, up_w = await asyncio.open_connection(host, int(port))
        open_writers.extend((down_w, up_w))
        losing = False

        async def pump_down():
            try:
                while data := await up_r.read(65536):
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
                # Consumed exactly once: the replay is asked again.
                again = await client.session.call_tool(
                    "transfer", {"amount": 42}, input_responses=answers(r), request_state=r.request_state,
                    allow_input_required=True,
                )
                assert isinstance(again, types.InputRequiredResult), again
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
