"""Fault suite: a worker killed with SIGKILL while 6 sessions stream TEXT (issue 9, exact text).

As tests/system/gateway/test_fault_worker.py, but every chunk is text cut wherever (mid-word, mid-number,
mid-multibyte-word, mid-`<|im_start|>`), about one in three asking for output: the worker holds
text back in each session's tail, so at the kill the durable point usually has uncommitted text,
and delivered-but-undurable text chunks must be re-tokenized exactly as the old worker did. What
must hold: every chunk gets exactly one `output.done`, and every session's outputs equal those of
an uninterrupted single-session reference fed the same pieces. No timing is asserted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.store.connection import resilient_redis
from shared.store.schema import KeySchema
from tests.system.gateway import reference
from tests.system.gateway.faults import Streamer, fault_stack, kill_busiest_worker, tally

SEEDS = tuple(range(40, 46))
TURNS = 40
KILL_AT = 16


@pytest.fixture(scope="module")
def text_references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[reference.PendingReferences]:
    pending = reference.start(dict.fromkeys(SEEDS, TURNS), tmp_path_factory.mktemp("text-refs"), text=True)
    try:
        yield pending
    finally:
        pending.stop()


def test_worker_killed_mid_text_stream_costs_no_turn_and_no_token(
    tmp_path: Path, text_references: reference.PendingReferences
) -> None:
    with fault_stack(tmp_path) as (server, stack, prefix):
        expected = {seed: text_references.get(seed, TURNS) for seed in SEEDS}

        async def body() -> None:
            redis = resilient_redis(server.url)
            schema = KeySchema(prefix)
            try:
                streamers = [
                    await Streamer.open(stack.realtime_url(seed % 2), seed, TURNS, text=True)
                    for seed in SEEDS
                ]
                receivers = [asyncio.create_task(s.receive()) for s in streamers]
                await asyncio.gather(*(s.send_until(KILL_AT) for s in streamers))
                kill = await kill_busiest_worker(stack, streamers, redis, schema, TURNS)
                victim, moved, in_flight = kill.victim, kill.moved, kill.in_flight
                await asyncio.wait_for(asyncio.gather(*receivers), 120)
                result = tally(streamers, expected)
                print(result.line("worker SIGKILL, text streams"))
                print(f"[fault] victim {victim}: {len(moved)} sessions moved, {in_flight} chunks unanswered")
                assert (result.continued, result.lost, result.duplicated) == (len(SEEDS), 0, 0), result
                assert result.identical == len(SEEDS), result
                assert result.restored == len(moved) > 0, result
            finally:
                await redis.aclose()

        asyncio.run(asyncio.wait_for(body(), 180))
