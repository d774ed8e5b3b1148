"""The one way a test waits for something: poll it until it holds, or fail naming what never came.

No test sleeps a fixed time hoping a thing has happened by then (the token log's flush, a key's
expiry, a worker's registration): it waits on the thing itself, with a generous bound, so a slow
machine only makes it slower, never red.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

INTERVAL_S = 0.02


def wait_until(holds: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Return once `holds()` is true; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not holds():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        time.sleep(INTERVAL_S)


async def await_until(holds: Callable[[], Awaitable[bool] | bool], timeout_s: float, what: str) -> None:
    """`wait_until` for the event loop; `holds` may be a coroutine function (a Redis read)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = holds()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        await asyncio.sleep(INTERVAL_S)
