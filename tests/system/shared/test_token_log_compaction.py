"""The worker's token log writer compacts a session's log in Redis (worker/server/token_log.py),
against a real redis-server: the log and the worker's mirror stay byte-equal and bounded, read as the
whole log would, keep their TTL, and a log whose session moved to another worker is never replaced.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
from redis.asyncio import Redis

from shared.store.log_format import DIRECTIVE_CUT, Cut, decode_log, encode_directive, encode_log_record
from shared.store.registry import SessionRecord, write_session
from shared.store.schema import KeySchema
from tests.conftest import Servers
from tests.shared.redis_servers import REDIS_SERVER
from tests.system.gateway.faults import restartable_redis
from tests.wait import await_until
from worker.server.token_log import KEEP_RECORDS, TokenLogWriter
from worker.tokenizer.incremental import TextTail

T = TypeVar("T")
TTL_S = 300.0


def run(url: str, body: Callable[[Redis, KeySchema], Awaitable[T]]) -> T:
    async def main() -> T:
        client = Redis.from_url(url)
        try:
            return await body(client, KeySchema(f"t{uuid.uuid4().hex[:10]}"))
        finally:
            await client.aclose()

    return asyncio.run(main())


async def own(r: Redis, schema: KeySchema, sid: str, worker: str) -> None:
    record = SessionRecord(worker=worker, token_sha256="0" * 64, model="tiny", created_ms=1)
    await write_session(r, schema, sid, record, TTL_S)


def turn(seq: int) -> tuple[tuple[int, ...], tuple[int, ...], TextTail, Cut | None]:
    """Turn `seq` of a session cut every 10 turns to its first 2 tokens and last 6."""
    inputs = tuple(range(seq % 4))  # some turns add nothing: their records are logged too
    cut = Cut(2, 6) if seq % 10 == 9 else None
    return inputs, (seq % 97,), TextTail(f"t{seq}", ""), cut


def record(seq: int) -> bytes:
    inputs, outputs, tail, cut = turn(seq)
    directive = b"" if cut is None else encode_directive(DIRECTIVE_CUT, cut)
    return directive + encode_log_record(seq, inputs + outputs, inputs=len(inputs), tail_text=tail.text)


async def write_turns(writer: TokenLogWriter, sid: str, seqs: range, per_flush: int) -> None:
    for seq in seqs:
        inputs, outputs, tail, cut = turn(seq)
        writer.append(sid, seq, inputs, outputs, TTL_S, tail=tail, cut=cut)
        if seq % per_flush == per_flush - 1:
            assert await writer.flush()
    assert await writer.flush()


def test_a_long_session_s_log_is_compacted_bounded_and_reads_whole(servers: Servers) -> None:
    async def body(r: Redis, schema: KeySchema) -> None:
        writer = TokenLogWriter(r, schema, grace_s=0.0, worker_id="w")
        await own(r, schema, "s", "w")
        writer.start("s", b"", None)
        longest = 0
        for start in range(0, 8 * KEEP_RECORDS, 40):
            await write_turns(writer, "s", range(start, start + 40), per_flush=3)
            stored = await r.get(schema.log("s"))
            assert stored == writer.held_logs()["s"]  # the mirror is what Redis holds, byte for byte
            longest = max(longest, len(stored))
            whole = decode_log(b"".join(record(seq) for seq in range(start + 40)))
            state = decode_log(stored)
            assert (state.tokens, state.durable_seq, state.tail_text) == (
                whole.tokens,
                whole.durable_seq,
                whole.tail_text,
            )
            assert writer.durable_seq("s") == start + 39
        whole_bytes = sum(len(record(seq)) for seq in range(8 * KEEP_RECORDS))
        print(f"[log] {8 * KEEP_RECORDS} turns: {whole_bytes} bytes whole, at most {longest} in Redis")
        assert writer.compactions >= 5
        assert longest < whole_bytes // 3
        assert 0 < await r.pttl(schema.log("s")) <= TTL_S * 1000  # the SET kept a TTL
        assert not writer.damaged

    run(servers.redis(), body)


def test_a_compaction_rewrites_a_log_redis_lost(servers: Servers) -> None:
    async def body(r: Redis, schema: KeySchema) -> None:
        writer = TokenLogWriter(r, schema, grace_s=0.0, worker_id="w")
        await own(r, schema, "s", "w")
        writer.start("s", b"", None)
        await write_turns(writer, "s", range(2 * KEEP_RECORDS), per_flush=2 * KEEP_RECORDS)
        await r.delete(schema.log("s"))  # lost (a failover dropped it)
        await write_turns(writer, "s", range(2 * KEEP_RECORDS, 2 * KEEP_RECORDS + 1), per_flush=1)
        assert writer.compactions == 1
        assert await r.get(schema.log("s")) == writer.held_logs()["s"]
        assert decode_log(writer.held_logs()["s"]).durable_seq == 2 * KEEP_RECORDS
        assert await r.pttl(schema.log("s")) > 0

    run(servers.redis(), body)


def test_a_log_whose_session_moved_is_only_appended_to(servers: Servers) -> None:
    """A worker the gateways gave up on may flush late: its compaction must not replace the log the
    session's new worker writes (the record names that worker), only append as any flush does."""

    async def body(r: Redis, schema: KeySchema) -> None:
        writer = TokenLogWriter(r, schema, grace_s=0.0, worker_id="old")
        await own(r, schema, "s", "old")
        writer.start("s", b"", None)
        await write_turns(writer, "s", range(2 * KEEP_RECORDS), per_flush=2 * KEEP_RECORDS)
        await own(r, schema, "s", "new")
        successor = encode_log_record(10_000, [1, 2, 3])
        await r.append(schema.log("s"), successor)
        before = await r.get(schema.log("s"))
        await write_turns(writer, "s", range(2 * KEEP_RECORDS, 2 * KEEP_RECORDS + 1), per_flush=1)
        assert writer.compactions == 0
        assert await r.get(schema.log("s")) == before + record(2 * KEEP_RECORDS)
        assert decode_log(await r.get(schema.log("s"))).durable_seq == 10_000

    run(servers.redis(), body)


def test_a_compaction_redis_refused_stays_queued_and_a_lost_record_is_found(tmp_path: Path) -> None:
    """Redis dies as a flush would compact: the turns stay queued, in order; it comes back empty, so
    the record no longer names this worker and the flush only appends: the reply, shorter than the
    mirror, marks the log damaged for the heartbeat to re-write (shared/store/held.py)."""
    if shutil.which(REDIS_SERVER) is None:
        pytest.skip(f"{REDIS_SERVER} is not installed")
    with restartable_redis(tmp_path) as server:

        async def body(r: Redis, schema: KeySchema) -> None:
            writer = TokenLogWriter(r, schema, grace_s=0.0, worker_id="w")
            await own(r, schema, "s", "w")
            writer.start("s", b"", None)
            await write_turns(writer, "s", range(2 * KEEP_RECORDS), per_flush=2 * KEEP_RECORDS)
            server.kill()
            first, second = turn(2 * KEEP_RECORDS), turn(2 * KEEP_RECORDS + 1)
            writer.append("s", 2 * KEEP_RECORDS, *first[:2], TTL_S, tail=first[2], cut=first[3])
            assert not await writer.flush()
            server.start()
            writer.append("s", 2 * KEEP_RECORDS + 1, *second[:2], TTL_S, tail=second[2], cut=second[3])
            await await_until(writer.flush, 10, "a flush once Redis is back")
            assert writer.compactions == 0 and writer.damaged == {"s"}
            assert await r.get(schema.log("s")) == record(2 * KEEP_RECORDS) + record(2 * KEEP_RECORDS + 1)
            mirror = writer.held_logs()["s"]
            assert mirror == b"".join(record(seq) for seq in range(2 * KEEP_RECORDS + 2))
            assert writer.durable_seq("s") == 2 * KEEP_RECORDS + 1

        run(server.url, body)


def test_a_flush_that_finds_its_turns_taken_by_another_returns_once_they_are_durable(
    servers: Servers,
) -> None:
    """Two flushes at once (the writer's own task and a switch making the log durable): the one
    that finds nothing queued, because the other took the turns, still answers only once they are
    confirmed, so the `durable_seq` a switch reads right after it names them (it read None before)."""

    async def body(r: Redis, schema: KeySchema) -> None:
        writer = TokenLogWriter(r, schema, grace_s=0.0, worker_id="w")
        await own(r, schema, "s", "w")
        writer.start("s", b"", None)
        inputs, outputs, tail, cut = turn(1)
        writer.append("s", 1, inputs, outputs, TTL_S, tail=tail, cut=cut)
        background = asyncio.create_task(writer.flush())
        await asyncio.sleep(0)  # the background flush has taken the turn and awaits Redis
        assert await writer.flush()
        assert writer.durable_seq("s") == 1
        assert await background

    run(servers.redis(), body)
