"""Fault suite: a worker killed with SIGKILL while 8 sessions stream (issue 9, items 1 and 2).

Real processes on loopback: redis-server, two workers, two gateways, the tiny model, greedy. Each
session sends a chunk every 50 ms (up to 4 unanswered). One worker is killed mid-stream; what must
hold: every session carries on, every chunk gets exactly one `output.done` (an error answer counts
as lost), every output equals the uninterrupted single-session reference, and each restore lands on
the live worker on the first try. Figures (including time to restore) go to stdout (`pytest -s`);
no timing is asserted.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from shared.store.connection import resilient_redis
from shared.store.registry import read_session
from shared.store.schema import KeySchema
from tests.system.gateway.faults import Streamer, fault_stack, kill_busiest_worker, tally
from tests.system.gateway.reference import PendingReferences

SEEDS = tuple(range(24, 32))
TURNS = 50
KILL_AT = 20


def test_worker_killed_mid_stream_costs_no_turn(tmp_path: Path, references: PendingReferences) -> None:
    expected = {seed: references.get(seed, TURNS) for seed in SEEDS}
    with fault_stack(tmp_path) as (server, stack, prefix):

        async def body() -> None:
            redis = resilient_redis(server.url)
            schema = KeySchema(prefix)
            try:
                streamers = [await Streamer.open(stack.realtime_url(seed % 2), seed, TURNS) for seed in SEEDS]
                receivers = [asyncio.create_task(s.receive()) for s in streamers]
                await asyncio.gather(*(s.send_until(KILL_AT) for s in streamers))
                kill = await kill_busiest_worker(stack, streamers, redis, schema, TURNS)
                victim, moved, in_flight, killed = kill.victim, kill.moved, kill.in_flight, kill.killed_at
                await asyncio.wait_for(asyncio.gather(*receivers), 120)
                result = tally(streamers, expected)
                print(result.line("worker SIGKILL"))
                restore_s = [s.restored[0] - killed for s in moved if s.restored]
                print(
                    f"[fault] victim {victim}: {len(moved)} sessions moved, {in_flight} chunks "
                    f"unanswered at the kill; time to restore max {max(restore_s, default=0):.3f} s, "
                    f"each {[round(t, 3) for t in sorted(restore_s)]}"
                )
                assert (result.continued, result.lost, result.duplicated) == (len(SEEDS), 0, 0), result
                assert result.identical == len(SEEDS), result
                assert result.restored == len(moved) == len(restore_s), result
                for s in moved:
                    record = await read_session(redis, schema, s.session_id)
                    assert record is not None and record.worker != victim
            finally:
                await redis.aclose()

        asyncio.run(asyncio.wait_for(body(), 180))
        logs = [g.log_path.read_text(errors="replace") for g in stack.gateways]
        failed_tries = sum(log.count("restore of") for log in logs)
        tails = [int(n) for log in logs for n in re.findall(r"restoring with (\d+) undurable", log)]
        print(f"[fault] undurable chunks handed to the restoring worker, per session: {tails}")
        print(f"[fault] restore attempts that picked a dead worker: {failed_tries}")
        assert failed_tries == 0
