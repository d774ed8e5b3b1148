"""The Python client: async and sync shells over one Sans-I/O core (`core.py`), with retries (`retry.py`).

`from shared.client import RealtimeClient` is the documented entry point; the shells live in
`clients.py`.
"""

from shared.client.clients import ConnectOptions, RealtimeClient, SyncRealtimeClient
from shared.client.core import ConnectionLost, SessionClosedError
from shared.client.retry import NO_RETRY, RetryPolicy

__all__ = [
    "NO_RETRY",
    "ConnectOptions",
    "ConnectionLost",
    "RealtimeClient",
    "RetryPolicy",
    "SessionClosedError",
    "SyncRealtimeClient",
]
