"""The heartbeat ends when cancelled even where a Redis command turns the cancel into its timeout.

A drain cancels the heartbeat and waits for it before leaving the registry (worker/server/app.py);
a fresh-clone CI run once saw the drain stuck there until its deadline, the beat asleep in its next
period (exit -15; test_fault_handover.py). How the cancel was lost is not proven: a cancel that meets
redis-py's own `asyncio.timeout` as it expires can come out as its timeout, which the loop catches.
Here the beat is a stand-in whose Redis call, when cancelled, raises redis-py's timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.exceptions

from worker.server import heartbeat


def test_a_cancel_turned_into_a_redis_timeout_still_ends_the_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    beats: list[int] = []
    converting = [True]  # off once the test is over, so a loop that did not stop can be ended

    async def once(_self: Any, *, draining: bool, scan: bool = False) -> None:
        beats.append(1)
        try:
            await asyncio.sleep(3600)  # a Redis command in flight
        except asyncio.CancelledError as exc:
            if not converting[0]:
                raise
            raise redis.exceptions.TimeoutError("Timeout reading from socket") from exc

    monkeypatch.setattr(heartbeat.Beat, "once", once)

    async def scenario() -> None:
        loop = asyncio.create_task(
            heartbeat.heartbeat_loop(
                None,  # type: ignore[arg-type]  # the stand-in beat touches neither
                None,  # type: ignore[arg-type]
                None,  # type: ignore[arg-type]
                None,  # type: ignore[arg-type]
                period_s=0.01,
                grace_s=1.0,
                draining=asyncio.Event(),
            )
        )
        await asyncio.sleep(0.05)
        loop.cancel()
        done, _running = await asyncio.wait([loop], timeout=2.0)
        try:
            assert done == {loop}, "the heartbeat went on beating after its cancel"
            assert loop.cancelled()
            assert len(beats) == 1
        finally:
            converting[0] = False
            loop.cancel()
            await asyncio.wait([loop], timeout=2.0)

    asyncio.run(scenario())
