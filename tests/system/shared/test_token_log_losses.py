"""The token log writer appends only onto the log it confirmed (shared/store/lua/log_append.lua),
against a real redis-server: a log that lost writes or holds a retried append is re-written whole at
the next flush, never appended twice or after a gap, and a log whose session moved to another worker
is left to that worker. (A Redis Cluster failover produces these states: its replica lacks the last
acknowledged writes, and a pipeline that failed on another shard had landed here.)"""

from __future__ import annotations

from redis.asyncio import Redis

from shared.store.log_format import decode_log
from shared.store.schema import KeySchema
from tests.conftest import Servers
from tests.system.shared.test_token_log_compaction import TTL_S, own, record, run, turn
from worker.server.token_log import TokenLogWriter


def _append(writer: TokenLogWriter, seq: int) -> None:
    inputs, outputs, tail, cut = turn(seq)
    writer.append("s", seq, inputs, outputs, TTL_S, tail=tail, cut=cut)


async def _writer_with(
    r: Redis, schema: KeySchema, seqs: tuple[int, ...], owner: str = "w"
) -> TokenLogWriter:
    writer = TokenLogWriter(r, schema, grace_s=0.0, worker_id="w")
    await own(r, schema, "s", owner)
    writer.start("s", b"", None)
    for seq in seqs:
        _append(writer, seq)
        assert await writer.flush()
    return writer


def test_a_log_that_lost_a_record_and_gained_one_as_long_is_rewritten_whole(servers: Servers) -> None:
    async def body(r: Redis, schema: KeySchema) -> None:
        writer = await _writer_with(r, schema, (0, 4))
        assert len(record(4)) == len(record(8))  # the lengths alone cannot tell the logs apart
        # Record 4 lost in a failover; record 8 landed though the flush that sent it failed, which
        # leaves it queued to be sent again.
        await r.set(schema.log("s"), record(0) + record(8))
        _append(writer, 8)
        assert await writer.flush()
        whole = record(0) + record(4) + record(8)
        assert await r.get(schema.log("s")) == whole == writer.held_logs()["s"]
        assert decode_log(whole).durable_seq == 8 and writer.durable_seq("s") == 8
        assert "s" in writer.damaged  # the heartbeat re-writes its record too
        assert 0 < await r.pttl(schema.log("s")) <= TTL_S * 1000

    run(servers.redis(), body)


def test_a_retried_append_that_had_landed_is_not_written_twice(servers: Servers) -> None:
    async def body(r: Redis, schema: KeySchema) -> None:
        writer = await _writer_with(r, schema, (0,))
        await r.append(schema.log("s"), record(1))  # landed; its flush failed all the same
        _append(writer, 1)
        assert await writer.flush()
        assert await r.get(schema.log("s")) == record(0) + record(1) == writer.held_logs()["s"]

    run(servers.redis(), body)


def test_a_log_whose_session_moved_is_left_to_its_new_worker(servers: Servers) -> None:
    async def body(r: Redis, schema: KeySchema) -> None:
        writer = await _writer_with(r, schema, (0,), owner="w")
        await own(r, schema, "s", "other")  # restored on another worker, which writes its log now
        await r.set(schema.log("s"), record(0) + record(1) + record(2))
        _append(writer, 1)
        assert await writer.flush()
        assert await r.get(schema.log("s")) == record(0) + record(1) + record(2)
        assert writer.durable_seq("s") == 0 and writer.held_logs()["s"] == record(0)

    run(servers.redis(), body)
