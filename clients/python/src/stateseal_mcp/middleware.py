"""`StatesealBoundary`: the MCPServer middleware that replaces the SDK's
`RequestStateBoundary` with stateseal.

Inbound (`tools/call`, `prompts/get`, `resources/read` carrying
`requestState`): the token is opened by stateseal, bound to
- the audience (this MCP service's name) and the verified principal, hashed
  together into the subject;
- the method;
- the request params under stateseal's binding v2 (the tool or prompt name
  and its arguments, or the resource URI; numbers exact), computed here
  (`stateseal_mcp.binding`) and sent as a 32-byte digest, so params of any
  size cost nothing on the wire;
and, for single-use targets, consumed at most once across every replica:
- by default in two phases: stateseal *reserves* the token for a lease, the
  handler runs (the lease renewed in the background every third of its
  length, each Renew abandoned after that third, so a slow handler keeps
  it even when a Renew hangs), and the reservation is *committed*
  when the handler returns, off the response path: carried by this
  replica's next durable Open, or sent on its own after `commit_delay`
  (25 ms) when none comes. A Commit that cannot land yet (stateseal or its
  ledger unreachable, a transient refusal) is kept: retried with capped
  backoff, its lease renewed meanwhile, until it gets a definite answer or
  `commit_window` (60 s) has passed; Commit is idempotent. The reservation
  is *released* when the handler raises or reports an error (or when
  sealing the next round fails), so a failed handler never burns the user's
  retry; a Release that cannot land yet is kept the same way;
- for targets listed in `at_most_once`, consumed before the handler runs
  (at most once even if the handler crashes; a failure then costs the retry).
Each incoming request gets an attempt id, so an Open that timed out after
stateseal recorded it is retried safely (twice at most).

`inputResponses` without a sealed `requestState` (absent or null) answer no
question this server asked: they are removed before the handler runs. So
that a legitimate retry always has a token, an `input_required` result with
`inputRequests` but no `requestState` gets one minted here (an empty state,
which the handler then sees as no `requestState`).

Outbound: an `input_required` result's `requestState` is sealed under the
same binding, single-use unless the target is listed in `reusable`, always
with the round's questions as its manifest: a round that asked nothing
(a state and no `inputRequests`) is sealed with none (`{}`), so no answer
reaches the handler with its token.

Errors (the package README has the table):
- a `requestState` or `inputResponses` over the service's limits
  (`max_request_state_bytes`, `max_input_responses_bytes`): -32602 before
  stateseal is called, logged at debug only;
- REPLAYED: -32602 "requestState already used" (`on_replay="error"`, the
  default); IN_USE: -32603 "Request in progress; retry later" (retryable);
  with `on_replay="reask"` both run the request again without state, as
  EXPIRED always does;
- EXPIRED: the request is run again without `requestState` and
  `inputResponses` (re-ask), so the handler answers a fresh
  `input_required` (`reask=False` answers -32602 instead);
- other rejections, and a message stateseal's transport refuses as too
  large (OUT_OF_RANGE): the SDK's usual -32602 "Invalid or expired
  requestState", the reason in this server's log only;
- transient stateseal conditions (ledger unavailable, clock unsynced,
  overloaded, unreachable, RESOURCE_EXHAUSTED): -32603 "Temporarily
  unavailable; retry";
- anything else between this server and stateseal (authentication,
  configuration): -32603 "Internal error" and an ERROR log naming the cause.
Nothing an end user sends produces an ERROR log line: ERROR is kept for what
an operator must act on (authentication or configuration between this server
and stateseal, a refused Seal of a handler's result, a lost reservation, a
Commit given up or not kept).

Requests without `requestState` whose result is not `input_required` cost
nothing: no serialization, no principal call.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import uuid
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, NoReturn

import grpc
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.request_state import RequestStateBoundary, authenticated_principal
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS
from mcp_types.methods import INPUT_REQUIRED_METHODS, is_input_required

from .binding import BindingError, params_digest, subject_for
from .client import RequestStateClient, StatesealError

__all__ = [
    "DEFAULT_COMMIT_DELAY",
    "DEFAULT_COMMIT_WINDOW",
    "DEFAULT_MAX_INPUT_RESPONSES_BYTES",
    "DEFAULT_MAX_PENDING",
    "DEFAULT_MAX_REQUEST_STATE_BYTES",
    "StatesealBoundary",
    "install",
]

logger = logging.getLogger("stateseal_mcp")

#: The shortest pause between two renewals of a lease, in seconds.
_MIN_RENEW_INTERVAL = 0.5
#: The shortest deadline of a Renew, or of one try of a Commit, in seconds.
#: Each gets a third of the lease granted (at least this, and never more
#: than the client's `timeout`): a Renew that hangs is abandoned, and the
#: next one sent at once, while the lease still runs; a Commit try that
#: hangs leaves the lease time to be renewed before the next try. With the
#: client's 5 s timeout a hung Renew outlasted a 2 s lease (issue 58,
#: finding 5).
_MIN_RENEW_DEADLINE = 0.25

#: The longest `requestState` (UTF-8 bytes) sent to stateseal. The service
#: accepts a state of up to 64 KiB (`--max-state-bytes 65536`) sealed with a
#: manifest of up to 16 KiB into a token: base64url of header (9) + nonce
#: (24) + manifest (2 + 16384) + state + tag (16). Bounded with 512 bytes of
#: room for the fixed parts: ceil((65536 + 16384 + 512) * 4 / 3) = 109,910,
#: above the 109,295 the service itself admits, so no token it would open is
#: refused here.
DEFAULT_MAX_REQUEST_STATE_BYTES = ((65536 + 16384 + 512) * 4 + 2) // 3
#: The longest `inputResponses` JSON (UTF-8 bytes, as sent) sent to
#: stateseal: the service's `--max-input-bytes` default, 256 KiB.
DEFAULT_MAX_INPUT_RESPONSES_BYTES = 256 * 1024

#: How long an Open of a token whose Commit this process still keeps (its
#: handler answered; the Commit has not landed) waits, at most, for that
#: Commit before it is answered IN_USE ("in progress", retryable) without
#: opening the token. Asked again, it waits again: so for as long as the
#: Commit is kept (up to `commit_window`), no replay reaching this process
#: runs the handler, even once the lease has run out during an outage.
_COMMIT_WAIT = 5.0
#: The pauses before an Open that found its token IN_USE is sent again (the
#: same attempt id): another replica's handler may have answered with its
#: Commit on the way. 375 ms in all, after which IN_USE is answered as such.
_BUSY_WAITS = (0.025, 0.05, 0.1, 0.2)
#: The Commits running beside their answers in this process, by event loop
#: and by the SHA-256 of their token, with the carrier each may wait in:
#: what an Open that finds a token IN_USE waits for (and hurries),
#: whichever boundary (replica) it reached.
_PENDING: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[bytes, tuple[asyncio.Task[None], _Carrier]]
] = weakref.WeakKeyDictionary()
#: The Opens on their way in this process, by event loop and by the SHA-256
#: of their token: how many, and whether a handler answered with that token
#: meanwhile (then an Open that gets the token does not run it again).
_OPENING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[bytes, list[Any]]] = weakref.WeakKeyDictionary()

#: How long, by default, a Commit waits for a durable Open of the same
#: boundary to carry it before it is sent on its own, in seconds.
DEFAULT_COMMIT_DELAY = 0.025

#: The most waiting Commits one Open carries: the service decides 4 at a
#: time, and the Open's answer waits for them.
_CARRY_PER_OPEN = 4
#: The longest `commit_delay`: below the 375 ms a replay on another replica
#: waits out IN_USE (_BUSY_WAITS), so that it sees the Commit.
MAX_COMMIT_DELAY = 0.25

#: How long, by default, a Commit (or a Release) that cannot land yet is
#: kept and retried after its handler returned, in seconds.
DEFAULT_COMMIT_WINDOW = 60.0
#: The most Commits and Releases one boundary keeps at once, by default.
DEFAULT_MAX_PENDING = 10_000
#: The first pause before a kept Commit or Release is tried again, doubled
#: after each failure up to _RETRY_CAP (each pause drawn between half and
#: all of it, so that the Commits an outage held back do not all go at
#: once when it ends): never more than 0.5 s between two tries.
_RETRY_FIRST = 0.05
_RETRY_CAP = 0.5

#: Transport failures after which an Open (same attempt id) or a Release is
#: sent again: the connection was lost or the call timed out.
_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class Refusal:
    """What the boundary answers when a stateseal call fails: run the request
    again without its state (`reask`), or an MCP error, logged at `log`.
    `kind` names the branch. clients/boundary.json is the table both
    packages are tested against."""

    kind: str
    code: int = 0
    message: str = ""
    data: Mapping[str, str] | None = None
    log: str = "info"

    @property
    def reask(self) -> bool:
        return self.kind == "reask"


def open_refusal(e: StatesealError, *, on_replay: str, reask: bool) -> Refusal:
    """The answer to a request whose token stateseal refused to open."""
    if e.client_fault and on_replay == "error":
        if e.reason == "REPLAYED":
            # The earlier retry with this token already went through.
            return Refusal("replayed", INVALID_PARAMS, "requestState already used",
                           {"reason": "request_state_used"}, "warning")
        if e.reason == "IN_USE":
            # Another attempt with this token is running its handler.
            return Refusal("in_use", INTERNAL_ERROR, "Request in progress; retry later",
                           {"reason": "in_progress"}, "info")
    reask_on = ("EXPIRED",) if on_replay == "error" else ("REPLAYED", "EXPIRED", "IN_USE")
    if e.client_fault and reask and e.reason in reask_on:
        return Refusal("reask")
    return call_refusal(e, sealing=False)


def call_refusal(e: StatesealError, *, sealing: bool) -> Refusal:
    """The answer to any other failed stateseal call (`sealing`: the Seal of
    a handler's result, where a client fault is this server's own)."""
    if e.retryable:
        return Refusal("unavailable", INTERNAL_ERROR, "Temporarily unavailable; retry", None, "warning")
    if e.client_fault and not sealing:
        # A message stateseal's transport refused as too large is the end
        # user's doing: not an operator alarm.
        return Refusal("rejected", INVALID_PARAMS, "Invalid or expired requestState",
                       {"reason": "invalid_request_state"}, "warning" if e.from_stateseal else "info")
    return Refusal("internal", INTERNAL_ERROR, "Internal error", None, "error")


def resend(e: StatesealError) -> bool:
    """An Open (same attempt id) or a Release is sent again: the connection
    was lost or the call timed out."""
    return not e.from_stateseal and e.code in _LOST


def retry_commit(e: StatesealError) -> bool:
    """A Commit is retried (it is idempotent): any transient failure."""
    return e.retryable


def _backoff(pause: float) -> float:
    """The pause before a kept Commit or Release is tried again: between
    half and all of `pause`, so that what an outage held back is spread."""
    return random.uniform(pause / 2, pause)


def _still_committing() -> StatesealError:
    """IN_USE, answered without opening the token: its handler answered
    in this process, and its Commit is still kept (has not landed)."""
    return StatesealError("IN_USE", grpc.StatusCode.ABORTED, "its Commit is still kept in this process")


def renewal_lost(e: StatesealError) -> bool:
    """Renewing stops: another attempt took the token over."""
    return e.from_stateseal and e.reason == "LEASE_EXPIRED"


def _is_error(result: Any) -> bool:
    """A tool result that reports failure (`isError`)."""
    if isinstance(result, Mapping):
        return bool(result.get("isError"))
    return bool(getattr(result, "is_error", False))


def _utf8_len(text: str) -> int | None:
    """The length of `text` in UTF-8, or None when it has a lone surrogate
    (which UTF-8, and so the wire, cannot carry)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


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
    - `at_most_once`: targets consumed before their handler runs (at most
      once even if the handler crashes); every other single-use target is
      reserved, then committed when the handler returns or released when it
      fails.
    - `on_replay`: what a replayed token gets. "error" (default): REPLAYED
      is -32602 "requestState already used" (data `{"reason":
      "request_state_used"}`) and IN_USE, while another attempt with the
      same token runs, is the retryable -32603 "Request in progress; retry
      later" (data `{"reason": "in_progress"}`). "reask": both run the
      request again without its state, so the handler asks afresh (subject
      to `reask`).
    - `reask`: on EXPIRED (and with `on_replay="reask"` on REPLAYED and
      IN_USE), run the request again without its state so the handler asks
      afresh (default), instead of -32602 "Invalid or expired requestState".
    - `reask_on_invalid_answers`: when stateseal drops an answer to a question
      this server asked (`KIND_MISMATCH`, `INVALID_CONTENT`), run the request
      again without state and answers, so the handler asks afresh (default;
      the token is spent on that fresh round). False: the handler gets the
      filtered answers with that key missing. Unasked keys and stripped URL
      content never trigger it: unrecognized information is ignored.
    - `ttl_seconds`: 0 = the stateseal server's default.
    - `lease_seconds`: the lease asked for when reserving and renewing; 0 =
      the stateseal server's default. The lease is renewed every third of
      what the server granted while the handler runs, each Renew with a
      deadline of that third (at least 0.25 s, at most the client's
      `timeout`): one that hangs is abandoned and the next sent at once,
      before the lease runs out.
    - `max_request_state_bytes`, `max_input_responses_bytes`: a
      `requestState` (UTF-8 bytes) or `inputResponses` (its JSON as sent,
      UTF-8 bytes) over these is refused with -32602 before stateseal is
      called, logged at debug only. The defaults match the service's default
      limits (`DEFAULT_MAX_REQUEST_STATE_BYTES`,
      `DEFAULT_MAX_INPUT_RESPONSES_BYTES`); keep them at or below what your
      stateseal accepts when you change its `--max-state-bytes` or
      `--max-input-bytes`.
    - `commit_delay`: seconds (0 to 0.25; default 0.025) a Commit waits for
      the next durable Open of this boundary (an Open of a single-use
      target) to carry it (`OpenRequest.commit`), before it is sent on its
      own. 0 sends each Commit on its own at once. The answer never waits
      for it; what it costs is the window after a handler has answered in
      which a crash of this process leaves the token reserved rather than
      used: until its lease ends, after which a retry may run the handler
      again. The delay widens that window by at most `commit_delay`, so
      keep it far below the lease. `drain()` sends what is waiting at once.
    - `commit_window`: seconds (default 60; never less than `lease_seconds`
      when that is set, and never shorter than the lease stateseal granted)
      a Commit that cannot land yet is kept after its handler returned:
      retried with capped backoff (50 ms doubling to 0.5 s between tries)
      while the lease is renewed, until stateseal gives a definite answer
      (landed; `LEASE_EXPIRED` or `REJECTED`: another attempt holds the
      token; any other refusal that is not transient, logged at ERROR). An
      outage of stateseal, its audit sink or its ledger shorter than the
      window never runs a handler that returned a second time. A Release
      that cannot land yet is kept the same way. Past the window the
      Commit is given up (an ERROR log): the token opens again once its
      lease ends.
    - `max_pending`: the most Commits and Releases kept at once (default
      10,000, `DEFAULT_MAX_PENDING`). Past it, a Commit is tried once and a
      Release is not retried (neither is kept): each such one is an ERROR
      log, counted in `overflowed`.

    `overflowed` (read-only): how many Commits and Releases found
    `max_pending` already kept and were not kept themselves, since this
    boundary was made. `drain()` waits for every kept Commit and Release.
    """

    def __init__(
        self,
        client: RequestStateClient,
        *,
        audience: str,
        principal: Callable[[ServerRequestContext[Any, Any]], str | None] = authenticated_principal,
        reusable: Collection[str] = (),
        at_most_once: Collection[str] = (),
        reask: bool = True,
        reask_on_invalid_answers: bool = True,
        ttl_seconds: int = 0,
        on_replay: Literal["error", "reask"] = "error",
        lease_seconds: int = 0,
        max_request_state_bytes: int = DEFAULT_MAX_REQUEST_STATE_BYTES,
        max_input_responses_bytes: int = DEFAULT_MAX_INPUT_RESPONSES_BYTES,
        commit_delay: float = DEFAULT_COMMIT_DELAY,
        commit_window: float = DEFAULT_COMMIT_WINDOW,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if on_replay not in ("error", "reask"):
            raise ValueError('on_replay must be "error" or "reask"')
        if lease_seconds < 0:
            raise ValueError("lease_seconds must be 0 (the server default) or positive")
        if (
            isinstance(commit_delay, bool)
            or not isinstance(commit_delay, (int, float))
            or not 0 <= commit_delay <= MAX_COMMIT_DELAY
        ):
            raise ValueError(f"commit_delay must be between 0 (commit at once) and {MAX_COMMIT_DELAY} seconds")
        if (
            isinstance(commit_window, bool)
            or not isinstance(commit_window, (int, float))
            or not math.isfinite(commit_window)
            or commit_window <= 0
        ):
            raise ValueError("commit_window must be a positive number of seconds")
        if commit_window < lease_seconds:
            raise ValueError(
                f"commit_window ({commit_window} s) must not be less than lease_seconds ({lease_seconds} s): "
                "a Commit given up before the lease ends leaves the token reserved to no purpose"
            )
        for name, value in (
            ("max_request_state_bytes", max_request_state_bytes),
            ("max_input_responses_bytes", max_input_responses_bytes),
            ("max_pending", max_pending),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer")
        self._client = client
        self._audience = audience
        self._principal = principal
        self._reusable = frozenset(reusable)
        self._at_most_once = frozenset(at_most_once)
        self._reask = reask
        self._reask_invalid = reask_on_invalid_answers
        self._ttl = ttl_seconds
        self._on_replay = on_replay
        self._lease = lease_seconds
        self._max_state = max_request_state_bytes
        self._max_answers = max_input_responses_bytes
        # Commits running after their handler's answer went out (see
        # _finish), and Releases kept after their request ended (see
        # _release): held here so they are not collected, bounded by
        # max_pending, and waited for by drain().
        self._kept: set[asyncio.Task[None]] = set()
        self._commit_delay = float(commit_delay)
        self._commit_window = float(commit_window)
        self._max_pending = max_pending
        self._overflowed = 0
        # The Commits waiting for a durable Open to carry them, by event
        # loop (see _Carrier).
        self._carriers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Carrier] = weakref.WeakKeyDictionary()

    @property
    def overflowed(self) -> int:
        """How many Commits and Releases found `max_pending` already kept,
        and so were not kept themselves (each an ERROR log)."""
        return self._overflowed

    def _carrier(self) -> _Carrier:
        loop = asyncio.get_running_loop()
        carrier = self._carriers.get(loop)
        if carrier is None:
            carrier = self._carriers[loop] = _Carrier(self._client, loop, self._commit_delay)
        return carrier

    def _subject(self, ctx: ServerRequestContext[Any, Any]) -> str:
        try:
            principal = self._principal(ctx)
        except Exception:  # deny on error, as the SDK does
            logger.exception("principal binding raised on %s", ctx.method)
            raise MCPError(code=INVALID_PARAMS, message="Invalid or expired requestState") from None
        return subject_for(self._audience, principal)

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        if ctx.method not in INPUT_REQUIRED_METHODS:
            return await call_next(ctx)
        params: Mapping[str, Any] = ctx.params or {}
        wire = params.get("requestState")
        if wire is None:
            if "inputResponses" in params:
                # Answers without a sealed token (absent or null
                # `requestState`) answer no question this server asked:
                # they never reach the handler.
                if params["inputResponses"] is not None:
                    logger.debug("inputResponses without requestState on %s: dropped", ctx.method)
                params = {k: v for k, v in params.items() if k != "inputResponses"}
                ctx = replace(ctx, params=params)
            # No state to open: bind and seal only if the handler asks.
            return await self._seal_if_asked(ctx, params, await call_next(ctx))
        if not isinstance(wire, str):
            self._reject(ctx.method, "NON_STRING")
        # What an end user sends over the service's limits never reaches
        # stateseal (whose transport would refuse it as a fault of ours).
        self._check_state(ctx.method, wire)
        answers = params.get("inputResponses")
        answers_json = self._answers_json(ctx.method, answers) if answers is not None else ""
        subject = self._subject(ctx)
        digest = self._digest(ctx.method, params)
        target = _target(ctx.method, params)
        reserve = target not in self._at_most_once
        token = hashlib.sha256(wire.encode("utf-8")).digest()
        opening = _OPENING.setdefault(asyncio.get_running_loop(), {})
        opening.setdefault(token, [0, False])[0] += 1
        try:
            try:
                opened = await self._open(
                    wire, token, subject, ctx.method, digest, reserve, answers_json, carry=target not in self._reusable
                )
            finally:
                entry = opening[token]
                answered = entry[1]
                entry[0] -= 1
                if entry[0] == 0:
                    del opening[token]
            if answered or token in _PENDING.get(asyncio.get_running_loop(), {}):
                # A handler of this process answered with this token while
                # this Open was on its way, or its Commit is still kept:
                # the Open was decided after that handler's lease ran out
                # (an outage). The handler ran: it does not run again. What
                # the Open reserved is committed in its stead (the token is
                # used); the caller gets IN_USE, and its retry REPLAYED.
                logger.warning(
                    "requestState opened on %s while this process still keeps the Commit of its handler's "
                    "answer: not run again",
                    ctx.method,
                )
                if opened.reservation:
                    # Its lease renewed until the Commit lands, as a
                    # handler's is.
                    taken = (
                        _Renewal(self, ctx.method, opened.reservation, opened.lease_seconds)
                        if opened.lease_seconds > 0
                        else None
                    )
                    self._commit_beside(ctx.method, token, opened.reservation, opened.lease_seconds, taken)
                raise _still_committing()
        except StatesealError as e:
            refusal = open_refusal(e, on_replay=self._on_replay, reask=self._reask)
            if refusal.reask:
                logger.info("requestState %s on %s: asking again", e.reason, ctx.method)
                fresh = {k: v for k, v in params.items() if k not in ("requestState", "inputResponses")}
                fresh_ctx = replace(ctx, params=fresh)
                return await self._seal_if_asked(fresh_ctx, fresh, await call_next(fresh_ctx))
            self._refuse(ctx.method, e, refusal)
        inner = {**params, "requestState": opened.state.decode("utf-8")}
        if not opened.state:
            # Minted by this boundary for a handler that asked without a
            # state (see _seal_if_asked): the handler sees none.
            del inner["requestState"]
        if answers is not None:
            # The handler sees only answers to questions this server asked,
            # of the right shape.
            inner["inputResponses"] = json.loads(opened.input_responses_json)
            for key, why in opened.dropped:
                logger.info("inputResponses[%s] dropped on %s: %s", json.dumps(key), ctx.method, why)
            invalid = [key for key, why in opened.dropped if why in ("KIND_MISMATCH", "INVALID_CONTENT")]
            if invalid and self._reask_invalid:
                # An asked question got no usable answer: ask afresh rather
                # than hand a handler a state whose answers are missing.
                logger.info("invalid answers on %s: asking again", ctx.method)
                inner = {k: v for k, v in params.items() if k not in ("requestState", "inputResponses")}
        ctx = replace(ctx, params=inner)
        reservation = opened.reservation
        # The lease lives as long as the handler, and after it as long as
        # its Commit is kept: renewed in the background every third of the
        # granted lease (between the Commit's tries), stopped once the
        # Commit got its answer, or before a Release.
        keeper = (
            _Renewal(self, ctx.method, reservation, opened.lease_seconds)
            if reservation and opened.lease_seconds > 0
            else None
        )
        try:
            result = await call_next(ctx)
            result = await self._seal_if_asked(ctx, params, result, subject=subject, digest=digest)
        except BaseException:
            if keeper is not None:
                keeper.stop()
            if reservation:
                await self._release(ctx.method, reservation, opened.lease_seconds)
            raise
        if reservation and _is_error(result):
            # The tool reported failure (the SDK turns a raising tool into an
            # error result): give the token back for the corrected retry.
            await self._stop(keeper)
            await self._release(ctx.method, reservation, opened.lease_seconds)
            return result
        if reservation:
            # The handler ran: its answer goes out now, and the Commit runs
            # beside it, kept until it lands. Until then the lease, renewed,
            # keeps the token IN_USE, so no other attempt runs the handler.
            self._commit_beside(ctx.method, token, reservation, opened.lease_seconds, keeper)
        return result

    def _commit_beside(
        self, method: str, token: bytes, reservation: str, granted: int, keeper: _Renewal | None
    ) -> None:
        """Commits `reservation` (of `token`, whose handler answered) in a
        task of its own, kept until it lands; an Open of the token in this
        process waits for it meanwhile, and one already on its way does not
        run the handler again."""
        loop = asyncio.get_running_loop()
        kept = self._room("commit", method)
        window = max(self._commit_window, granted) if kept else 0.0
        if keeper is not None:
            keeper.answered()
        task = loop.create_task(self._finish(method, reservation, keeper, loop.time() + window))
        self._kept.add(task)
        task.add_done_callback(self._kept.discard)
        # Any boundary of this process and loop that is asked to open this
        # token meanwhile waits for this Commit (see _open).
        pending = _PENDING.setdefault(loop, {})
        pending[token] = (task, self._carrier())
        task.add_done_callback(lambda t: pending.pop(token, None) if pending.get(token, (None,))[0] is t else None)
        entry = _OPENING.get(loop, {}).get(token)
        if entry is not None:
            entry[1] = True

    def _room(self, what: str, method: str) -> bool:
        """Whether one more Commit or Release may be kept (fewer than
        `max_pending` are); if not, an ERROR log, counted in `overflowed`."""
        if len(self._kept) < self._max_pending:
            return True
        self._overflowed += 1
        logger.error(
            "stateseal %s on %s not kept: %d Commits and Releases are kept already (max_pending); "
            "it is not retried, and if it does not land the token opens again once its lease ends "
            "(%d not kept so far)",
            what,
            method,
            len(self._kept),
            self._overflowed,
        )
        return False

    @staticmethod
    async def _stop(keeper: _Renewal | None) -> None:
        """Stops renewing and waits for a Renew in flight to end (cancelled;
        asyncio.wait never raises the task's own cancellation), so no Renew
        is sent after. Without one in flight it returns at once."""
        inflight = keeper.stop() if keeper is not None else None
        if inflight is not None:
            await asyncio.wait({inflight})

    async def _finish(self, method: str, reservation: str, keeper: _Renewal | None, until: float) -> None:
        """Commits a reservation whose handler returned, after its answer
        went out, kept (retried while transient) until it gets a definite
        answer or the loop's clock passes `until`. The renewals go on
        between its tries, so the lease does not run out under a Commit
        that has not landed yet, and stop once it has its answer. Never
        raises but its own cancellation, which is logged: the token then
        stays reserved until its lease ends."""
        try:
            await self._commit(method, reservation, until, keeper)
        except asyncio.CancelledError:
            if keeper is not None:
                keeper.stop()
            logger.error(
                "stateseal commit on %s cancelled before it landed (the event loop stopped without "
                "drain()?): the token opens again once its lease ends",
                method,
            )
            raise
        except Exception:
            logger.exception("stateseal commit on %s raised", method)
        await self._stop(keeper)

    async def drain(self, timeout: float | None = None) -> bool:
        """Waits (at most `timeout` seconds) for every Commit of the running
        event loop still running after its handler's answer went out, and
        every Release still kept; True when none is left. Call it before
        the loop ends (a graceful shutdown), with a timeout as long as the
        outage of stateseal you want a shutdown to ride out (at most
        `commit_window`): a Commit that never lands leaves its token
        reserved until the lease ends, after which a retry may run the
        handler again."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        # The Commits waiting for a carrier go now, each on its own, and so
        # does every Commit queued until drain() returns.
        carrier = self._carrier()
        carrier.draining += 1
        try:
            carrier.send_all()
            while True:
                mine = {t for t in self._kept if t.get_loop() is loop}
                if not mine:
                    return True
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return False
                await asyncio.wait(mine, timeout=left)
        finally:
            carrier.draining -= 1

    async def _commit(self, method: str, reservation: str, until: float, keeper: _Renewal | None) -> None:
        # The handler ran; its answer stands whatever Commit answers. Commit
        # is idempotent (a committed reservation commits again), so a
        # transient failure, which may have been recorded all the same, is
        # retried, with capped backoff, until the loop's clock passes
        # `until`: a Commit that lands after an outage still consumes the
        # token (the lease renewed between the tries; and even after the
        # lease ended, as long as no other attempt took the token over).
        # No Renew is in flight while a try is: one that reached stateseal
        # after the Commit landed would find the token consumed, and be
        # counted there as a lost lease.
        loop = asyncio.get_running_loop()
        pause = _RETRY_FIRST
        tries = 0
        # Each try's deadline: a third of the lease (the client's timeout
        # when no lease is renewed).
        deadline = keeper.deadline() if keeper is not None else None
        while True:
            if keeper is not None:
                await keeper.hold()
            try:
                if tries == 0 and self._commit_delay > 0:
                    # Carried by the next durable Open of this loop, or sent
                    # on its own after the delay. An Open carrying it may
                    # take the client's timeout: given up as a try that ran
                    # out (Commit is idempotent).
                    carried = self._carrier().commit(reservation, deadline)
                    if deadline is None:
                        await carried
                    else:
                        try:
                            await asyncio.wait_for(carried, self._commit_delay + deadline)
                        except asyncio.TimeoutError:
                            raise StatesealError(
                                "DEADLINE_EXCEEDED", grpc.StatusCode.DEADLINE_EXCEEDED, "timed out", from_stateseal=False
                            ) from None
                else:
                    await self._client.commit(reservation, timeout=deadline)
            except StatesealError as e:
                tries += 1
                if retry_commit(e):
                    wait = _backoff(pause)
                    if loop.time() + wait <= until:
                        if tries == 1:
                            logger.warning(
                                "stateseal commit on %s: %s; retrying until it lands (for up to %.0f s)",
                                method,
                                e.reason,
                                max(0.0, until - loop.time()),
                            )
                        else:
                            logger.debug("stateseal commit on %s: %s; retrying", method, e.reason)
                        if keeper is not None:
                            keeper.resume()
                        await asyncio.sleep(wait)
                        pause = min(pause * 2, _RETRY_CAP)
                        continue
                    # Kept as long as allowed (or not kept at all).
                    logger.error(
                        "stateseal commit on %s did not land (%s after %d tries): the token opens again "
                        "once its lease ends, and a retry after that may run the handler again",
                        method,
                        e.reason,
                        tries,
                    )
                elif e.from_stateseal and e.reason in ("LEASE_EXPIRED", "REJECTED"):
                    logger.error(
                        "stateseal commit on %s: %s, the token was taken over by another attempt while "
                        "this handler ran or its Commit was kept (this result stands; the other attempt "
                        "may run it too)",
                        method,
                        e.reason,
                    )
                else:
                    # Without the commit the token may open again after the
                    # lease (reserve mode: handlers must be idempotent).
                    logger.error("stateseal commit failed on %s: %s", method, e.reason)
                return
            if tries:
                logger.info("stateseal commit on %s landed after %d failed tries", method, tries)
            return

    async def _renew_once(self, method: str, reservation: str, deadline: float) -> int | None:
        """One renewal of `reservation`, abandoned after `deadline` seconds
        (or the client's timeout, if shorter): the lease granted (0 when the
        server does not say, or when the renewal failed and the next is
        tried a third of the lease after this one was sent), or None when
        stateseal says the reservation no longer holds the token
        (`LEASE_EXPIRED`): another attempt took it over, or this one's
        Commit landed. The caller logs that (see _Renewal)."""
        try:
            lease = await self._client.renew(reservation, self._lease, timeout=deadline)
        except StatesealError as e:
            if renewal_lost(e):
                return None
            # Unreachable or transient: keep trying; the lease holds
            # until it runs out, and Commit still succeeds while no
            # other attempt took the token over.
            logger.warning("stateseal renew failed on %s: %s; retrying", method, e.reason)
            return 0
        except asyncio.CancelledError:
            raise
        except Exception:  # never let the renewals die silently
            logger.warning("stateseal renew raised on %s; retrying", method, exc_info=True)
            return 0
        return lease.lease_seconds

    async def _settled(self, token: bytes) -> bool:
        """Whether no Commit of `token` is kept in this process (and loop)
        any more, after waiting up to _COMMIT_WAIT for the one that is:
        hurried out of its carrier first."""
        pending = _PENDING.get(asyncio.get_running_loop(), {}).get(token)
        if pending is None:
            return True
        task, carrier = pending
        carrier.send_all()
        await asyncio.wait({task}, timeout=_COMMIT_WAIT)
        return task.done()

    async def _open(
        self,
        wire: str,
        token: bytes,
        subject: str,
        method: str,
        digest: bytes,
        reserve: bool,
        answers_json: str,
        *,
        carry: bool,
    ):
        # A handler of this process answered with this token and its Commit
        # has not landed yet: wait for it, and while it is still kept never
        # open the token (its lease may have run out during an outage, and
        # this Open would take it over and run the handler again).
        if not await self._settled(token):
            raise _still_committing()
        attempt = uuid.uuid4().hex
        resent = busy = 0
        waited = False
        while True:
            # A durable Open (of a single-use token) carries the Commits
            # waiting in this loop: its durable round is theirs too.
            carried = self._carrier().take() if carry else []
            try:
                opened = await self._client.open(
                    wire,
                    subject=subject,
                    method=method,
                    params_digest=digest,
                    reserve=reserve,
                    lease_seconds=self._lease if reserve else 0,
                    attempt_id=attempt,
                    input_responses_json=answers_json,
                    commit=[r for r, _, _ in carried],
                )
                self._carrier().settle(carried, opened.commits)
                return opened
            except BaseException as e:
                # Their outcome is unknown: each is sent on its own (Commit
                # is idempotent).
                self._carrier().send(carried)
                if not isinstance(e, StatesealError):
                    raise

                # Safe: the same attempt id gets the same success if the
                # first try was recorded.
                if resent < 2 and resend(e):
                    resent += 1
                    logger.warning("stateseal open on %s: %s; retrying", method, e.reason)
                    continue
                if e.from_stateseal and e.reason == "IN_USE":
                    # A handler that has answered holds the token until its
                    # Commit, which runs beside its answer, lands. If that
                    # Commit is this process's (it answered while this Open
                    # was on its way), wait for it (once; still kept
                    # after that: in progress); else perhaps another
                    # replica's: wait a little, three times. Then the
                    # token's true state (used, or still in progress) is
                    # what this Open gets.
                    if not waited and token in _PENDING.get(asyncio.get_running_loop(), {}):
                        waited = True
                        if await self._settled(token):
                            continue
                        raise _still_committing() from None
                    if busy < len(_BUSY_WAITS):
                        await asyncio.sleep(_BUSY_WAITS[busy])
                        busy += 1
                        continue
                raise

    async def _release(self, method: str, reservation: str, granted: int) -> None:
        # Safe to repeat: a reservation names one lease (its rid), so a
        # late or repeated Release can never free a newer one. A transport
        # failure (the connection to stateseal dropped, as may have just
        # failed the call that led here) is retried twice after a short
        # wait, before the request's answer; one that still cannot land
        # (stateseal or its ledger down) is kept and retried in the
        # background, as a Commit is (see _kept_release).
        n = 0
        while True:
            try:
                await self._client.release(reservation)
                return
            except StatesealError as e:
                if n < 2 and resend(e):
                    n += 1
                    await asyncio.sleep(0.05 * n)
                    continue
                failed = e
                break
        if not failed.retryable:
            # The lease ends by itself; the retry waits for it at worst.
            logger.warning("stateseal release failed on %s: %s", method, failed.reason)
            return
        if not self._room("release", method):
            return
        logger.warning("stateseal release on %s: %s; retrying in the background", method, failed.reason)
        loop = asyncio.get_running_loop()
        until = loop.time() + max(self._commit_window, granted)
        task = loop.create_task(self._kept_release(method, reservation, until))
        self._kept.add(task)
        task.add_done_callback(self._kept.discard)

    async def _kept_release(self, method: str, reservation: str, until: float) -> None:
        """A Release that could not land before its request's answer,
        retried with capped backoff while transient, until the loop's clock
        passes `until`. Never raises but its own cancellation."""
        loop = asyncio.get_running_loop()
        pause = _RETRY_FIRST
        tries = 1
        try:
            while True:
                wait = _backoff(pause)
                if loop.time() + wait > until:
                    logger.warning(
                        "stateseal release on %s did not land after %d tries: the token opens again once "
                        "its lease ends",
                        method,
                        tries,
                    )
                    return
                await asyncio.sleep(wait)
                pause = min(pause * 2, _RETRY_CAP)
                try:
                    await self._client.release(reservation)
                except StatesealError as e:
                    tries += 1
                    if e.retryable:
                        logger.debug("stateseal release on %s: %s; retrying", method, e.reason)
                        continue
                    logger.warning("stateseal release failed on %s: %s", method, e.reason)
                    return
                logger.info("stateseal release on %s landed after %d failed tries", method, tries)
                return
        except asyncio.CancelledError:
            logger.warning(
                "stateseal release on %s cancelled before it landed: the token opens again once its lease ends",
                method,
            )
            raise
        except Exception:
            logger.exception("stateseal release on %s raised", method)

    def _digest(self, method: str, params: Mapping[str, Any]) -> bytes:
        """Binding v2 of the params, computed here (numbers exact)."""
        try:
            return params_digest(method, params)
        except (BindingError, RecursionError):
            # NaN, infinities, lone surrogates: not bindable; refuse cleanly.
            logger.warning("params on %s cannot be bound (not strict JSON)", method)
            raise MCPError(code=INVALID_PARAMS, message="Invalid params") from None

    def _check_state(self, method: str, wire: str) -> None:
        """Refuses, before stateseal, a `requestState` over
        `max_request_state_bytes` (UTF-8, as sent) or not sendable as
        UTF-8: the end user's fault, logged at debug only."""
        # UTF-8 takes at least a byte a character: the length alone refuses
        # most oversized states without encoding them.
        size = len(wire) if len(wire) > self._max_state else _utf8_len(wire)
        if size is None:  # a lone surrogate: no token has one
            self._reject(method, "MALFORMED", logging.DEBUG, "not UTF-8, refused before stateseal")
        if size > self._max_state:
            self._reject(method, "TOO_LARGE", logging.DEBUG, f"over {self._max_state} bytes, refused before stateseal")

    def _answers_json(self, method: str, answers: Any) -> str:
        """`inputResponses` as sent to stateseal; refused, before stateseal,
        when its UTF-8 over `max_input_responses_bytes`."""
        text = self._json(method, answers)
        size = _utf8_len(text)
        if size is None:  # lone surrogates: not strict JSON
            logger.warning("params on %s cannot be bound (not strict JSON)", method)
            raise MCPError(code=INVALID_PARAMS, message="Invalid params")
        if size > self._max_answers:
            logger.debug(
                "inputResponses refused on %s: TOO_LARGE (over %d bytes, refused before stateseal)",
                method,
                self._max_answers,
            )
            raise MCPError(
                code=INVALID_PARAMS,
                message="Invalid params: inputResponses too large",
                data={"reason": "input_responses_too_large"},
            )
        return text

    @staticmethod
    def _json(method: str, value: Any) -> str:
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, UnicodeEncodeError):
            # NaN, infinities, lone surrogates: not bindable; refuse cleanly.
            logger.warning("params on %s cannot be bound (not strict JSON)", method)
            raise MCPError(code=INVALID_PARAMS, message="Invalid params") from None

    async def _seal_if_asked(
        self,
        ctx: ServerRequestContext[Any, Any],
        params: Mapping[str, Any],
        result: HandlerResult,
        *,
        subject: str | None = None,
        digest: bytes | None = None,
    ) -> HandlerResult:
        if not is_input_required(result):
            return result
        if isinstance(result, Mapping):
            state, questions = result.get("requestState"), result.get("inputRequests")
        else:
            state = result.request_state
            questions = result.model_dump(mode="json", by_alias=True, exclude_none=True).get("inputRequests")
        if state is None and questions:
            # The handler asked without a state of its own (the
            # specification allows it). The boundary mints one, empty, so
            # the retry's answers come with a token like any other: bound,
            # single use, filtered against these questions. Opening an empty
            # state hands the handler no requestState.
            state = ""
        if not isinstance(state, str):
            return result
        if subject is None:
            subject = self._subject(ctx)
        if digest is None:
            digest = self._digest(ctx.method, params)
        target = _target(ctx.method, params)
        try:
            sealed = await self._client.seal(
                subject=subject,
                method=ctx.method,
                params_digest=digest,
                state=state.encode("utf-8"),
                ttl_seconds=self._ttl,
                single_use=target not in self._reusable,
                # The questions travel sealed in the token: the retry's
                # answers are filtered against them. A round that asked
                # nothing ("still working, call again") is sealed with no
                # questions, never without a manifest: stateseal then drops
                # every answer that comes with its token (UNASKED).
                input_requests_json=self._json(ctx.method, questions) if questions else "{}",
            )
        except StatesealError as e:
            self._refuse(ctx.method, e, call_refusal(e, sealing=True))
        if isinstance(result, Mapping):
            return {**result, "requestState": sealed.request_state}
        return result.model_copy(update={"request_state": sealed.request_state})

    @staticmethod
    def _refuse(method: str, e: StatesealError, r: Refusal) -> NoReturn:
        level = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}[r.log]
        if r.kind == "replayed":
            logger.log(level, "requestState REPLAYED on %s: already used", method)
        elif r.kind == "in_use":
            logger.log(level, "requestState IN_USE on %s: in progress", method)
        elif r.kind == "unavailable":
            logger.log(level, "stateseal unavailable on %s: %s", method, e.reason)
        elif r.kind == "rejected" and not e.from_stateseal:
            logger.log(
                level,
                "requestState rejected on %s: %s (stateseal refused the message as too large; are "
                "max_request_state_bytes and max_input_responses_bytes above its --max-state-bytes / "
                "--max-input-bytes?)",
                method,
                e.reason,
            )
        elif r.kind == "rejected":
            logger.log(level, "requestState rejected on %s: %s", method, e.reason)
        else:
            logger.log(level, "stateseal call failed on %s: %s (check credentials and configuration)", method, e.reason)
        error = MCPError(code=r.code, message=r.message, data=dict(r.data) if r.data is not None else None)
        if r.kind == "rejected":
            # As every rejection: the StatesealError stays the context.
            raise error
        raise error from None

    @staticmethod
    def _reject(method: str, reason: str, level: int = logging.WARNING, detail: str = "") -> NoReturn:
        logger.log(level, "requestState rejected on %s: %s%s", method, reason, f" ({detail})" if detail else "")
        raise MCPError(
            code=INVALID_PARAMS,
            message="Invalid or expired requestState",
            data={"reason": "invalid_request_state"},
        )


class _Carrier:
    """The Commits of one boundary and event loop waiting for a durable
    Open to carry them (`OpenRequest.commit`, at most _CARRY_PER_OPEN each),
    oldest first. Whatever no Open has taken `delay` seconds after
    the first of them was queued is sent on its own, one Commit each, so no
    Commit waits longer than that for a carrier."""

    def __init__(self, client: RequestStateClient, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self._client = client
        self._loop = loop
        self._delay = delay
        #: (reservation, deadline of its try if sent on its own, outcome).
        self._waiting: list[tuple[str, float | None, asyncio.Future[None]]] = []
        self._timer: asyncio.TimerHandle | None = None
        # Commits sent on their own, held so they are not collected.
        self._sending: set[asyncio.Task[None]] = set()
        #: drain() calls under way: a Commit queued meanwhile goes at once.
        self.draining = 0

    def commit(self, reservation: str, deadline: float | None = None) -> asyncio.Future[None]:
        """Queues a Commit (`deadline`: its try's if it goes on its own,
        None: the client's timeout); the future ends with its outcome
        (raises the StatesealError a Commit would)."""
        done: asyncio.Future[None] = self._loop.create_future()
        if self.draining:
            self.send([(reservation, deadline, done)])
            return done
        self._waiting.append((reservation, deadline, done))
        if self._timer is None:
            self._timer = self._loop.call_later(self._delay, self.send_all)
        return done

    def take(self) -> list[tuple[str, float | None, asyncio.Future[None]]]:
        """The oldest waiting Commits, for an Open to carry."""
        taken, self._waiting = self._waiting[:_CARRY_PER_OPEN], self._waiting[_CARRY_PER_OPEN:]
        if not self._waiting:
            self._stop_timer()
        return taken

    def settle(
        self, taken: list[tuple[str, float | None, asyncio.Future[None]]], outcomes: tuple[StatesealError | None, ...]
    ) -> None:
        """Ends each carried Commit with its outcome from the Open's answer.
        One the answer does not name (a server that does not know carried
        commits) is sent on its own."""
        for (_, _, done), outcome in zip(taken, outcomes):
            if done.done():
                continue
            if outcome is None:
                done.set_result(None)
            else:
                done.set_exception(outcome)
        self.send(taken[len(outcomes) :])

    def send_all(self) -> None:
        """Sends every waiting Commit on its own, now."""
        taken, self._waiting = self._waiting, []
        self._stop_timer()
        self.send(taken)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def send(self, taken: list[tuple[str, float | None, asyncio.Future[None]]]) -> None:
        """Sends each of `taken` as a Commit of its own."""
        for reservation, deadline, done in taken:
            if done.done():
                continue
            task = self._loop.create_task(self._alone(reservation, deadline, done))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _alone(self, reservation: str, deadline: float | None, done: asyncio.Future[None]) -> None:
        try:
            await self._client.commit(reservation, timeout=deadline)
        except StatesealError as e:
            if not done.done():
                done.set_exception(e)
            return
        except BaseException as e:
            if not done.done():
                done.set_exception(e)
            raise
        if not done.done():
            done.set_result(None)


class _Renewal:
    """Renews a reservation every third of its granted lease (at least every
    0.5 s) while its handler runs, and after it between the tries of its
    kept Commit: a timer, and a task only while a Renew is in flight, so a
    handler that ends before the first renewal costs no task and its Commit
    waits for nothing. Only the granted length is used, never
    `lease_expires_at_unix`: this replica's clock is not the ledger's.

    Each Renew's deadline is that third too (at least _MIN_RENEW_DEADLINE,
    at most the client's timeout), counted from when it was sent, as is the
    next one: due a third after a Renew that landed was sent, and once the
    deadline of one that failed has passed. So a Renew that hangs is
    abandoned and the next goes at once (to the next stateseal replica,
    under round robin): two Renews are tried within every lease."""

    def __init__(self, boundary: StatesealBoundary, method: str, reservation: str, granted: int) -> None:
        self._boundary = boundary
        self._method = method
        self._reservation = reservation
        self._granted = granted
        self._loop = asyncio.get_running_loop()
        self._stopped = False
        #: The handler answered: its Commit is under way.
        self._answered = False
        #: A Commit try is in flight (hold()): no Renew goes meanwhile.
        self._held = False
        #: A renewal fell due (or was cancelled) while held: sent on resume().
        self._missed = False
        self._inflight: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._schedule()

    def _interval(self) -> float:
        return max(_MIN_RENEW_INTERVAL, self._granted / 3)

    def deadline(self) -> float:
        """The deadline of a Renew, and of a Commit try: a third of the
        lease granted last (at least _MIN_RENEW_DEADLINE; the client caps it
        at its timeout). Never longer than the interval, so Renews never
        overlap."""
        return max(_MIN_RENEW_DEADLINE, self._granted / 3)

    def _schedule(self, delay: float | None = None) -> None:
        self._timer = self._loop.call_later(self._interval() if delay is None else delay, self._due)

    def _due(self) -> None:
        self._timer = None
        if self._stopped:
            return
        if self._held:
            self._missed = True
            return
        self._inflight = self._loop.create_task(self._renew())

    async def _renew(self) -> None:
        sent = self._loop.time()
        deadline = self.deadline()
        try:
            granted = await self._boundary._renew_once(self._method, self._reservation, deadline)
        except asyncio.CancelledError:
            self._inflight = None
            if not self._stopped:
                # Cancelled for a Commit try (hold()): renewed again as
                # soon as that try fails, if it does.
                self._missed = True
            raise
        self._inflight = None
        if self._stopped:
            return
        if granted is None:
            self._stopped = True
            if self._answered:
                # Between the tries of a Commit: an earlier try may have
                # landed all the same (its answer lost), and a committed
                # reservation renews as LEASE_EXPIRED. The Commit's next
                # answer decides, and reports a token taken over.
                logger.debug(
                    "stateseal renew on %s: LEASE_EXPIRED while the Commit is under way; renewing stops",
                    self._method,
                )
            else:
                logger.error(
                    "stateseal renew on %s: reservation lost while the handler ran; another attempt may run it",
                    self._method,
                )
            return
        if granted > 0:
            self._granted = granted
            # Due a third of the lease after this one was sent.
            due = sent + self._interval()
        else:
            # Failed: the next goes once this one's deadline has passed, so
            # at once after a Renew that ran it out.
            due = sent + deadline
        self._schedule(max(0.0, due - self._loop.time()))

    def answered(self) -> None:
        """The handler answered: renewing goes on between the tries of its
        Commit, and a lost renewal from now on is left for the Commit to
        report."""
        self._answered = True

    async def hold(self) -> None:
        """A Commit try is about to go: no Renew goes until resume() (or
        stop()); one in flight is cancelled and waited for (asyncio.wait
        never raises the task's own cancellation)."""
        self._held = True
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            inflight.cancel()
            await asyncio.wait({inflight})

    def resume(self) -> None:
        """The Commit try failed: renewing goes on, at once if a renewal
        fell due meanwhile."""
        self._held = False
        if self._missed and not self._stopped:
            self._missed = False
            self._inflight = self._loop.create_task(self._renew())

    def stop(self) -> asyncio.Task[None] | None:
        """Stops renewing: the timer is cancelled, and a Renew in flight too,
        which is returned to be waited for (None when there is none)."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            inflight.cancel()
            return inflight
        return None


def install(server: Any, boundary: StatesealBoundary) -> None:
    """Replaces the SDK's `RequestStateBoundary` in `server.middleware`
    (an `MCPServer`) with `boundary`, at the same position."""
    chain = server.middleware
    for i, m in enumerate(chain):
        if isinstance(m, RequestStateBoundary):
            chain[i] = boundary
            return
    chain.insert(0, boundary)
