"""The client works as the README builds it: created once, outside any event
loop (at import time), then used from whatever loop runs the server — also
from several loops one after another."""

import asyncio

from stateseal_mcp import RequestStateClient

PARAMS = '{"name":"t","arguments":{"n":1}}'


def test_client_built_outside_any_loop_serves_every_loop(stateseal):
    client = RequestStateClient(stateseal)  # no loop is running here

    async def round_trip() -> None:
        sealed = await client.seal(
            subject="alice", method="tools/call", state=b"s", params_json=PARAMS, single_use=True
        )
        opened = await client.open(
            sealed.request_state, subject="alice", method="tools/call", params_json=PARAMS
        )
        assert opened.consumed and opened.state == b"s"

    asyncio.run(round_trip())  # one loop …
    asyncio.run(round_trip())  # … and another
    asyncio.run(client.close())
