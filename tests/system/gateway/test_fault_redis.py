"""Fault suite: Redis killed and restarted with no data while sessions stream (issue 9, item 4).

Real processes on loopback: one redis-server (no persistence), two workers, two gateways, the tiny
model, greedy. What must hold: every chunk is answered (no Redis on the hot path), every open after
the restart succeeds (pools reconnect, opens wait out the empty registry), the workers re-write the
records and whole token logs of the sessions they hold, so every live session resumes through the
other gateway with its full history; and an outage logs a line, not a traceback per try.
Figures go to stdout (`pytest -s`); no timing is asserted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from shared.client.clients import RealtimeClient
from shared.store.connection import resilient_redis
from shared.store.registry import read_session
from shared.store.schema import KeySchema
from tests.system.gateway.faults import Streamer, fault_stack, tally
from tests.system.gateway.reference import SESSION_CONFIG, PendingReferences, stream
from tests.wait import await_until
from worker.server.token_log import read_log

SEEDS = (20, 21, 22, 23)
TURNS = 50
KILL_AT = 15  # turns sent before Redis is killed
TURNS_WITHOUT_REDIS = 10  # answered for each session while Redis is down, before it comes back
PROBE_OPENS = 8


def full_sequence(seed: int, outputs: list[list[int]]) -> list[int]:
    tokens: list[int] = []
    for chunk, out in zip(stream(seed, len(outputs)), outputs, strict=True):
        tokens += chunk + out
    return tokens


def test_redis_restarted_empty_costs_no_session(tmp_path: Path, references: PendingReferences) -> None:
    expected = {seed: references.get(seed, TURNS) for seed in SEEDS}
    with fault_stack(tmp_path) as (server, stack, prefix):
        schema = KeySchema(prefix)

        async def body() -> None:
            streamers = [await Streamer.open(stack.realtime_url(0), seed, TURNS) for seed in SEEDS]
            receivers = [asyncio.create_task(s.receive()) for s in streamers]
            await asyncio.gather(*(s.send_until(KILL_AT) for s in streamers))
            server.kill()
            killed = time.monotonic()
            senders = asyncio.gather(*(s.send_until(TURNS) for s in streamers))
            await await_until(  # the sessions keep streaming without Redis
                lambda: all(len(s.dones) >= KILL_AT + TURNS_WITHOUT_REDIS for s in streamers),
                60,
                f"every session to be answered {TURNS_WITHOUT_REDIS} turns with Redis down",
            )
            server.start()
            restarted = time.monotonic()
            opened = 0
            for i in range(PROBE_OPENS):  # every open after the restart, through both gateways
                async with await RealtimeClient.connect(stack.realtime_url(i % 2)) as probe:
                    await probe.open(**SESSION_CONFIG)
                    opened += 1
                    await probe.close()
            await senders
            await asyncio.wait_for(asyncio.gather(*receivers), 120)
            result = tally(streamers, expected)
            print(result.line("redis restarted empty"))
            down_s = restarted - killed
            print(f"[fault] redis down {down_s:.2f} s; opens after restart {opened}/{PROBE_OPENS}")
            assert opened == PROBE_OPENS
            assert (result.continued, result.lost, result.duplicated) == (len(SEEDS), 0, 0), result
            assert result.identical == len(SEEDS), result

            redis = resilient_redis(server.url)
            try:
                # The workers re-write the records and the whole logs within a few heartbeats.
                for s in streamers:
                    want = full_sequence(s.seed, expected[s.seed])

                    async def rebuilt(sid: str = s.session_id, want: list[int] = want) -> bool:
                        return bool(await read_log(redis, schema, sid) == want)

                    await await_until(rebuilt, 30, f"the log of stream {s.seed} to be rebuilt")
                    assert await read_session(redis, schema, s.session_id) is not None
                back_s = time.monotonic() - restarted
                print(f"[fault] records and full logs back {back_s:.2f} s after restart")
            finally:
                await redis.aclose()

            resumed_ok = 0
            for s in streamers:  # every live session resumes through the other gateway
                await s.client.disconnect()
                async with await RealtimeClient.connect(stack.realtime_url(1)) as again:
                    resumed = await again.resume(s.session_id, s.resume_token, TURNS)
                    length = len(full_sequence(s.seed, expected[s.seed]))
                    assert (resumed.length, resumed.last_seq) == (length, TURNS)
                    await again.close()
                    resumed_ok += 1
            print(f"[fault] resumed through the other gateway, full history: {resumed_ok}/{len(SEEDS)}")

        asyncio.run(asyncio.wait_for(body(), 180))
        for proc in stack.workers.values():
            log = proc.log_path.read_text(errors="replace")
            flush_lines = log.count("token log flush failed")
            tracebacks = log.count("Traceback")
            print(f"[fault] {proc.name}: flush-failure lines {flush_lines}, tracebacks {tracebacks}")
            assert flush_lines <= 1 and "Traceback" not in log, proc.log_tail(80)
