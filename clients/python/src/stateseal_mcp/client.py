"""A typed async client for `stateseal.v1.RequestState` (grpc.aio)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import grpc
from google.rpc import error_details_pb2, status_pb2

from ._proto.stateseal.v1 import stateseal_pb2, stateseal_pb2_grpc

__all__ = ["MAX_CARRIED_COMMITS", "Lease", "Opened", "RequestStateClient", "Sealed", "StatesealError"]

DOMAIN = "stateseal"


class StatesealError(Exception):
    """A rejection (or transport failure) from stateseal.

    `reason` is stateseal's ErrorInfo reason (see the service README's error
    table), or the gRPC code name when the failure did not come from stateseal
    itself (`from_stateseal` is then False).
    """

    #: Rejections of the request or token: the MCP client's side.
    CLIENT_REASONS = frozenset(
        {"MALFORMED", "TOO_LARGE", "BAD_METHOD", "EXPIRED", "REPLAYED", "UNKNOWN_KEY",
         "REJECTED", "IN_USE", "LEASE_EXPIRED", "BAD_INPUT_REQUESTS"}
    )
    #: Transient server-side conditions: retry.
    TRANSIENT_REASONS = frozenset(
        {"LEDGER_UNAVAILABLE", "CLOCK_UNSYNCED", "OVERLOADED", "AUDIT_UNAVAILABLE"}
    )
    #: gRPC statuses without a stateseal reason (the transport answered, not
    #: stateseal) that what the caller sent causes: a message over the
    #: service's size limit (tonic answers OUT_OF_RANGE).
    TRANSPORT_CLIENT_CODES = frozenset({"OUT_OF_RANGE"})
    #: gRPC statuses without a stateseal reason that are transient: the
    #: service is unreachable, late, or out of some resource.
    TRANSPORT_TRANSIENT_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})

    def __init__(self, reason: str, code: grpc.StatusCode, message: str, from_stateseal: bool = True) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.code = code
        self.from_stateseal = from_stateseal

    @property
    def retryable(self) -> bool:
        """A transient outage: the same request may be retried."""
        if self.from_stateseal:
            return self.reason in self.TRANSIENT_REASONS
        return self.code.name in self.TRANSPORT_TRANSIENT_CODES

    @property
    def client_fault(self) -> bool:
        """A rejection of what the MCP client sent (token, binding, answers,
        or a message too large for the service)."""
        if self.from_stateseal:
            return self.reason in self.CLIENT_REASONS
        return self.code.name in self.TRANSPORT_CLIENT_CODES


@dataclass(frozen=True)
class Sealed:
    request_state: str
    expires_at_unix: int
    key_id: str


@dataclass(frozen=True)
class Opened:
    state: bytes
    expires_at_unix: int
    key_id: str
    consumed: bool
    #: OPEN_MODE_RESERVE on a single-use token: pass it to renew(), commit()
    #: or release().
    reservation: str = ""
    #: When the lease ends, by the ledger's clock (informative: compare it
    #: with no other clock).
    lease_expires_at_unix: int = 0
    #: With `input_responses_json`: the answers filtered against the token's
    #: sealed manifest (as sent when it has none), and what was dropped as
    #: (key, reason) pairs.
    input_responses_json: str = ""
    dropped: tuple[tuple[str, str], ...] = ()
    #: OPEN_MODE_RESERVE: the lease granted, in seconds (0 from a server that
    #: does not report it). Renew every third of it while the handler runs.
    lease_seconds: int = 0
    #: One per reservation the call carried (`commit=`), in order: None when
    #: committed, else the StatesealError a Commit would have raised.
    commits: tuple[StatesealError | None, ...] = ()


class Lease(NamedTuple):
    """A renewed lease: when it ends (the ledger's clock) and its length."""

    lease_expires_at_unix: int
    lease_seconds: int


def _error(e: grpc.aio.AioRpcError) -> StatesealError:
    for key, value in e.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info) and info.domain == DOMAIN:
                    return StatesealError(info.reason, e.code(), e.details() or "")
    return StatesealError(e.code().name, e.code(), e.details() or "", from_stateseal=False)


#: The most reservations one Open may carry to commit (the service's bound).
MAX_CARRIED_COMMITS = 16

#: The longest pause between two attempts of a channel to reconnect to
#: stateseal, in milliseconds. gRPC's own backoff grows to 120 s, and calls
#: made meanwhile fail at once without trying: after a 45 s outage a
#: channel took 29 s to reconnect once stateseal was back, longer than many
#: leases, so a Commit kept through the outage would land only after its
#: lease had run out. Capped, it reconnects within a second.
_MAX_RECONNECT_BACKOFF_MS = 1000


def _outcome(o: stateseal_pb2.CommitOutcome) -> StatesealError | None:
    if not o.reason:
        return None
    code = _CODES.get(o.code, grpc.StatusCode.UNKNOWN)
    return StatesealError(o.reason, code, "carried commit refused")


#: gRPC status code numbers to grpc.StatusCode.
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _binding(subject: str, method: str, params_json: str | None, params_digest: bytes | None):
    if (params_json is None) == (params_digest is None):
        raise ValueError("give exactly one of params_json and params_digest")
    if params_json is not None:
        return stateseal_pb2.Binding(subject=subject, method=method, params_json=params_json)
    # A caller-computed digest is binding v2 (stateseal_mcp.binding).
    return stateseal_pb2.Binding(subject=subject, method=method, params_digest=params_digest, binding_version=2)


class RequestStateClient:
    """Async client. `target` is "host:port" (or any gRPC target such as
    "dns:///stateseal-headless.ns.svc:50051" with round_robin balancing).

    - TLS / mTLS: pass `credentials=grpc.ssl_channel_credentials(root_ca,
      private_key=client_key, certificate_chain=client_cert)`.
    - Bearer: pass `bearer="secret"` (sent as `authorization: Bearer …`).
    """

    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        bearer: str | None = None,
        timeout: float = 5.0,
        round_robin: bool = True,
    ) -> None:
        self._target = target
        self._credentials = credentials
        self._options: list[tuple[str, str | int]] = [("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS)]
        if round_robin:
            self._options.append(("grpc.lb_policy_name", "round_robin"))
        # A grpc.aio channel belongs to the event loop it was created in, so
        # the client creates one lazily per running loop: building the client
        # at import time (before any loop) works, and so do several loops.
        self._per_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[grpc.aio.Channel, stateseal_pb2_grpc.RequestStateStub]
        ] = weakref.WeakKeyDictionary()
        self._metadata = (("authorization", f"Bearer {bearer}"),) if bearer else ()
        self._timeout = timeout

    @property
    def _stub(self) -> stateseal_pb2_grpc.RequestStateStub:
        loop = asyncio.get_running_loop()
        entry = self._per_loop.get(loop)
        if entry is None:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(self._target, self._credentials, options=self._options)
            else:
                channel = grpc.aio.insecure_channel(self._target, options=self._options)
            entry = (channel, stateseal_pb2_grpc.RequestStateStub(channel))
            self._per_loop[loop] = entry
        return entry[1]

    def __repr__(self) -> str:  # never the bearer secret
        return "RequestStateClient(..)"

    async def seal(
        self,
        *,
        subject: str,
        method: str,
        state: bytes,
        params_json: str | None = None,
        params_digest: bytes | None = None,
        ttl_seconds: int = 0,
        single_use: bool = False,
        input_requests_json: str = "{}",
    ) -> Sealed:
        """Seals `state`. With `input_requests_json` (the input_required
        result's `inputRequests`), the questions are validated and sealed as
        a manifest that Open filters answers against. The default, `{}`, asks
        nothing: Open drops every answer. `""` seals no manifest at all and
        Open passes answers through unfiltered: never for a round that asks."""
        req = stateseal_pb2.SealRequest(
            binding=_binding(subject, method, params_json, params_digest),
            state=state,
            ttl_seconds=ttl_seconds,
            single_use=single_use,
            input_requests_json=input_requests_json,
        )
        try:
            r = await self._stub.Seal(req, timeout=self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return Sealed(r.request_state, r.expires_at_unix, r.key_id)

    async def open(
        self,
        request_state: str,
        *,
        subject: str,
        method: str,
        params_json: str | None = None,
        params_digest: bytes | None = None,
        reserve: bool = False,
        lease_seconds: int = 0,
        attempt_id: str = "",
        input_responses_json: str = "",
        commit: Sequence[str] = (),
    ) -> Opened:
        """Opens a token. A single-use token is consumed, or with `reserve`
        reserved for a lease (then commit() or release() it). With
        `attempt_id`, the same attempt opening again gets the same success,
        so a retry after a timeout is safe.

        `commit`: reservations of earlier Opens (at most
        MAX_CARRIED_COMMITS) to commit in the same call, each as commit()
        would; their outcomes are in `Opened.commits`. When this call raises,
        whether they were committed is unknown: commit() them again (it is
        idempotent)."""
        if len(commit) > MAX_CARRIED_COMMITS:
            raise ValueError(f"at most {MAX_CARRIED_COMMITS} reservations per open")
        if any("," in r for r in commit):
            raise ValueError("a reservation never contains a comma")
        req = stateseal_pb2.OpenRequest(
            request_state=request_state,
            binding=_binding(subject, method, params_json, params_digest),
            mode=stateseal_pb2.OPEN_MODE_RESERVE if reserve else stateseal_pb2.OPEN_MODE_CONSUME,
            lease_seconds=lease_seconds,
            attempt_id=attempt_id,
            input_responses_json=input_responses_json,
            commit=",".join(commit),
        )
        try:
            r = await self._stub.Open(req, timeout=self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return Opened(
            r.state,
            r.expires_at_unix,
            r.key_id,
            r.consumed,
            r.reservation,
            r.lease_expires_at_unix,
            r.input_responses_json,
            tuple((d.key, d.reason) for d in r.dropped),
            r.lease_seconds,
            tuple(_outcome(o) for o in r.commits),
        )

    async def commit(self, reservation: str, *, timeout: float | None = None) -> None:
        """Makes a reservation a durable consumption (idempotent).
        `timeout`: this call's deadline in seconds, never more than the
        client's `timeout` (None: the client's); the boundary gives each try
        a third of the lease, which it renews between tries."""
        if timeout is not None and not timeout > 0:
            raise ValueError("timeout must be a positive number of seconds")
        deadline = self._timeout if timeout is None else min(timeout, self._timeout)
        try:
            await self._stub.Commit(
                stateseal_pb2.CommitRequest(reservation=reservation), timeout=deadline, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None

    async def renew(self, reservation: str, lease_seconds: int = 0, *, timeout: float | None = None) -> Lease:
        """Extends a reservation's lease from now (`lease_seconds` 0 = the
        server default; capped by the server). LEASE_EXPIRED once another
        attempt took the token over, or the reservation was released or
        collected. `timeout`: this call's deadline in seconds, never more
        than the client's `timeout` (None: the client's); a renewal that
        outlives its lease is of no use, so keep it well within the lease."""
        if timeout is not None and not timeout > 0:
            raise ValueError("timeout must be a positive number of seconds")
        deadline = self._timeout if timeout is None else min(timeout, self._timeout)
        try:
            r = await self._stub.Renew(
                stateseal_pb2.RenewRequest(reservation=reservation, lease_seconds=lease_seconds),
                timeout=deadline,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return Lease(r.lease_expires_at_unix, r.lease_seconds)

    async def release(self, reservation: str) -> None:
        """Gives a reservation back: the token can be opened again."""
        try:
            # Clean-up after a failure, which may have been the connection
            # itself: wait (within the timeout) for a connection instead of
            # failing at once while the channel reconnects.
            await self._stub.Release(
                stateseal_pb2.ReleaseRequest(reservation=reservation),
                timeout=self._timeout,
                metadata=self._metadata,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None

    async def close(self) -> None:
        """Closes the channel of the running loop (others close with their loop)."""
        entry = self._per_loop.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[0].close()
