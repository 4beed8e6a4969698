"""`StatesealBoundary`: the MCPServer middleware that replaces the SDK's
`RequestStateBoundary` with stateseal.

Inbound (`tools/call`, `prompts/get`, `resources/read` carrying
`requestState`): the token is opened by stateseal, bound to
- the audience (this MCP service's name) and the verified principal, hashed
  together into the subject;
- the method;
- the whole request params (stateseal drops `inputResponses`, `requestState`
  and `_meta`, canonicalizes with RFC 8785 and hashes), which covers
  everything the SDK's boundary binds (tool/prompt name or resource URI and
  arguments) and more;
and, for single-use targets, consumed at most once across every replica.
The handler then sees the plaintext the server minted, as with the SDK's own
boundary, which is what lets the SDK trust its resolver state.

Outbound: an `input_required` result's `requestState` is sealed under the
same binding, single-use unless the target is listed in `reusable`.

Errors: every stateseal rejection becomes the SDK's usual invalid-params error
("Invalid or expired requestState") with the reason kept in this server's log
only; `LEDGER_UNAVAILABLE` (or stateseal unreachable) becomes a retryable
internal error.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import Any

from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.request_state import RequestStateBoundary, authenticated_principal
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS
from mcp_types.methods import INPUT_REQUIRED_METHODS, is_input_required

from .client import RequestStateClient, StatesealError

__all__ = ["StatesealBoundary", "install"]

logger = logging.getLogger("stateseal_mcp")


def _target(method: str, params: Mapping[str, Any]) -> str:
    if method == "resources/read":
        return str(params.get("uri", ""))
    return str(params.get("name", ""))


class StatesealBoundary:
    """MCPServer middleware sealing/opening `requestState` through stateseal.

    - `audience`: this MCP service's identity (e.g. the server name); a token
      minted by another service on the same stateseal tenant never opens here.
    - `principal`: returns the verified principal of a request, or None on an
      unauthenticated transport. Default: the SDK's `authenticated_principal`
      (the verified OAuth access token's client/issuer/subject).
    - `reusable`: targets (tool or prompt names, resource URIs) whose tokens
      may open more than once; every other target is single-use (the default,
      and what the MCP specification's clients already do: a requestState is
      echoed once).
    - `ttl_seconds`: 0 = the stateseal server's default.
    """

    def __init__(
        self,
        client: RequestStateClient,
        *,
        audience: str,
        principal: Callable[[ServerRequestContext[Any, Any]], str | None] = authenticated_principal,
        reusable: Collection[str] = (),
        ttl_seconds: int = 0,
    ) -> None:
        self._client = client
        self._audience = audience
        self._principal = principal
        self._reusable = frozenset(reusable)
        self._ttl = ttl_seconds

    def _subject(self, ctx: ServerRequestContext[Any, Any]) -> str:
        try:
            principal = self._principal(ctx)
        except Exception:  # deny on error, as the SDK does
            logger.exception("principal binding raised on %s", ctx.method)
            raise MCPError(code=INVALID_PARAMS, message="Invalid or expired requestState") from None
        ident = json.dumps([self._audience, principal], separators=(",", ":"), ensure_ascii=False)
        return "mcp:" + hashlib.sha256(ident.encode("utf-8", "surrogatepass")).hexdigest()

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        if ctx.method not in INPUT_REQUIRED_METHODS:
            return await call_next(ctx)
        params: Mapping[str, Any] = ctx.params or {}
        subject = self._subject(ctx)
        params_json = json.dumps(params, ensure_ascii=False, allow_nan=False)
        wire = params.get("requestState")
        if wire is not None:
            if not isinstance(wire, str):
                self._reject(ctx.method, "NON_STRING")
            try:
                opened = await self._client.open(
                    wire, subject=subject, method=ctx.method, params_json=params_json
                )
            except StatesealError as e:
                if e.retryable:
                    logger.warning("stateseal unavailable on %s: %s", ctx.method, e.reason)
                    raise MCPError(code=INTERNAL_ERROR, message="Temporarily unavailable; retry") from None
                self._reject(ctx.method, e.reason)
            ctx = replace(ctx, params={**params, "requestState": opened.state.decode("utf-8")})
        result = await call_next(ctx)
        if not is_input_required(result):
            return result
        state = result.get("requestState") if isinstance(result, Mapping) else result.request_state
        if not isinstance(state, str):
            return result
        target = _target(ctx.method, params)
        try:
            sealed = await self._client.seal(
                subject=subject,
                method=ctx.method,
                params_json=params_json,
                state=state.encode("utf-8"),
                ttl_seconds=self._ttl,
                single_use=target not in self._reusable,
            )
        except StatesealError as e:
            logger.error("stateseal refused to seal on %s: %s", ctx.method, e.reason)
            raise MCPError(code=INTERNAL_ERROR, message="Internal error") from None
        if isinstance(result, Mapping):
            return {**result, "requestState": sealed.request_state}
        return result.model_copy(update={"request_state": sealed.request_state})

    @staticmethod
    def _reject(method: str, reason: str):
        logger.warning("requestState rejected on %s: %s", method, reason)
        raise MCPError(
            code=INVALID_PARAMS,
            message="Invalid or expired requestState",
            data={"reason": "invalid_request_state"},
        )


def install(server: Any, boundary: StatesealBoundary) -> None:
    """Replaces the SDK's `RequestStateBoundary` in `server.middleware`
    (an `MCPServer`) with `boundary`, at the same position."""
    chain = server.middleware
    for i, m in enumerate(chain):
        if isinstance(m, RequestStateBoundary):
            chain[i] = boundary
            return
    chain.insert(0, boundary)
