"""Client faults stay client faults: what an end user (the MCP client) sends
never raises an operator alarm (an ERROR log line) nor reads as a
configuration problem (-32603 Internal error).

- A `requestState` or `inputResponses` over the service's limits is refused
  with -32602 before stateseal is called, logged at debug only.
- A message stateseal's transport refuses as too large (`OUT_OF_RANGE`,
  here because the server runs with smaller limits than the package's) is
  -32602 as well, without an ERROR line.
"""

from __future__ import annotations

import json
import logging

import grpc
import mcp_types as types
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from stateseal_mcp import RequestStateClient, StatesealError

from conftest import start_stateseal
from test_e2e import accept, answers, deployment, first_round

pytestmark = pytest.mark.anyio

TWO_MIB = 2 * 1024 * 1024


@pytest.fixture
def opens(monkeypatch) -> list[int]:
    """Counts every Open the boundaries send to stateseal."""
    calls: list[int] = []
    original = RequestStateClient.open

    async def counting(self, *args, **kwargs):
        calls.append(1)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(RequestStateClient, "open", counting)
    return calls


def errors_logged(caplog) -> list[str]:
    """Every ERROR (or worse) line of any logger, messages only."""
    return [f"{r.name}: {r.getMessage()[:200]}" for r in caplog.records if r.levelno >= logging.ERROR]


def boundary_lines_above_debug(caplog) -> list[str]:
    return [
        f"{r.levelname} {r.getMessage()[:200]}"
        for r in caplog.records
        if r.name == "stateseal_mcp" and r.levelno > logging.DEBUG
    ]


async def test_an_oversized_request_state_is_refused_before_stateseal(stateseal, caplog, opens):
    caplog.set_level(logging.DEBUG, logger="stateseal_mcp")
    async with deployment(stateseal) as (url, _):
        async with Client(url, elicitation_callback=accept) as client:
            caplog.clear()
            with pytest.raises(MCPError) as e:
                await client.session.call_tool(
                    "transfer",
                    {"amount": 42},
                    input_responses={"confirm": {"action": "accept", "content": {"confirm": True}}},
                    request_state="A" * TWO_MIB,
                    allow_input_required=True,
                )
    err = e.value.error
    assert (err.code, err.message, err.data) == (
        types.INVALID_PARAMS,
        "Invalid or expired requestState",
        {"reason": "invalid_request_state"},
    ), (err.code, err.message)
    assert opens == [], "stateseal was called"
    assert errors_logged(caplog) == []
    assert boundary_lines_above_debug(caplog) == []
    assert any(
        r.levelno == logging.DEBUG and "requestState" in r.getMessage() and "TOO_LARGE" in r.getMessage()
        for r in caplog.records
    ), "the refusal is logged at debug"


async def test_oversized_input_responses_are_refused_before_stateseal(stateseal, caplog, opens):
    caplog.set_level(logging.DEBUG, logger="stateseal_mcp")
    async with deployment(stateseal) as (url, _):
        async with Client(url, elicitation_callback=accept) as client:
            r = await first_round(client)
            # Under 256 KiB in characters, over it in UTF-8 bytes (as sent).
            padded = {**answers(r), "note": {"action": "accept", "content": {"note": "\u00e9" * 131_100}}}
            assert len(json.dumps(padded, ensure_ascii=False)) < 262_144
            caplog.clear()
            before = len(opens)
            with pytest.raises(MCPError) as e:
                await client.session.call_tool(
                    "transfer", {"amount": 42}, input_responses=padded, request_state=r.request_state
                )
            err = e.value.error
            assert (err.code, err.message, err.data) == (
                types.INVALID_PARAMS,
                "Invalid params: inputResponses too large",
                {"reason": "input_responses_too_large"},
            ), (err.code, err.message)
            assert len(opens) == before, "stateseal was called"
            assert errors_logged(caplog) == []
            assert boundary_lines_above_debug(caplog) == []
            # Refused before stateseal: the token is not spent.
            done = await client.session.call_tool(
                "transfer", {"amount": 42}, input_responses=answers(r), request_state=r.request_state
            )
            assert "transferred 42" in json.dumps(done.model_dump(mode="json"))


async def test_a_server_side_out_of_range_is_a_client_fault(tmp_path, caplog, opens):
    """stateseal with limits far below the package's defaults: its transport
    refuses the message as too large (OUT_OF_RANGE), which is the client's
    fault, not a configuration error."""
    # Largest message this server decodes: 1024 + ceil((49 + 16386 + 1024)
    # * 4 / 3) + 1024 + 65536 = 90,863 bytes; the package lets 100,000
    # through (its default bound is 109,910), so stateseal refuses.
    proc, addr = start_stateseal(
        tmp_path, "--max-state-bytes", "1024", "--max-params-bytes", "1024", "--max-input-bytes", "1024"
    )
    caplog.set_level(logging.DEBUG, logger="stateseal_mcp")
    try:
        async with deployment(addr) as (url, _):
            async with Client(url, elicitation_callback=accept) as client:
                caplog.clear()
                with pytest.raises(MCPError) as e:
                    await client.session.call_tool(
                        "transfer", {"amount": 42}, request_state="A" * 100_000, allow_input_required=True
                    )
        err = e.value.error
        assert (err.code, err.message) == (types.INVALID_PARAMS, "Invalid or expired requestState"), (
            err.code,
            err.message,
        )
        assert len(opens) == 1, "stateseal was called once (and refused)"
        assert errors_logged(caplog) == []
        assert any("OUT_OF_RANGE" in r.getMessage() for r in caplog.records if r.name == "stateseal_mcp")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_transport_statuses_an_end_user_can_cause_are_classified():
    def transport(code: grpc.StatusCode) -> StatesealError:
        return StatesealError(code.name, code, "", from_stateseal=False)

    too_large = transport(grpc.StatusCode.OUT_OF_RANGE)
    assert too_large.client_fault and not too_large.retryable
    exhausted = transport(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert exhausted.retryable and not exhausted.client_fault
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert transport(code).retryable and not transport(code).client_fault
    for code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INTERNAL):
        assert not transport(code).retryable and not transport(code).client_fault
    # A stateseal reason decides when there is one.
    overloaded = StatesealError("OVERLOADED", grpc.StatusCode.RESOURCE_EXHAUSTED, "")
    assert overloaded.retryable and not overloaded.client_fault
