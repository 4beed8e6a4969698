"""A typed async client for `stateseal.v1.RequestState` (grpc.aio)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2

from ._proto.stateseal.v1 import stateseal_pb2, stateseal_pb2_grpc

__all__ = ["Opened", "RequestStateClient", "Sealed", "StatesealError"]

DOMAIN = "stateseal"


class StatesealError(Exception):
    """A rejection (or transport failure) from stateseal.

    `reason` is stateseal's ErrorInfo reason (MALFORMED, TOO_LARGE, BAD_METHOD,
    EXPIRED, REPLAYED, UNKNOWN_KEY, REJECTED, LEDGER_UNAVAILABLE), or the gRPC
    code name when the failure did not come from stateseal itself.
    """

    def __init__(self, reason: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.code = code

    @property
    def retryable(self) -> bool:
        return self.reason == "LEDGER_UNAVAILABLE" or self.code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )


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


def _error(e: grpc.aio.AioRpcError) -> StatesealError:
    reason = e.code().name
    for key, value in e.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info) and info.domain == DOMAIN:
                    reason = info.reason
    return StatesealError(reason, e.code(), e.details() or "")


def _binding(subject: str, method: str, params_json: str | None, params_digest: bytes | None):
    if (params_json is None) == (params_digest is None):
        raise ValueError("give exactly one of params_json and params_digest")
    if params_json is not None:
        return stateseal_pb2.Binding(subject=subject, method=method, params_json=params_json)
    return stateseal_pb2.Binding(subject=subject, method=method, params_digest=params_digest)


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
        options = [("grpc.lb_policy_name", "round_robin")] if round_robin else []
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._stub = stateseal_pb2_grpc.RequestStateStub(self._channel)
        self._metadata = (("authorization", f"Bearer {bearer}"),) if bearer else ()
        self._timeout = timeout

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
    ) -> Sealed:
        req = stateseal_pb2.SealRequest(
            binding=_binding(subject, method, params_json, params_digest),
            state=state,
            ttl_seconds=ttl_seconds,
            single_use=single_use,
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
    ) -> Opened:
        req = stateseal_pb2.OpenRequest(
            request_state=request_state,
            binding=_binding(subject, method, params_json, params_digest),
        )
        try:
            r = await self._stub.Open(req, timeout=self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return Opened(r.state, r.expires_at_unix, r.key_id, r.consumed)

    async def close(self) -> None:
        await self._channel.close()
