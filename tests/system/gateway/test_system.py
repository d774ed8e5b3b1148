"""The gateway end to end: real Redis/Valkey, two workers and two gateways as processes on loopback.

Every output is checked against the same stream run alone on the engine (tests/system/gateway/reference.py,
greedy, no early stop), so "works" means "the model saw exactly the tokens it should have, in
order, on one worker", not merely "something came back". pytest-asyncio is not a dependency: each
test drives its coroutine with `asyncio.run`.

No timing assertions here: latency belongs in the benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from shared.client.clients import ConnectionLost, RealtimeClient, SyncRealtimeClient
from shared.errors import CapacityExhausted, ErrorCode, WorkerUnavailable
from shared.protocol.close_codes import close_code_for
from shared.protocol.messages import Error, OutputDone, Pong, SessionClosed, SessionRestored, SessionResume
from shared.store.registry import SessionRecord, WorkerInfo, read_session, register_worker
from shared.store.schema import KeySchema
from tests.shared.redis_servers import free_port
from tests.system.gateway.conftest import LINK_SECRET, LOAD_SESSIONS, LOAD_TURNS, SMALL_SEEDS, SMALL_TURNS
from tests.system.gateway.reference import OUTPUT_TOKENS, SESSION_CONFIG, PendingReferences, stream
from tests.system.gateway.stack import Stack, http_get, stop
from tests.wait import await_until
from worker.server.token_log import read_log_state

T = TypeVar("T")
TEST_TIMEOUT_S = 120.0
TURN_TOKENS = len(stream(0, 1)[0]) + OUTPUT_TOKENS  # what one turn adds to the session's length


def run(stack: Stack, body: Callable[[Redis], Coroutine[Any, Any, T]]) -> T:
    """Run `body(redis)` on a fresh loop, with a Redis client for inspecting the session records."""

    async def main() -> T:
        redis = Redis.from_url(stack.redis_url, decode_responses=False)
        try:
            return await asyncio.wait_for(body(redis), TEST_TIMEOUT_S)
        finally:
            await redis.aclose()

    return asyncio.run(main())


async def record_of(stack: Stack, redis: Redis, sid: str) -> SessionRecord:
    record = await read_session(redis, KeySchema(stack.prefix), sid)
    assert record is not None, f"no session record for {sid}"
    return record


def worker_stats(stack: Stack, worker_id: str) -> dict[str, Any]:
    status, body = http_get(stack.workers[worker_id].http + "/v1/stats")
    assert status == 200, body
    stats: dict[str, Any] = json.loads(body)
    return stats


async def run_turns(
    client: RealtimeClient, seed: int, first: int, last: int, expected: list[list[int]]
) -> None:
    """Turns `first..last` (1-based seqs) of stream `seed`; each output must equal the reference."""
    chunks = stream(seed, last)
    for seq in range(first, last + 1):
        done = await client.turn(seq, tokens=chunks[seq - 1])
        assert list(done.tokens) == expected[seq - 1], f"stream {seed} turn {seq}"


async def expect_error(client: RealtimeClient, code: ErrorCode, *, seq: int | None = None) -> Error:
    """The next message is a recoverable `error` with this code, and the socket still answers."""
    msg = await client.recv(timeout=20)
    assert isinstance(msg, Error), msg
    assert (msg.code, msg.fatal) == (code, False), msg
    if seq is not None:
        assert msg.seq == seq, msg
    assert await client.ping(code.value) == Pong(code.value)  # still open, still served
    return msg


async def expect_fatal(client: RealtimeClient, code: ErrorCode) -> None:
    msg = await client.recv(timeout=20)
    assert isinstance(msg, Error) and (msg.code, msg.fatal) == (code, True), msg
    with pytest.raises(ConnectionLost) as lost:
        await client.recv(timeout=20)
    assert lost.value.code == close_code_for(code)


# ---- placement ----------------------------------------------------------------------------------


def test_new_sessions_spread_over_both_workers_by_load(stack: Stack) -> None:
    async def body(redis: Redis) -> None:
        clients = []
        try:
            for i in range(8):  # one after another through both gateways: placement sees each one
                client = await RealtimeClient.connect(stack.realtime_url(i % 2))
                clients.append(client)
                await client.open(**SESSION_CONFIG)
            placed = Counter([(await record_of(stack, redis, c.session_id or "")).worker for c in clients])
            assert set(placed) == set(stack.worker_ids()), placed
            # Load = the worker's own session count (heartbeat) plus placement's charges: whatever
            # the workers held before, the new sessions went where the load was lower.
            totals = [worker_stats(stack, w)["sessions"] for w in stack.worker_ids()]
            assert max(totals) - min(totals) <= 2, (placed, totals)
        finally:
            for client in clients:
                await client.close()

    run(stack, body)


# ---- HTTP endpoints and the blocking client -----------------------------------------------------


def test_http_endpoints_and_the_sync_client(stack: Stack, references: PendingReferences) -> None:
    gateway = stack.gateways[1]
    assert http_get(gateway.http + "/healthz") == (200, "ok\n")
    assert http_get(gateway.http + "/readyz")[0] == 200
    status, page = http_get(gateway.http + "/")
    assert status == 200 and "<html" in page
    seed = SMALL_SEEDS[7]
    expected = references.get(seed, SMALL_TURNS)
    chunks = stream(seed, 3)
    with SyncRealtimeClient.connect(stack.realtime_url(gateway), "msgpack") as client:
        opened = client.open(**SESSION_CONFIG, stream=True)
        assert opened.model == "tiny" and opened.limits["max_queued_outputs"] == 8
        for seq in (1, 2):
            done = client.turn(seq, tokens=chunks[seq - 1])
            assert list(done.tokens) == expected[seq - 1]
            assert [d.token for d in client.last_deltas] == list(done.tokens)  # streamed, in order
        assert client.ping([1, "a"]) == Pong([1, "a"])
    with SyncRealtimeClient.connect(stack.realtime_url(0)) as client:
        assert client.resume(opened.session_id, opened.resume_token, 2).last_seq == 2
        assert list(client.turn(3, tokens=chunks[2]).tokens) == expected[2]
        assert client.close() == SessionClosed("closed")
    status, text = http_get(gateway.http + "/metrics")
    assert status == 200
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(values["microturn_gateway_chunks_forwarded_total"]) >= 2
    assert float(values["microturn_gateway_link_connects_total"]) >= 1
    assert float(values["microturn_gateway_turn_latency_seconds_count"]) >= 2


# ---- resume -------------------------------------------------------------------------------------


def test_resume_through_the_other_gateway_keeps_worker_and_outputs(
    stack: Stack, references: PendingReferences
) -> None:
    seed = SMALL_SEEDS[0]
    expected = references.get(seed, SMALL_TURNS)

    async def body(redis: Redis) -> None:
        first = await RealtimeClient.connect(stack.realtime_url(0), "msgpack")
        opened = await first.open(**SESSION_CONFIG)
        await run_turns(first, seed, 1, 12, expected)
        worker = (await record_of(stack, redis, opened.session_id)).worker
        await first.disconnect()

        second = await RealtimeClient.connect(stack.realtime_url(1), "json")
        resumed = await second.resume(opened.session_id, opened.resume_token, last_seq=12)
        assert (resumed.length, resumed.last_seq) == (12 * TURN_TOKENS, 12)
        assert (await record_of(stack, redis, opened.session_id)).worker == worker
        await run_turns(second, seed, 13, SMALL_TURNS, expected)
        assert second.buffered == ()  # no replay, no restore: nothing arrived unasked
        assert await second.close() == SessionClosed("closed")
        assert await read_session(redis, KeySchema(stack.prefix), opened.session_id) is None

    run(stack, body)


# ---- concurrency ----------------------------------------------------------------------------------


def test_concurrent_sessions_through_both_gateways_match_their_references(
    stack: Stack, references: PendingReferences
) -> None:
    window = 4  # chunks in flight per session: outputs must still come back once each, in order

    async def session(i: int) -> list[list[int]]:
        client = await RealtimeClient.connect(stack.realtime_url(i % 2), ("json", "msgpack")[i // 2 % 2])
        await client.open(**SESSION_CONFIG)
        chunks = stream(i, LOAD_TURNS)
        outputs: list[list[int]] = []
        sent = 0
        while sent < min(window, LOAD_TURNS):
            sent += 1
            await client.send_chunk(sent, tokens=chunks[sent - 1])
        while len(outputs) < LOAD_TURNS:
            msg = await client.recv(timeout=60)
            assert isinstance(msg, OutputDone), msg
            assert msg.seq == len(outputs) + 1, f"session {i}: got seq {msg.seq}, want {len(outputs) + 1}"
            outputs.append(list(msg.tokens))
            if sent < LOAD_TURNS:
                sent += 1
                await client.send_chunk(sent, tokens=chunks[sent - 1])
        assert await client.close() == SessionClosed("closed")  # and nothing else came in between
        return outputs

    async def body(redis: Redis) -> None:
        results = await asyncio.gather(*(session(i) for i in range(LOAD_SESSIONS)))
        for i, outputs in enumerate(results):
            assert outputs == references.get(i, LOAD_TURNS), f"session {i} diverged from its reference"

    run(stack, body)


# ---- gateway loss -------------------------------------------------------------------------------


def test_killed_gateway_loses_no_session(stack: Stack, references: PendingReferences) -> None:
    seeds = list(SMALL_SEEDS[1:7])
    expected = {seed: references.get(seed, SMALL_TURNS) for seed in seeds}

    async def body(redis: Redis) -> None:
        clients = {seed: await RealtimeClient.connect(stack.realtime_url(0)) for seed in seeds}
        opened = {seed: await clients[seed].open(**SESSION_CONFIG) for seed in seeds}
        workers = {}
        for seed in seeds:
            await run_turns(clients[seed], seed, 1, 8, expected[seed])
            workers[seed] = (await record_of(stack, redis, opened[seed].session_id)).worker
        for seed in seeds:  # turn 9 in flight when the gateway dies
            await clients[seed].send_chunk(9, tokens=stream(seed, 9)[8])
        stop(stack.gateways[0], signal.SIGKILL)

        seen: dict[int, int] = {}
        for seed, client in clients.items():
            seen[seed] = 8
            with pytest.raises(ConnectionLost):
                while True:
                    msg = await client.recv(timeout=20)
                    assert isinstance(msg, OutputDone) and msg.seq == 9, msg
                    assert list(msg.tokens) == expected[seed][8]
                    seen[seed] = 9
        stack.start_gateway(0)

        for n, seed in enumerate(seeds):  # half through the survivor, half through the restarted one
            client = await RealtimeClient.connect(stack.realtime_url(n % 2))
            resumed = await client.resume(opened[seed].session_id, opened[seed].resume_token, seen[seed])
            assert (await record_of(stack, redis, opened[seed].session_id)).worker == workers[seed]
            if seen[seed] == 8 and resumed.last_seq == 9:  # the worker finished it: it is replayed
                done = await client.recv(timeout=20)
                assert isinstance(done, OutputDone) and done.seq == 9, done
                assert list(done.tokens) == expected[seed][8]
            elif resumed.last_seq == 8:  # the chunk died with the gateway before reaching the worker
                await run_turns(client, seed, 9, 9, expected[seed])
            await run_turns(client, seed, 10, 16, expected[seed])
            assert client.buffered == ()
            await client.close()

    run(stack, body)


# ---- errors -------------------------------------------------------------------------------------


TIGHT_FLAGS = [
    "--max-frame-bytes",
    "1024",
    "--max-chunk-tokens",
    "64",
    "--max-chunks-per-s",
    "0.5",
    "--chunk-burst",
    "4",
    "--max-queued-outputs",
    "2",
]


def test_every_error_is_typed_and_recoverable_ones_keep_the_socket(
    stack: Stack, references: PendingReferences
) -> None:
    tight = stack.realtime_url(stack.start_extra_gateway("gateway-tight", [*LINK_SECRET, *TIGHT_FLAGS]))
    empty_prefix = f"{stack.prefix}x"
    nowhere = stack.realtime_url(stack.start_extra_gateway("gateway-nowhere", [], prefix=empty_prefix))
    seed = SMALL_SEEDS[8]
    expected = references.get(seed, SMALL_TURNS)

    async def bystander(stop_flag: asyncio.Event) -> int:
        """A session on the same workers that must not notice anything."""
        async with await RealtimeClient.connect(stack.realtime_url(1)) as client:
            await client.open(**SESSION_CONFIG)
            turns = 0
            while turns < SMALL_TURNS and not (stop_flag.is_set() and turns >= 3):
                turns += 1
                await run_turns(client, seed, turns, turns, expected)
                await asyncio.sleep(0.05)
            assert client.buffered == ()
            await client.close()
            return turns

    async def malformed_and_limits() -> None:
        async with await RealtimeClient.connect(tight) as client:
            await client.send_chunk(1, tokens=[1])  # before any session
            await expect_error(client, ErrorCode.INVALID_MESSAGE, seq=1)
            await client.send_raw('{"type": "session.open", ')
            await expect_error(client, ErrorCode.INVALID_MESSAGE)
            await client.send_raw(b'{"type": "ping"}')  # binary frame on a JSON socket
            await expect_error(client, ErrorCode.INVALID_MESSAGE)
            await client.send_raw('{"type": "session.teleport"}')
            await expect_error(client, ErrorCode.UNKNOWN_TYPE)
            await client.open(**SESSION_CONFIG)
            await client.send_raw('{"type": "input.chunk", "seq": 1, "tokens": [1], "max_output_token": 3}')
            await expect_error(client, ErrorCode.INVALID_MESSAGE)  # a typo is refused, not ignored
            await client.send_chunk(1, tokens=[100] * 300)  # > 1024 bytes
            await expect_error(client, ErrorCode.CHUNK_TOO_LARGE)
            await client.send_chunk(1, tokens=[1] * 65)  # small frame, too many tokens
            await expect_error(client, ErrorCode.CHUNK_TOO_LARGE, seq=1)
            await client.send_chunk(1, tokens=[2**32])  # not even a uint32: the codec refuses it
            await expect_error(client, ErrorCode.TOKEN_OUT_OF_RANGE)
            await client.send_chunk(1, tokens=[-1])  # negative: out of range as well (issue 8)
            await expect_error(client, ErrorCode.TOKEN_OUT_OF_RANGE)
            # Chunks the worker refuses, validated before anything is appended:
            await run_turns(client, seed, 1, 1, expected)
            await client.send_chunk(1, tokens=[5])
            await expect_error(client, ErrorCode.BAD_SEQUENCE, seq=1)
            await client.send_chunk(2, tokens=[1, 512])  # the tiny vocabulary has 512 tokens
            await expect_error(client, ErrorCode.TOKEN_OUT_OF_RANGE, seq=2)
            await run_turns(client, seed, 2, 2, expected)  # the session's KV is untouched
            await client.close()

    async def rate_limit() -> None:
        async with await RealtimeClient.connect(tight, "msgpack") as client:
            await client.open(**SESSION_CONFIG)
            await client.send_raw(b"\xc1")  # never valid msgpack
            await expect_error(client, ErrorCode.INVALID_MESSAGE)
            await client.send_raw("{}")  # text frame on a msgpack socket
            await expect_error(client, ErrorCode.INVALID_MESSAGE)
            await run_turns(client, seed, 1, 4, expected)  # the burst
            await client.send_chunk(5, tokens=stream(seed, 5)[4])
            error = await expect_error(client, ErrorCode.RATE_LIMITED, seq=5)
            assert error.retry_after_ms is not None and error.retry_after_ms > 0
            await asyncio.sleep(error.retry_after_ms / 1000)
            await run_turns(client, seed, 5, 5, expected)
            await client.close()

    async def backpressure() -> None:
        async with await RealtimeClient.connect(tight) as client:
            await client.open(**SESSION_CONFIG)
            chunks = stream(seed, 3)
            await client.send_chunk(1, tokens=chunks[0], max_output_tokens=400)  # long turns
            await client.send_chunk(2, tokens=chunks[1], max_output_tokens=400)
            await client.send_chunk(3, tokens=chunks[2])
            error = await expect_error(client, ErrorCode.BACKPRESSURE, seq=3)
            assert error.retry_after_ms is not None and error.retry_after_ms > 0
            await client.cancel(1)
            await client.cancel(2)
            assert (await client.wait_done(1)).finish == "cancelled"
            assert (await client.wait_done(2)).finish == "cancelled"
            done = await client.turn(3, tokens=chunks[2])
            assert done.finish == "length" and len(done.tokens) == OUTPUT_TOKENS
            await client.close()

    async def context_full() -> None:
        async with await RealtimeClient.connect(stack.realtime_url(0)) as client:
            await client.open(**SESSION_CONFIG, max_context_tokens=16, context_policy="error")
            await run_turns(client, seed, 1, 1, expected)  # 6 of 16 tokens
            await client.send_chunk(2, tokens=[1] * 12)
            await expect_error(client, ErrorCode.CONTEXT_FULL, seq=2)
            await run_turns(client, seed, 2, 2, expected)
            await client.close()

    async def fatal(redis: Redis) -> None:
        async with await RealtimeClient.connect(stack.realtime_url(0)) as owner:
            opened = await owner.open(**SESSION_CONFIG)
            async with await RealtimeClient.connect(stack.realtime_url(1)) as thief:
                await thief.send(SessionResume(opened.session_id, opened.resume_token[::-1]))
                await expect_fatal(thief, ErrorCode.UNAUTHORIZED)
            async with await RealtimeClient.connect(stack.realtime_url(1), "msgpack") as lost:
                await lost.send(SessionResume("f" * 32, opened.resume_token))
                await expect_fatal(lost, ErrorCode.SESSION_NOT_FOUND)
            assert await owner.ping("still mine") == Pong("still mine")  # the attempts changed nothing
            await owner.close()
        with pytest.raises(InvalidStatus) as refused:
            await connect(stack.realtime_url(0), subprotocols=["microturn.v2.xml"])  # type: ignore[list-item]
        assert refused.value.response.status_code == 403

    async def no_workers(redis: Redis) -> None:
        async with await RealtimeClient.connect(nowhere) as client:
            with pytest.raises(CapacityExhausted) as full:
                await client.open(**SESSION_CONFIG)
            assert full.value.retry_after_ms
            assert await client.ping(1) == Pong(1)
            # A registered worker that cannot be reached: the gateway tries, then says so.
            dead = WorkerInfo("ghost", f"ws://127.0.0.1:{free_port()}", "tiny", max_sessions=4)
            await register_worker(redis, KeySchema(empty_prefix), dead, ttl_s=60)
            with pytest.raises(WorkerUnavailable):
                await client.open(**SESSION_CONFIG)
            assert await client.ping(2) == Pong(2)

    async def body(redis: Redis) -> None:
        stop_flag = asyncio.Event()
        watcher = asyncio.create_task(bystander(stop_flag))
        try:
            await asyncio.gather(
                malformed_and_limits(), rate_limit(), backpressure(), context_full(), fatal(redis)
            )
            await no_workers(redis)
        finally:
            stop_flag.set()
        assert await watcher >= 3

    run(stack, body)


# ---- idle timeout -------------------------------------------------------------------------------


def test_idle_timeout_frees_worker_and_redis_and_tells_the_client(
    stack: Stack, references: PendingReferences
) -> None:
    seed = SMALL_SEEDS[9]
    expected = references.get(seed, SMALL_TURNS)

    async def body(redis: Redis) -> None:
        before = {w: worker_stats(stack, w) for w in stack.worker_ids()}
        client = await RealtimeClient.connect(stack.realtime_url(0))
        opened = await client.open(**SESSION_CONFIG, idle_timeout_s=1.5)
        await run_turns(client, seed, 1, 3, expected)
        worker = (await record_of(stack, redis, opened.session_id)).worker
        during = worker_stats(stack, worker)
        assert during["sessions"] == before[worker]["sessions"] + 1
        assert during["pages_free"] < before[worker]["pages_free"]
        schema = KeySchema(stack.prefix)
        keys = (schema.session(opened.session_id), schema.log(opened.session_id))

        async def both_written() -> bool:  # the token log is appended just after the reply
            return bool(await redis.exists(*keys) == 2)

        await await_until(both_written, 10, "the session's record and token log")

        assert await client.recv(timeout=20) == SessionClosed("idle_timeout")
        with pytest.raises(ConnectionLost) as lost:
            await client.recv(timeout=10)
        assert lost.value.code == 1000
        after = worker_stats(stack, worker)
        assert after["sessions"] == before[worker]["sessions"]
        assert after["pages_free"] == before[worker]["pages_free"]

        async def both_gone() -> bool:
            return not await redis.exists(*keys)

        await await_until(both_gone, 5, "the session's Redis keys to go with it")

    run(stack, body)


# ---- worker loss (last: it restarts a worker) ------------------------------------------------------


def test_lost_worker_sessions_are_restored_on_the_other(stack: Stack, references: PendingReferences) -> None:
    seeds = list(SMALL_SEEDS[10:16])
    expected = {seed: references.get(seed, SMALL_TURNS) for seed in seeds}

    async def body(redis: Redis) -> None:
        clients = {seed: await RealtimeClient.connect(stack.realtime_url(seed % 2)) for seed in seeds}
        opened = {seed: await clients[seed].open(**SESSION_CONFIG) for seed in seeds}
        for seed in seeds:
            await run_turns(clients[seed], seed, 1, 10, expected[seed])
        placed = {seed: (await record_of(stack, redis, opened[seed].session_id)).worker for seed in seeds}
        victim = Counter(placed.values()).most_common(1)[0][0]
        moved = [seed for seed in seeds if placed[seed] == victim]
        assert len(moved) >= 2, placed
        # One of the victim's sessions has no client right now: it is restored when it resumes.
        away = moved.pop()
        await clients[away].disconnect()
        away_sid = opened[away].session_id

        async def logged() -> bool:  # the token log holds its last turn (flushed in batches, ~20 ms)
            return (await read_log_state(redis, KeySchema(stack.prefix), away_sid)).durable_seq == 10

        await await_until(logged, 10, "the away session's last turn in the token log")
        stop(stack.workers[victim], signal.SIGKILL)

        length = 10 * TURN_TOKENS
        for seed in moved:  # connected: the gateway restores them on its own and says so
            msg = await clients[seed].recv(timeout=30)
            assert msg == SessionRestored(opened[seed].session_id, length), msg
            assert (await record_of(stack, redis, opened[seed].session_id)).worker != victim
        clients[away] = await RealtimeClient.connect(stack.realtime_url(0))
        resumed = await clients[away].resume(opened[away].session_id, opened[away].resume_token, 10)
        assert (resumed.length, resumed.last_seq) == (length, 10)
        assert await clients[away].recv(timeout=30) == SessionRestored(opened[away].session_id, length)
        assert (await record_of(stack, redis, opened[away].session_id)).worker != victim
        for seed in seeds:  # moved or not, every session carries on with the same outputs
            await run_turns(clients[seed], seed, 11, 16, expected[seed])
            assert clients[seed].buffered == ()
            await clients[seed].close()

    run(stack, body)
