"""stateseal for the official MCP Python SDK.

- `RequestStateClient`: a typed async client for `stateseal.v1.RequestState`.
- `StatesealBoundary`: an async `MCPServer` middleware that takes the place of
  the SDK's `RequestStateBoundary`: it opens inbound `requestState` through
  stateseal (integrity, binding, expiry, single use) and seals outbound ones.
- `install(server, boundary)`: swaps the SDK's boundary for ours.
"""

from importlib.metadata import PackageNotFoundError, version

from .binding import BindingError, params_digest, subject_for
from .client import MAX_CARRIED_COMMITS, Lease, Opened, RequestStateClient, Sealed, StatesealError
from .middleware import (
    DEFAULT_COMMIT_DELAY,
    DEFAULT_COMMIT_WINDOW,
    DEFAULT_MAX_INPUT_RESPONSES_BYTES,
    DEFAULT_MAX_PENDING,
    DEFAULT_MAX_REQUEST_STATE_BYTES,
    StatesealBoundary,
    install,
)

try:
    __version__ = version("stateseal-mcp")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_COMMIT_DELAY",
    "DEFAULT_COMMIT_WINDOW",
    "DEFAULT_MAX_INPUT_RESPONSES_BYTES",
    "DEFAULT_MAX_PENDING",
    "MAX_CARRIED_COMMITS",
    "DEFAULT_MAX_REQUEST_STATE_BYTES",
    "BindingError",
    "Lease",
    "Opened",
    "RequestStateClient",
    "Sealed",
    "StatesealBoundary",
    "StatesealError",
    "install",
    "params_digest",
    "subject_for",
]
