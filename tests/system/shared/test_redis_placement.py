"""Placement, registry and session records against real Redis 7 and Valkey 9 servers.

Each test runs on both servers (the module-scoped `server_url` fixture starts each once) under its
own key prefix, so tests cannot see each other's keys. pytest-asyncio is not a dependency: each test
drives its coroutine with `asyncio.run`, on a client created inside that loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
from redis.asyncio import Redis

from shared.errors import CapacityExhausted
from shared.store.log_format import NO_SEQ, LogState, decode_tokens, encode_tokens
from shared.store.models import ModelCard, read_model, served_models, write_model
from shared.store.placement import place_script_source, place_session
from shared.store.prefix_label import prefix_label
from shared.store.registry import (
    Placement,
    SessionRecord,
    WorkerInfo,
    delete_session,
    deregister,
    heartbeat,
    load_score,
    mark_draining,
    new_resume_token,
    read_session,
    read_worker,
    register_worker,
    touch_sessions,
    verify_token,
    write_session,
)
from shared.store.schema import STATE_DRAINING, KeySchema
from shared.store.values import sha256_hex
from tests.conftest import open_servers
from tests.shared.redis_servers import SERVER_KINDS
from tests.wait import await_until
from worker.server.token_log import TokenLogWriter, read_log, read_log_state
from worker.tokenizer.incremental import EMPTY_TAIL

T = TypeVar("T")
LONG_TTL_S = 300.0


@pytest.fixture(scope="module", params=SERVER_KINDS)
def server_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with open_servers(tmp_path_factory) as servers:
        yield servers.redis(request.param)


@pytest.fixture
def schema() -> KeySchema:
    return KeySchema(prefix=f"t{uuid.uuid4().hex[:12]}")


def run(url: str, body: Callable[[Redis], Awaitable[T]]) -> T:
    async def main() -> T:
        client = Redis.from_url(url)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def worker(wid: str, *, sessions: int = 0, max_sessions: int = 10, state: str = "ready") -> WorkerInfo:
    return WorkerInfo(
        worker_id=wid,
        url=f"ws://{wid}.test:9000/v1/link",
        model="tiny",
        max_sessions=max_sessions,
        sessions=sessions,
        kv_tokens_free=1000,
        kv_tokens_total=4096,
        state=state,
    )


async def hash_sessions(r: Redis, schema: KeySchema, wid: str) -> int:
    value = await r.hget(schema.worker(wid), "sessions")
    assert value is not None
    return int(value)


# --- pure helpers (no server) ------------------------------------------------------------------


def test_key_schema_names_and_hash_tag() -> None:
    keys = KeySchema()
    assert keys.workers() == "{mt}:workers"
    assert keys.worker("w1") == "{mt}:worker:w1"
    assert keys.worker("w1").startswith(keys.worker_prefix())
    assert keys.session("s1") == "mt:session:{s1}"
    assert keys.log("s1") == "mt:log:{s1}"
    assert KeySchema("prod").workers() == "{prod}:workers"
    for bad in ("", "a{b", "a}b", "a b"):
        with pytest.raises(ValueError):
            KeySchema(bad)


def test_token_codec_is_little_endian_uint32() -> None:
    tokens = [0, 1, 255, 65535, 65536, 70000, 2**31, 2**32 - 1]
    data = encode_tokens(tokens)
    assert len(data) == 4 * len(tokens)
    assert data[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert data[16:20] == b"\x00\x00\x01\x00"  # 65536, least significant byte first
    assert decode_tokens(data) == tokens
    assert encode_tokens([]) == b""
    assert decode_tokens(b"") == []
    for bad in ([-1], [2**32], [1, 2**40]):
        with pytest.raises(ValueError):
            encode_tokens(bad)
    with pytest.raises(ValueError):
        decode_tokens(b"\x00\x00\x00")


def test_resume_tokens() -> None:
    token = new_resume_token()
    assert len(token) >= 40 and token != new_resume_token()
    stored = sha256_hex(token)
    assert len(stored) == 64 and token not in stored
    assert verify_token(token, stored)
    assert not verify_token(token + "x", stored)
    assert not verify_token(new_resume_token(), stored)
    assert not verify_token(token, "")
    assert not verify_token(token, "é" * 64)  # garbage read back from Redis is refused, not an exception


def test_place_script_ships_with_the_package() -> None:
    assert "ZREM" in place_script_source() and "HINCRBY" in place_script_source()


# --- placement ---------------------------------------------------------------------------------


def test_places_on_least_loaded_ready_worker_and_charges_it(server_url: str, schema: KeySchema) -> None:
    async def body(r: Redis) -> None:
        await register_worker(r, schema, worker("a", sessions=5, max_sessions=10), LONG_TTL_S)  # 0.5
        await register_worker(r, schema, worker("b", sessions=1, max_sessions=3), LONG_TTL_S)  # 0.333
        await register_worker(r, schema, worker("c", sessions=2, max_sessions=3), LONG_TTL_S)  # 0.667
        await register_worker(r, schema, worker("d", max_sessions=7, state=STATE_DRAINING), LONG_TTL_S)

        first = await place_session(r, schema)
        assert first == Placement(worker_id="b", url="ws://b.test:9000/v1/link")
        assert await hash_sessions(r, schema, "b") == 2
        # The script's charge computes the same score as the worker's heartbeat would, bit for bit.
        assert await r.zscore(schema.workers(), "b") == load_score(2, 3)

        # b is now at 2/3; a (0.5) is the least loaded; d (score 0) stays skipped while draining.
        second = await place_session(r, schema)
        assert second.worker_id == "a"
        assert await hash_sessions(r, schema, "a") == 6
        assert await hash_sessions(r, schema, "d") == 0

    run(server_url, body)


def test_concurrent_placements_spread_over_workers(server_url: str, schema: KeySchema) -> None:
    async def body(r: Redis) -> None:
        for wid in ("w0", "w1", "w2"):
            await register_worker(r, schema, worker(wid, max_sessions=4), LONG_TTL_S)
        picks = await asyncio.gather(*(place_session(r, schema) for _ in range(9)))
        # Without the charge, all nine would land on whichever worker looked idlest.
        assert Counter(p.worker_id for p in picks) == {"w0": 3, "w1": 3, "w2": 3}
        for wid in ("w0", "w1", "w2"):
            assert await hash_sessions(r, schema, wid) == 3
        more = await asyncio.gather(*(place_session(r, schema) for _ in range(3)))
        assert Counter(p.worker_id for p in more) == {"w0": 1, "w1": 1, "w2": 1}
        with pytest.raises(CapacityExhausted):
            await place_session(r, schema)

    run(server_url, body)


def test_draining_and_full_workers_are_skipped(server_url: str, schema: KeySchema) -> None:
    async def body(r: Redis) -> None:
        await register_worker(r, schema, worker("idle-draining", state=STATE_DRAINING), LONG_TTL_S)
        await register_worker(r, schema, worker("full", sessions=2, max_sessions=2), LONG_TTL_S)
        await register_worker(r, schema, worker("busy", sessions=8, max_sessions=10), LONG_TTL_S)
        assert (await place_session(r, schema)).worker_id == "busy"
        assert (await place_session(r, schema)).worker_id == "busy"
        with pytest.raises(CapacityExhausted) as info:
            await place_session(r, schema, retry_after_ms=750)
        assert info.value.retry_after_ms == 750
        assert await hash_sessions(r, schema, "busy") == 10
        assert await hash_sessions(r, schema, "full") == 2
        assert await hash_sessions(r, schema, "idle-draining") == 0

    run(server_url, body)


def test_empty_registry_is_capacity_exhausted_with_retry_hint(server_url: str, schema: KeySchema) -> None:
    async def body(r: Redis) -> None:
        with pytest.raises(CapacityExhausted) as info:
            await place_session(r, schema)
        assert info.value.retry_after_ms is not None and info.value.retry_after_ms > 0
        assert info.value.code == "capacity_exhausted"

    run(server_url, body)


def test_mark_draining_stops_placement_and_never_creates_a_hash(server_url: str, schema: KeySchema) -> None:
    async def body(r: Redis) -> None:
        await register_worker(r, schema, worker("a"), LONG_TTL_S)
        await register_worker(r, schema, worker("b", sessions=5), LONG_TTL_S)
        assert await mark_draining(r, schema, "a")
        assert (await place_session(r, schema)).worker_id == "b"
        info = await read_worker(r, schema, "a")
        assert info is not None and info.state == STATE_DRAINING
        assert await r.pttl(schema.worker("a")) > 0  # still expires: HSET did not drop the TTL

        assert not await mark_draining(r, schema, "ghost")
        assert await r.exists(schema.worker("ghost")) == 0

    run(server_url, body)


def test_expired_worker_is_dropped_and_never_picked(server_url: str, schema: KeySchema) -> None:
    async def body(r: Redis) -> None:
        await register_worker(r, schema, worker("short", max_sessions=10), 0.3)
        await register_worker(r, schema, worker("long", sessions=2, max_sessions=4), LONG_TTL_S)
        # While alive, the short-lived worker is the least loaded and wins.
        assert (await place_session(r, schema)).worker_id == "short"

        async def expired() -> bool:
            return not await r.exists(schema.worker("short"))

        await await_until(expired, 5.0, "the short-lived worker's hash to expire")
        assert await r.zscore(schema.workers(), "short") is not None  # only placement cleans the ZSET

        assert (await place_session(r, schema)).worker_id == "long"
        assert await r.zscore(schema.workers(), "short") is None
        assert await r.exists(schema.worker("short")) == 0  # the charge did not recreate the hash
        assert (await place_session(r, schema)).worker_id == "long"
        with pytest.raises(CapacityExhausted):
            await place_session(r, schema)

    run(server_url, body)


def test_stale_heartbeat_is_skipped_only_when_asked(server_url: str, schema: KeySchema) -> None:
    async def body(r: Redis) -> None:
        await register_worker(r, schema, worker("stale"), LONG_TTL_S)
        await register_worker(r, schema, worker("fresh", sessions=5), LONG_TTL_S)
        an_hour_ago = time.time_ns() // 1_000_000 - 3_600_000
        await r.hset(schema.worker("stale"), "heartbeat_ms", an_hour_ago)
        assert (await place_session(r, schema, max_heartbeat_age_ms=60_000)).worker_id == "fresh"
        assert await r.zscore(schema.workers(), "stale") is not None  # skipped, not removed
        assert (await place_session(r, schema)).worker_id == "stale"  # the TTL alone says alive

    run(server_url, body)


# --- worker registry ---------------------------------------------------------------------------


def test_register_heartbeat_deregister(server_url: str, schema: KeySchema) -> None:
    async def body(r: Redis) -> None:
        info = worker("w", sessions=1, max_sessions=4)
        await register_worker(r, schema, info, 30.0)
        assert await read_worker(r, schema, "w") == info
        assert 0 < await r.pttl(schema.worker("w")) <= 30_000
        assert await r.zscore(schema.workers(), "w") == 0.25
        heartbeat_ms = await r.hget(schema.worker("w"), "heartbeat_ms")
        assert heartbeat_ms is not None and abs(int(heartbeat_ms) - time.time() * 1000) < 60_000

        await place_session(r, schema)
        await place_session(r, schema)
        assert await r.zscore(schema.workers(), "w") == 0.75
        # The worker's heartbeat is the truth: it overwrites placement's charges.
        await heartbeat(r, schema, worker("w", sessions=2, max_sessions=4), LONG_TTL_S)
        assert await hash_sessions(r, schema, "w") == 2
        assert await r.zscore(schema.workers(), "w") == 0.5
        assert await r.pttl(schema.worker("w")) > 30_000  # refreshed to the new TTL

        await deregister(r, schema, "w")
        assert await r.exists(schema.worker("w")) == 0
        assert await r.zscore(schema.workers(), "w") is None
        assert await read_worker(r, schema, "w") is None

    run(server_url, body)


# --- sessions ----------------------------------------------------------------------------------


async def append_turn(
    r: Redis, schema: KeySchema, sid: str, tokens: list[int], ttl_s: float, *, seq: int = NO_SEQ
) -> None:
    """Append one turn's record the way the worker does: its batched log writer, flushed at once,
    started from the log Redis holds (as a worker restoring the session)."""
    writer = TokenLogWriter(r, schema, grace_s=0.0, worker_id="w")
    writer.start(sid, await r.get(schema.log(sid)) or b"", None)
    writer.append(sid, seq, tuple(tokens), (), ttl_s, tail=EMPTY_TAIL)
    assert await writer.flush()


def test_session_record_round_trip(server_url: str, schema: KeySchema) -> None:
    async def body(r: Redis) -> None:
        token = new_resume_token()
        record = SessionRecord(
            worker="w1",
            token_sha256=sha256_hex(token),
            model="smollm2-135m",
            created_ms=1_760_000_000_123,
            config={"temperature": 0.7, "stop": ["\n"], "nested": {"top_k": 40}, "label": "héllo"},
        )
        await write_session(r, schema, "s1", record, LONG_TTL_S)
        back = await read_session(r, schema, "s1")
        assert back == record
        assert back is not None and verify_token(token, back.token_sha256)
        assert not verify_token(new_resume_token(), back.token_sha256)
        assert await r.hget(schema.session("s1"), "token_sha256") != token.encode()  # never the secret
        assert await read_session(r, schema, "nope") is None

        moved = dataclasses.replace(record, worker="w2")
        await write_session(r, schema, "s1", moved, LONG_TTL_S)
        assert await read_session(r, schema, "s1") == moved

        # A hash written by an older version also holds `last_seq`: it still reads, the field ignored.
        await r.hset(
            schema.session("old"), mapping={**await r.hgetall(schema.session("s1")), "last_seq": "0"}
        )
        assert await read_session(r, schema, "old") == moved
        assert b"last_seq" not in await r.hgetall(schema.session("s1"))

    run(server_url, body)


def test_token_log_appends_and_reads_back(server_url: str, schema: KeySchema) -> None:
    turns = [[1, 2, 3], [65535, 65536, 70000], [2**32 - 1], [], [0, 42]]

    async def body(r: Redis) -> None:
        assert await read_log(r, schema, "s") == []
        expected: list[int] = []
        for seq, turn in enumerate(turns, start=1):
            expected += turn
            await append_turn(r, schema, "s", turn, LONG_TTL_S, seq=seq)
            assert len(await read_log(r, schema, "s")) == len(expected)
        assert await read_log(r, schema, "s") == expected
        assert (await read_log_state(r, schema, "s")).durable_seq == len(turns)
        # The layout (docs/failover.md): per turn a header (n <u4, seq <i8, n_inputs <u4, tail and
        # context byte lengths <u4), then the tokens <u4, then the tail's text (none here).
        raw = await r.get(schema.log("s"))

        def record(seq: int, t: list[int]) -> bytes:
            n = len(t).to_bytes(4, "little")
            return n + seq.to_bytes(8, "little") + n + bytes(8) + encode_tokens(t)

        assert raw == b"".join(record(seq, t) for seq, t in enumerate(turns, start=1))
        with pytest.raises(ValueError):
            await append_turn(r, schema, "s", [2**32], LONG_TTL_S, seq=len(turns) + 1)
        assert await read_log(r, schema, "s") == expected  # a refused append wrote nothing
        # A turn appended twice (a retried flush) is read once; its seq tells the log where it ends.
        await append_turn(r, schema, "s", turns[-1], LONG_TTL_S, seq=len(turns))
        assert await read_log_state(r, schema, "s") == LogState(expected, len(turns))

    run(server_url, body)


def test_session_ttls_are_set_and_touch_refreshes_them(server_url: str, schema: KeySchema) -> None:
    record = SessionRecord(worker="w", token_sha256=sha256_hex("t"), model="tiny", created_ms=1)

    async def body(r: Redis) -> None:
        for sid in ("s1", "s2"):
            await write_session(r, schema, sid, record, 20.0)
            await append_turn(r, schema, sid, [1, 2], 20.0)
            for key in (schema.session(sid), schema.log(sid)):
                assert 0 < await r.pttl(key) <= 20_000
        missing = await touch_sessions(r, schema, ["s1", "s2", "gone"], 600.0)
        assert missing == ["gone"]
        for sid in ("s1", "s2"):
            for key in (schema.session(sid), schema.log(sid)):
                assert await r.pttl(key) > 20_000  # only the touch can have lifted it past 20 s
        assert await r.exists(schema.session("gone"), schema.log("gone")) == 0  # touch creates nothing
        assert await touch_sessions(r, schema, [], 600.0) == []
        with pytest.raises(ValueError):
            await touch_sessions(r, schema, ["s1"], 0.0)  # PEXPIRE 0 would delete, not refresh

    run(server_url, body)


def test_delete_session_removes_both_keys(server_url: str, schema: KeySchema) -> None:
    record = SessionRecord(worker="w", token_sha256=sha256_hex("t"), model="tiny", created_ms=1)

    async def body(r: Redis) -> None:
        await write_session(r, schema, "s", record, LONG_TTL_S)
        await append_turn(r, schema, "s", [5, 6, 7], LONG_TTL_S)
        await write_session(r, schema, "other", record, LONG_TTL_S)
        assert await delete_session(r, schema, "s")
        assert await r.exists(schema.session("s")) == 0
        assert await r.exists(schema.log("s")) == 0
        assert await read_session(r, schema, "s") is None and await read_log(r, schema, "s") == []
        assert await read_session(r, schema, "other") == record  # nothing else touched
        assert not await delete_session(r, schema, "s")

    run(server_url, body)


def test_placement_with_a_model_picks_only_its_workers(server_url: str, schema: KeySchema) -> None:
    async def body(r: Redis) -> None:
        await register_worker(r, schema, dataclasses.replace(worker("idle-other"), model="other"), LONG_TTL_S)
        await register_worker(
            r, schema, dataclasses.replace(worker("busy-mine", sessions=3), model="mine"), LONG_TTL_S
        )
        await register_worker(
            r,
            schema,
            dataclasses.replace(worker("draining-mine", state=STATE_DRAINING), model="mine"),
            LONG_TTL_S,
        )
        assert (await place_session(r, schema, model="mine")).worker_id == "busy-mine"
        assert (await place_session(r, schema)).worker_id == "idle-other"  # no model: any worker
        with pytest.raises(CapacityExhausted, match="'absent'"):
            await place_session(r, schema, model="absent")
        assert await served_models(r, schema) == ["mine", "other"]  # ready workers only: both serve
        await write_model(r, schema, ModelCard("mine", "{{ messages }}", "", "<e>", (7, 9)))
        assert await read_model(r, schema, "mine") == ModelCard("mine", "{{ messages }}", "", "<e>", (7, 9))
        assert await read_model(r, schema, "absent") is None

    run(server_url, body)


def test_placement_prefers_a_worker_with_room_that_holds_the_prefix(
    server_url: str, schema: KeySchema
) -> None:
    async def body(r: Redis) -> None:
        label = prefix_label("You are the booking assistant of Example Air.")
        await register_worker(r, schema, worker("idle"), LONG_TTL_S)
        holder = dataclasses.replace(worker("holder", sessions=8), prefixes=("0123456789abcdef", label))
        await register_worker(r, schema, holder, LONG_TTL_S)
        assert (await read_worker(r, schema, "holder")) == holder  # published and read back whole
        # The holder is busier, but has room: the session maps the prefix there.
        assert (await place_session(r, schema, prefix=label)).worker_id == "holder"
        # Without a prefix, or with one nobody holds, the load rule alone decides.
        assert (await place_session(r, schema)).worker_id == "idle"
        assert (await place_session(r, schema, prefix=prefix_label("another app"))).worker_id == "idle"
        # Full now (10 of 10): never overloaded for its prefix.
        assert await hash_sessions(r, schema, "holder") == 9
        assert (await place_session(r, schema, prefix=label)).worker_id == "holder"
        assert (await place_session(r, schema, prefix=label)).worker_id == "idle"

    run(server_url, body)
