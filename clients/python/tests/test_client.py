"""RequestStateClient against the real stateseal binary: leases, and the
reason tables (stateseal reasons and transport statuses) kept in step with
the TypeScript package."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from stateseal_mcp import Lease, RequestStateClient, StatesealError

from conftest import start_stateseal

PARAMS = '{"name":"t","arguments":{"n":1}}'
TS_CLIENT = Path(__file__).parents[2] / "typescript" / "src" / "client.ts"


def test_a_reservation_reports_and_renews_its_lease(tmp_path):
    proc, addr = start_stateseal(tmp_path, "--default-lease-s", "2")

    async def go() -> None:
        client = RequestStateClient(addr)
        binding = {"subject": "alice", "method": "tools/call", "params_json": PARAMS}
        sealed = await client.seal(**binding, state=b"s", single_use=True)
        opened = await client.open(sealed.request_state, **binding, reserve=True, attempt_id="a1")
        assert opened.reservation and not opened.consumed
        # The granted lease: the server default, in seconds.
        assert opened.lease_seconds == 2, opened.lease_seconds
        lease = await client.renew(opened.reservation)
        assert isinstance(lease, Lease)
        expires, seconds = lease
        assert seconds == 2 and expires > 0, lease
        assert (await client.renew(opened.reservation, lease_seconds=3)).lease_seconds == 3
        # Released: the reservation no longer holds the token.
        await client.release(opened.reservation)
        with pytest.raises(StatesealError) as e:
            await client.renew(opened.reservation)
        assert e.value.reason == "LEASE_EXPIRED" and e.value.from_stateseal
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        await client.close()

    try:
        asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_an_open_carries_commits_and_reports_each(tmp_path):
    proc, addr = start_stateseal(tmp_path)

    async def go() -> None:
        client = RequestStateClient(addr)
        binding = {"subject": "alice", "method": "tools/call", "params_json": PARAMS}
        tokens = [(await client.seal(**binding, state=b"s", single_use=True)).request_state for _ in range(3)]
        held = (await client.open(tokens[0], **binding, reserve=True)).reservation
        opened = await client.open(tokens[1], **binding, reserve=True, commit=[held, "garbage"])
        assert opened.reservation
        ok, bad = opened.commits
        assert ok is None
        assert isinstance(bad, StatesealError), bad
        assert (bad.reason, bad.code, bad.from_stateseal) == ("MALFORMED", grpc.StatusCode.INVALID_ARGUMENT, True)
        assert bad.client_fault and not bad.retryable
        # Committed: the token is used, not in use.
        with pytest.raises(StatesealError) as e:
            await client.open(tokens[0], **binding)
        assert e.value.reason == "REPLAYED"
        # Nothing carried: no outcomes.
        assert (await client.open(tokens[2], **binding)).commits == ()
        with pytest.raises(ValueError):
            await client.open(tokens[2], **binding, commit=["r"] * 17)
        await client.close()

    try:
        asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _ts_set(name: str) -> set[str]:
    source = TS_CLIENT.read_text()
    m = re.search(rf"const {name} = new Set\(\[(.*?)\]\)", source, re.S)
    assert m, f"{name} not found in {TS_CLIENT}"
    return set(re.findall(r"'([A-Z_]+)'", m.group(1)))


def test_reason_tables_match_the_typescript_package():
    assert StatesealError.CLIENT_REASONS == _ts_set("CLIENT_FAULTS")
    assert StatesealError.TRANSIENT_REASONS == _ts_set("TRANSIENT")
    # Statuses of the transport (no stateseal reason): the same in both.
    assert StatesealError.TRANSPORT_CLIENT_CODES == _ts_set("TRANSPORT_CLIENT_FAULTS")
    assert StatesealError.TRANSPORT_TRANSIENT_CODES == _ts_set("TRANSPORT_TRANSIENT")
    transport = StatesealError.TRANSPORT_CLIENT_CODES | StatesealError.TRANSPORT_TRANSIENT_CODES
    assert transport <= {c.name for c in grpc.StatusCode}
    assert "BAD_INPUT_REQUESTS" in StatesealError.CLIENT_REASONS


def test_a_token_sealed_with_the_defaults_lets_no_answer_through(tmp_path):
    """Review note on issue 58: seal()'s default manifest asks nothing, so a
    forged answer on Open is dropped; only an explicit "" seals without a
    manifest (answers unfiltered)."""
    proc, addr = start_stateseal(tmp_path)

    async def go() -> None:
        client = RequestStateClient(addr)
        binding = {"subject": "alice", "method": "tools/call", "params_json": PARAMS}
        forged = '{"confirm":{"action":"accept","content":{"ok":true}}}'
        sealed = await client.seal(**binding, state=b"s")
        opened = await client.open(sealed.request_state, **binding, input_responses_json=forged)
        assert opened.input_responses_json in ("", "{}"), opened.input_responses_json
        assert opened.dropped == (("confirm", "UNASKED"),), opened.dropped
        bare = await client.seal(**binding, state=b"s", input_requests_json="")
        opened = await client.open(bare.request_state, **binding, input_responses_json=forged)
        assert "confirm" in opened.input_responses_json
        await client.close()

    try:
        asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(timeout=20)
