"""A `truncate` session killed mid-stream keeps its window on its next worker (issue #24, point 5).

Real processes on loopback: redis-server, two SmolLM2-135M workers and a gateway. One session with a
small context (192 tokens, 8 kept as its prefix, retention 0.8) streams chunks through the gateway,
up to 4 unanswered, so its window is cut every few turns and its log is compacted (a snapshot plus
the last records) before its worker is SIGKILLed mid-stream. What must hold: the session carries on
on the other worker with every chunk answered exactly once, every output equal to the same chunks
run on an engine that was never interrupted (in this process, same options), the log in Redis then
reads as that engine's window, and its bytes stay within a bound set by the window and the
compaction, not by the number of turns.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

from redis.asyncio import Redis

from shared.client.clients import ConnectionLost, RealtimeClient, SessionClosedError
from shared.protocol.messages import Error, OpenConfig, OutputDone, SessionRestored
from shared.store.log_compaction import records_since_snapshot
from shared.store.registry import read_session
from shared.store.schema import (
    DIRECTIVE_BYTES,
    DIRECTIVE_CUT,
    RECORD_HEADER_BYTES,
    TOKEN_BYTES,
    KeySchema,
    decode_log,
    encode_directive,
    encode_log_record,
)
from tests.conftest import Servers
from tests.system.gateway.conftest import GATEWAY_FLAGS, LINK_SECRET
from tests.system.gateway.stack import stop
from tests.wait import await_until
from worker.engine import Engine, TurnResult
from worker.server.token_log import read_log_bytes, read_log_state

MODEL: Final = "smollm2-135m"
LIMIT, PREFIX, OUT, CHUNK = 192, 8, 4, 12
CONFIG: Final[dict[str, Any]] = {
    "max_output_tokens": OUT,
    "stop_token_ids": [],
    "context_policy": "truncate",
    "max_context_tokens": LIMIT,
    "keep_prefix_tokens": PREFIX,
    "retention_ratio": 0.8,
}
# A compaction keeps 8 records (the worker's default is 64): a short run compacts several times.
KEEP_RECORDS = 8
TURNS = 64
PAUSE_AT = 32  # the log has been compacted by then
WINDOW = 4
ENGINE_OPTIONS: Final[dict[str, Any]] = {"kv_tokens": 1024, "host_kv_tokens": 0}
WORKER_FLAGS = [*LINK_SECRET, "--model", MODEL, "--kv-tokens", "1024", "--host-kv-tokens", "0"]
WORKER_FLAGS += ["--idle-timeout-s", "120", "--heartbeat-s", "0.5", "--log-keep-records", str(KEEP_RECORDS)]


def chunks() -> list[tuple[list[int], int]]:
    """(tokens, max_output_tokens) per seq from 1: every fourth chunk asks for output."""
    rng = random.Random(24)
    return [
        ([rng.randrange(49152) for _ in range(CHUNK)], OUT if seq % 4 == 0 else 0)
        for seq in range(1, TURNS + 1)
    ]


def reference() -> list[TurnResult]:
    """The same chunks on an engine never interrupted, one turn at a time."""
    with Engine.load(MODEL, **ENGINE_OPTIONS) as engine:
        config = {**CONFIG, "stop_token_ids": ()}
        sid = engine.open_session(config=OpenConfig(**config))
        return [
            engine.run_turn(sid, tokens=tokens, seq=seq, max_output_tokens=k, timeout=120)
            for seq, (tokens, k) in enumerate(chunks(), start=1)
        ]


@dataclass
class Stream:
    client: RealtimeClient
    dones: dict[int, list[OutputDone]] = field(default_factory=dict)
    errors: list[Error] = field(default_factory=list)
    restored: int = 0
    sent: int = 0
    _answered: asyncio.Event = field(default_factory=asyncio.Event)

    def unanswered(self) -> int:
        return sum(1 for seq in range(1, self.sent + 1) if seq not in self.dones)

    async def send_until(self, last: int) -> None:
        todo = chunks()
        while self.sent < last:
            while self.unanswered() >= WINDOW:
                self._answered.clear()
                await asyncio.wait_for(self._answered.wait(), 60)
            self.sent += 1
            tokens, k = todo[self.sent - 1]
            await self.client.send_chunk(self.sent, tokens=tokens, max_output_tokens=k)

    async def receive(self) -> None:
        while len(self.dones) < TURNS:
            try:
                msg = await self.client.recv(timeout=60)
            except (ConnectionLost, SessionClosedError):
                return
            if isinstance(msg, OutputDone):
                self.dones.setdefault(msg.seq, []).append(msg)
                self._answered.set()
            elif isinstance(msg, Error):
                self.errors.append(msg)
                self._answered.set()
                if msg.fatal:
                    return
            elif isinstance(msg, SessionRestored):
                self.restored += 1


def logged(results: list[TurnResult]) -> bytes:
    """The log an uninterrupted worker writes for these turns (each cut before its turn)."""
    return b"".join(
        (b"" if r.cut is None else encode_directive(DIRECTIVE_CUT, r.cut))
        + encode_log_record(r.seq, r.inputs + r.tokens, inputs=len(r.inputs))
        for r in results
    )


def test_a_truncated_session_killed_mid_stream_continues_exactly_on_another_worker(servers: Servers) -> None:
    expected: list[TurnResult] = []
    computing = threading.Thread(target=lambda: expected.extend(reference()), daemon=True)
    computing.start()  # while the stack boots
    stack = servers.stack(workers=2, gateways=1, worker_flags=WORKER_FLAGS, gateway_flags=GATEWAY_FLAGS)
    schema = KeySchema(stack.prefix)

    async def body() -> tuple[Stream, bytes, str, str]:
        redis = Redis.from_url(stack.redis_url)
        client = await RealtimeClient.connect(stack.realtime_url(0))
        try:
            opened = await client.open(**CONFIG)
            sid = opened.session_id
            stream = Stream(client)
            receiver = asyncio.create_task(stream.receive())
            await stream.send_until(PAUSE_AT)

            async def compacted() -> bool:
                state = await read_log_state(redis, schema, sid)
                return state.durable_seq is not None and state.durable_seq >= PAUSE_AT - WINDOW

            await await_until(compacted, 60, "the log holds the turns sent so far")
            before = await read_log_bytes(redis, schema, sid)
            assert records_since_snapshot(before) < PAUSE_AT - WINDOW  # compacted
            record = await read_session(redis, schema, sid)
            assert record is not None
            victim = record.worker
            sender = asyncio.create_task(stream.send_until(TURNS))
            await await_until(
                lambda: stream.sent > PAUSE_AT + 2 and stream.unanswered() > 0, 60, "chunks in flight"
            )
            stop(stack.workers[victim], signal.SIGKILL)
            killed_at = time.monotonic()
            await sender
            await asyncio.wait_for(receiver, 120)
            print(f"[fault] every chunk answered {time.monotonic() - killed_at:.2f} s after the kill")

            async def durable() -> bool:
                return (await read_log_state(redis, schema, sid)).durable_seq == TURNS

            await await_until(durable, 30, "every turn durable on the new worker")
            log = await read_log_bytes(redis, schema, sid)
            assert await redis.strlen(schema.log(sid)) == len(log)
            moved = await read_session(redis, schema, sid)
            assert moved is not None
            return stream, log, victim, moved.worker
        finally:
            await client.close()
            await redis.aclose()

    stream, log, victim, now_on = asyncio.run(asyncio.wait_for(body(), 240))
    computing.join(300)
    assert len(expected) == TURNS
    cuts = [r.seq for r in expected if r.cut is not None]
    killed_after = [seq for seq in cuts if seq <= PAUSE_AT]
    assert len(killed_after) >= 4 and len(cuts) > len(killed_after), cuts  # before the kill and after
    assert not stream.errors and stream.restored == 1 and now_on != victim
    counts = Counter({seq: len(stream.dones.get(seq, [])) for seq in range(1, TURNS + 1)})
    assert set(counts.values()) == {1}, counts  # every chunk answered exactly once
    outputs = [list(stream.dones[seq][0].tokens) for seq in range(1, TURNS + 1)]
    assert outputs == [list(r.tokens) for r in expected]
    # The log the restored worker continued reads as the uninterrupted session's window.
    assert decode_log(log).tokens == decode_log(logged(expected)).tokens
    # Bounded by the window and the compaction, whatever the number of turns.
    record_bytes = DIRECTIVE_BYTES + RECORD_HEADER_BYTES + TOKEN_BYTES * (CHUNK + OUT)
    bound = DIRECTIVE_BYTES + RECORD_HEADER_BYTES + TOKEN_BYTES * LIMIT + 2 * KEEP_RECORDS * record_bytes
    whole = len(logged(expected))
    print(f"[fault] {TURNS} turns, {len(cuts)} cuts: {len(log)} bytes logged (bound {bound}, whole {whole})")
    assert records_since_snapshot(log) <= 2 * KEEP_RECORDS
    assert len(log) <= bound < whole // 2
