"""Rebalance (worker/server/rebalance.py): real processes on loopback, the tiny model, greedy.

Eight sessions open on the only worker, w0 (`--rebalance-gap 2`), and stream chunks through two
gateways; a second worker, w1, starts while they stream, as the worker restarted last in a rolling
restart does. What must hold: w0 moves half its sessions to w1, each by its KV copy (no rebuild
from the log), and none back; every chunk is answered exactly once, every output equals the same
chunks run on an engine that never moved the session, no session ends. And when w0 is drained in
the middle of that round, the round ends, the drain moves every session left, and the same holds.
Timings are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shared.client.clients import RealtimeClient
from tests.conftest import Servers
from tests.system.gateway import test_fault_handover as handover
from tests.system.gateway.conftest import GATEWAY_FLAGS, WORKER_FLAGS
from tests.system.gateway.stack import Stack, running_stack
from tests.wait import await_until
from worker.engine import Engine

SESSIONS, CHUNK, OUT = 8, 16, 2
PERIOD_S: Final = 0.1
MAX_UNANSWERED: Final = 4
VOCAB: Final = 256  # the tiny model's token ids used here
# The heartbeat in WORKER_FLAGS is 0.5 s: a round every 1 s weighs loads at most two beats old.
REBALANCE = ["--rebalance-gap", "2", "--rebalance-period-s", "1"]
MOVED_LINE = re.compile(r"rebalance: (\d+) of (\d+) session\(s\) moved to (\w+)")


def chunk(session: int, seq: int) -> list[int]:
    rng = random.Random(f"{session}:{seq}")
    return [rng.randrange(1, VOCAB) for _ in range(CHUNK)]


@dataclass
class Stream(handover.Stream):
    """One session streaming its own chunks until told to stop (the drain tests' stream, counted the
    same way)."""

    session: int = 0

    async def stream_until(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            while self.sent - len(self.dones) >= MAX_UNANSWERED:
                self.answered.clear()
                await asyncio.wait_for(self.answered.wait(), 60)
            self.sent += 1
            self.sent_at[self.sent] = time.monotonic()
            await self.client.send_chunk(
                self.sent, tokens=chunk(self.session, self.sent), max_output_tokens=OUT
            )
            await asyncio.sleep(PERIOD_S)

    async def receive_until_cancelled(self) -> None:
        """Until cancelled (every chunk answered), the session closed, or a fatal error."""
        while self.take(await self.client.recv(timeout=60)):
            pass


def reference(session: int, turns: int) -> list[tuple[int, ...]]:
    """The session's outputs on an engine that never moved it."""
    with Engine.load("tiny", kv_tokens=8192) as engine:
        sid = engine.open_session(max_output_tokens=OUT, stop_token_ids=())
        return [
            engine.run_turn(sid, tokens=chunk(session, seq), timeout=60).tokens for seq in range(1, turns + 1)
        ]


async def stream_while_w1_starts(stack: Stack, *, drain_w0_mid_round: bool = False) -> list[Stream]:
    """Stream every session on w0, start w1, stream on while w0 moves half of them there; with
    `drain_w0_mid_round`, SIGTERM w0 once its round switched its first session (its exit code
    asserted 0)."""
    streams = []
    for session in range(SESSIONS):
        client = await RealtimeClient.connect(stack.realtime_url(session % 2))
        await client.open(max_output_tokens=OUT, stop_token_ids=[])
        streams.append(Stream(client, [], session=session))
    stop = asyncio.Event()
    receivers = [asyncio.create_task(s.receive_until_cancelled()) for s in streams]
    senders = asyncio.gather(*(s.stream_until(stop) for s in streams))
    await asyncio.sleep(1.0)  # every session has history on w0 before w1 exists
    started = time.monotonic()
    await asyncio.to_thread(stack.start_worker, "w1")
    w0 = stack.workers["w0"]
    if drain_w0_mid_round:
        await await_until(
            lambda: "rebalance: session" in w0.log_path.read_text(errors="replace"), 60, "w0's first switch"
        )
        w0.popen.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(w0.popen.wait, 60)
        assert code == 0, w0.log_path.read_text(errors="replace")[-3000:]
    else:
        await await_until(
            lambda: (
                handover.metric(stack, "w0", "microturn_worker_sessions_rebalanced_total") >= SESSIONS // 2
            ),
            60,
            "w0 moving half its sessions to w1",
        )
    print(f"[rebalance] moves done {time.monotonic() - started:.2f} s after w1's start")
    await asyncio.sleep(2.0)  # both workers serve; a second round would move sessions again now
    stop.set()
    await senders
    await await_until(
        lambda: all(len(s.dones) >= s.sent or r.done() for s, r in zip(streams, receivers, strict=True)),
        120,
        "every chunk sent answered",
    )
    for receiver in receivers:
        receiver.cancel()
    await asyncio.gather(*receivers, return_exceptions=True)
    for s in streams:
        await s.client.close()
    return streams


@contextlib.contextmanager
def one_worker_stack(servers: Servers, tmp_path: Path) -> Iterator[Stack]:
    """w0 alone (rebalancing) and two gateways; the tests start w1."""
    with running_stack(
        servers.redis("redis"),
        f"rb{random.randrange(10**9)}",
        tmp_path,
        workers=1,
        gateways=2,
        worker_flags=[*WORKER_FLAGS, *REBALANCE],
        gateway_flags=GATEWAY_FLAGS,
    ) as stack:
        yield stack


def test_a_worker_moves_half_its_sessions_to_a_new_peer_by_copy_and_no_turn_is_lost(
    servers: Servers, tmp_path: Path
) -> None:
    with one_worker_stack(servers, tmp_path) as stack:
        streams = asyncio.run(stream_while_w1_starts(stack))
        log = stack.workers["w0"].log_path.read_text(errors="replace")
        moved = handover.metric(stack, "w0", "microturn_worker_sessions_rebalanced_total")
        adopted = handover.metric(stack, "w1", "microturn_worker_warm_adopted_total")
        from_pages = handover.metric(stack, "w1", "microturn_worker_warm_from_pages_total")
        rebuilt = handover.metric(stack, "w1", "microturn_worker_warm_rebuilds_total")
        moved_back = handover.metric(stack, "w1", "microturn_worker_sessions_rebalanced_total")
    # Half moved, each onto its KV copy; one round, and none moved back.
    assert (moved, adopted, from_pages, rebuilt, moved_back) == (
        SESSIONS // 2,
        SESSIONS // 2,
        SESSIONS // 2,
        0,
        0,
    )
    assert MOVED_LINE.findall(log) == [(str(SESSIONS // 2), str(SESSIONS // 2), "w1")], log[-3000:]
    assert_exactly_once(streams)


def test_a_drain_during_a_round_ends_it_and_every_session_still_moves_exactly_once(
    servers: Servers, tmp_path: Path
) -> None:
    with one_worker_stack(servers, tmp_path) as stack:
        streams = asyncio.run(stream_while_w1_starts(stack, drain_w0_mid_round=True))
        log = stack.workers["w0"].log_path.read_text(errors="replace")
    # The round ended (its line says how many of the sessions it took it moved), then the drain
    # moved every session left: none stayed on w0, none was lost, repeated or changed.
    (moved, taken, target), *_ = MOVED_LINE.findall(log)
    drain = handover.switch_report(log)
    print(f"[rebalance] the round moved {moved} of {taken}, then the drain {drain}")
    assert target == "w1" and int(moved) + drain.switched + drain.left == SESSIONS, log[-3000:]
    assert_exactly_once(streams)


def assert_exactly_once(streams: list[Stream]) -> None:
    """Every chunk answered once, its output the uninterrupted engine's, no session ended."""
    for s in streams:
        assert s.closed is None and not [e for e in s.errors if e.fatal], (s.session, s.errors)
        assert all(len(s.dones.get(seq, [])) == 1 for seq in range(1, s.sent + 1)), s.session  # exactly once
        assert [s.dones[seq][0].tokens for seq in range(1, s.sent + 1)] == reference(s.session, s.sent), (
            s.session
        )
    waits = sorted(w for s in streams for w in s.waits)
    print(
        f"[rebalance] {sum(s.sent for s in streams)} chunks; longest wait {waits[-1] * 1000:.0f} ms, "
        f"p50 {waits[len(waits) // 2] * 1000:.0f} ms; sessions restored: {sum(s.restored for s in streams)}"
    )
