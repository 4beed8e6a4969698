"""stateseal for the official MCP Python SDK.

- `RequestStateClient`: a typed async client for `stateseal.v1.RequestState`.
- `StatesealBoundary`: an async `MCPServer` middleware that takes the place of
  the SDK's `RequestStateBoundary`: it opens inbound `requestState` through
  stateseal (integrity, binding, expiry, single use) and seals outbound ones.
- `install(server, boundary)`: swaps the SDK's boundary for ours.
"""

from .client import Opened, RequestStateClient, Sealed, StatesealError
from .middleware import StatesealBoundary, install

__all__ = [
    "Opened",
    "RequestStateClient",
    "Sealed",
    "StatesealBoundary",
    "StatesealError",
    "install",
]
