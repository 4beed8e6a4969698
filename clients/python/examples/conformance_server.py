"""The tools and prompt that the official MCP conformance suite's MRTR server
scenarios (`input-required-result-*`, spec 2026-07-28) call, on the official
Python SDK with stateseal installed exactly as the package README shows.

    python examples/conformance_server.py STATESEAL_ADDR PORT
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mcp_types as types
import uvicorn
from mcp.server.mcpserver import Context, MCPServer

from stateseal_mcp import RequestStateClient, StatesealBoundary, install

# Built at import time, outside any event loop, as the README shows.
CLIENT = RequestStateClient(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051")


def _plain(r: Any) -> Any:
    return r.model_dump(mode="json", by_alias=True, exclude_none=True) if hasattr(r, "model_dump") else r


def accepted(answers: Any, key: str) -> dict | None:
    a = _plain((answers or {}).get(key))
    if not isinstance(a, dict) or a.get("action") != "accept" or not isinstance(a.get("content"), dict):
        return None
    return a["content"]


def sampled(answers: Any, key: str) -> str | None:
    a = _plain((answers or {}).get(key))
    if not isinstance(a, dict) or not isinstance(a.get("role"), str):
        return None
    content = a.get("content")
    return content.get("text") if isinstance(content, dict) and isinstance(content.get("text"), str) else None


def roots(answers: Any, key: str) -> list | None:
    a = _plain((answers or {}).get(key))
    return a["roots"] if isinstance(a, dict) and isinstance(a.get("roots"), list) else None


def form(message: str, **props: str) -> dict:
    return {
        "method": "elicitation/create",
        "params": {
            "message": message,
            "requestedSchema": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in props.items()},
                "required": list(props),
            },
        },
    }


def sampling(text: str, max_tokens: int) -> dict:
    return {
        "method": "sampling/createMessage",
        "params": {"messages": [{"role": "user", "content": {"type": "text", "text": text}}], "maxTokens": max_tokens},
    }


LIST_ROOTS = {"method": "roots/list", "params": {}}


def ask(requests: dict, state: dict | None = None) -> types.InputRequiredResult:
    body: dict[str, Any] = {"resultType": "input_required", "inputRequests": requests}
    if state is not None:
        # Plaintext: stateseal seals it.
        body["requestState"] = json.dumps(state, separators=(",", ":"))
    return types.InputRequiredResult.model_validate(body)


def round_of(ctx: Context) -> dict:
    return json.loads(ctx.request_state) if ctx.request_state else {}


def build() -> MCPServer:
    server = MCPServer("stateseal-conformance")

    @server.tool()
    async def test_input_required_result_elicitation(ctx: Context) -> types.InputRequiredResult | str:
        c = accepted(ctx.input_responses, "user_name")
        if not c or not isinstance(c.get("name"), str):
            return ask({"user_name": form("What is your name?", name="string")})
        return f"Hello, {c['name']}!"

    @server.tool()
    async def test_input_required_result_sampling(ctx: Context) -> types.InputRequiredResult | str:
        t = sampled(ctx.input_responses, "capital_question")
        if t is None:
            return ask({"capital_question": sampling("What is the capital of France?", 100)})
        return f"The model said: {t}"

    @server.tool()
    async def test_input_required_result_list_roots(ctx: Context) -> types.InputRequiredResult | str:
        r = roots(ctx.input_responses, "client_roots")
        if r is None:
            return ask({"client_roots": LIST_ROOTS})
        return "Roots: " + ", ".join(str(x.get("uri")) for x in r if isinstance(x, dict))

    @server.tool()
    async def test_input_required_result_request_state(ctx: Context) -> types.InputRequiredResult | str:
        c = accepted(ctx.input_responses, "confirm")
        if round_of(ctx).get("round") != "confirm" or not c or not isinstance(c.get("ok"), bool):
            return ask({"confirm": form("Please confirm", ok="boolean")}, {"round": "confirm"})
        return f"state-ok: confirmed={c['ok']}"

    @server.tool()
    async def test_input_required_result_multiple_inputs(ctx: Context) -> types.InputRequiredResult | str:
        a = ctx.input_responses
        name = (accepted(a, "user_name") or {}).get("name")
        greeting = sampled(a, "greeting")
        r = roots(a, "client_roots")
        if round_of(ctx).get("round") != "all" or not isinstance(name, str) or greeting is None or r is None:
            return ask(
                {
                    "user_name": form("What is your name?", name="string"),
                    "greeting": sampling("Generate a greeting", 50),
                    "client_roots": LIST_ROOTS,
                },
                {"round": "all"},
            )
        return f"{greeting} {name} ({len(r)} roots)"

    @server.tool()
    async def test_input_required_result_multi_round(ctx: Context) -> types.InputRequiredResult | str:
        a = ctx.input_responses
        state = round_of(ctx)
        name = (accepted(a, "step1") or {}).get("name")
        if state.get("round") == "step1" and isinstance(name, str):
            return ask({"step2": form("Step 2: What is your favorite color?", color="string")}, {"round": "step2", "name": name})
        color = (accepted(a, "step2") or {}).get("color")
        if state.get("round") == "step2" and isinstance(color, str):
            return f"{state['name']} likes {color}"
        return ask({"step1": form("Step 1: What is your name?", name="string")}, {"round": "step1"})

    @server.tool()
    async def test_input_required_result_tampered_state(ctx: Context) -> types.InputRequiredResult | str:
        c = accepted(ctx.input_responses, "confirm")
        if round_of(ctx).get("round") != "confirm" or not c or not isinstance(c.get("ok"), bool):
            return ask({"confirm": form("Please confirm", ok="boolean")}, {"round": "confirm"})
        return "state verified"

    @server.tool()
    async def test_input_required_result_capabilities(ctx: Context) -> types.InputRequiredResult | str:
        a = ctx.input_responses
        if sampled(a, "summary") is not None or accepted(a, "confirm") is not None:
            return "done"
        caps = ctx.client_capabilities
        requests: dict = {}
        if caps is not None and caps.sampling is not None:
            requests["summary"] = sampling("Summarize the request", 50)
        if caps is not None and caps.elicitation is not None:
            requests["confirm"] = form("Proceed?", ok="boolean")
        return ask(requests) if requests else "no input capability declared"

    @server.prompt()
    async def test_input_required_result_prompt(ctx: Context) -> types.InputRequiredResult | str:
        c = accepted(ctx.input_responses, "user_context")
        if not c or not isinstance(c.get("context"), str):
            return ask({"user_context": form("What context should the prompt use?", context="string")})
        return f"Context: {c['context']}"

    install(server, StatesealBoundary(CLIENT, audience="stateseal-conformance"))
    return server


if __name__ == "__main__":
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    app = build().streamable_http_app(stateless_http=True, json_response=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
