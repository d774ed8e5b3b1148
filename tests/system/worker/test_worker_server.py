"""The worker as a real process: link protocol, takeover, restore from the token log, idle timeout, drain."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as redis
import websockets

from shared.errors import ErrorCode
from shared.protocol.link import (
    LinkAttach,
    LinkChunk,
    LinkClose,
    LinkClosed,
    LinkDelta,
    LinkDone,
    LinkError,
    LinkFrame,
    LinkMigrate,
    LinkOpen,
    LinkOpened,
    LinkRestore,
    ToWorker,
)
from shared.protocol.link_codec import decode_link, encode_link
from shared.protocol.messages import InputChunk, OpenConfig, OutputDelta
from shared.store.registry import SessionRecord, read_worker, write_session
from shared.store.schema import KeySchema
from tests.conftest import Servers
from tests.processes import Proc, microturn, worker_args
from tests.wait import await_until
from worker.engine import Engine
from worker.server.token_log import read_log, read_log_state

CONFIG = OpenConfig(stop_token_ids=(), stream=True, logprobs=True)
SCHEMA = KeySchema("mt")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("worker-server")


@pytest.fixture(scope="module")
def redis_url(servers: Servers) -> str:
    return servers.redis("redis")


@pytest.fixture(scope="module")
def worker(redis_url: str, workdir: Path) -> Iterator[Proc]:
    with microturn("worker", worker_args(redis_url, "w-main"), workdir) as process:
        yield process


@pytest.fixture(scope="module")
def reference() -> Iterator[Engine]:
    with Engine.load("tiny", kv_tokens=8192) as engine:
        yield engine


class Link:
    def __init__(self, connection: websockets.ClientConnection) -> None:
        self.connection = connection

    async def send(self, frame: ToWorker) -> None:
        await self.connection.send(encode_link(frame))

    async def recv(self, timeout: float = 20.0) -> LinkFrame:
        return decode_link(await asyncio.wait_for(self.connection.recv(), timeout))

    async def turn(self, chunk: LinkChunk) -> tuple[list[OutputDelta], LinkDone]:
        await self.send(chunk)
        deltas = []
        while True:
            frame = await self.recv()
            if isinstance(frame, LinkDelta):
                deltas.append(frame.delta)
            elif isinstance(frame, LinkDone):
                return deltas, frame
            else:
                raise AssertionError(f"unexpected {frame}")


def link_to(worker: Proc, headers: dict[str, str] | None = None) -> Any:
    return websockets.connect(worker.ws + "/v1/link", additional_headers=headers)


def stats(worker: Proc) -> dict[str, Any]:
    with urllib.request.urlopen(worker.http + "/v1/stats", timeout=5) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def chunk(sid: str, seq: int, tokens: tuple[int, ...], k: int = 3) -> LinkChunk:
    return LinkChunk(sid, InputChunk(seq, tokens, None, k, None))


def test_turns_stream_deltas_and_match_the_engine(worker: Proc, reference: Engine) -> None:
    async def run() -> list[tuple[int, ...]]:
        async with link_to(worker) as connection:
            link = Link(connection)
            await link.send(LinkOpen("t1", CONFIG))
            assert await link.recv() == LinkOpened("t1", 0, None)
            outputs: list[tuple[int, ...]] = []
            for seq in range(1, 6):
                deltas, done = await link.turn(chunk("t1", seq, (seq, seq + 1, seq + 2)))
                assert [d.token for d in deltas] == list(done.done.tokens) and len(done.done.tokens) == 3
                assert "".join(d.text or "" for d in deltas) == done.done.text
                outputs.append(done.done.tokens)
            await link.send(LinkClose("t1"))
            assert await link.recv() == LinkClosed("t1", "closed")
            return outputs

    got = asyncio.run(run())
    sid = reference.open_session(stop_token_ids=())
    want = [
        reference.run_turn(sid, tokens=[s, s + 1, s + 2], max_output_tokens=3).tokens for s in range(1, 6)
    ]
    assert got == want
    assert stats(worker)["sessions"] == 0 and stats(worker)["pages_used"] == 0


def test_a_second_link_takes_over_and_gets_missed_outputs(worker: Proc) -> None:
    async def run() -> None:
        async with link_to(worker) as first, link_to(worker) as second:
            a, b = Link(first), Link(second)
            await a.send(LinkOpen("t2", CONFIG))
            assert isinstance(await a.recv(), LinkOpened)
            await a.turn(chunk("t2", 1, (9, 9)))
            _, done2 = await a.turn(chunk("t2", 2, (8, 8)))
            await b.send(LinkAttach("t2", seen_seq=1))
            opened = await b.recv()
            assert isinstance(opened, LinkOpened)
            # durable_seq: whatever the batched log flush has confirmed by now (docs/failover.md).
            assert opened.durable_seq in (None, 1, 2)
            assert replace(opened, durable_seq=None) == LinkOpened("t2", done2.length, 2)
            assert await b.recv() == done2  # the output after seen_seq is replayed
            assert await a.recv() == LinkClosed("t2", "taken_over")
            _, done3 = await b.turn(chunk("t2", 3, (7,)))
            assert done3.length == done2.length + 1 + 3
            await b.send(LinkClose("t2"))
            assert isinstance(await b.recv(), LinkClosed)

    asyncio.run(run())


def test_restore_rebuilds_from_the_token_log_on_another_worker(
    worker: Proc, redis_url: str, workdir: Path
) -> None:
    async def run(other: Proc) -> None:
        client = redis.from_url(redis_url, decode_responses=False)
        async with link_to(worker) as first, link_to(other) as second:
            a, b = Link(first), Link(second)
            await a.send(LinkOpen("t3", CONFIG))
            await a.recv()
            sequence: list[int] = []
            for seq in range(1, 5):
                _, done = await a.turn(chunk("t3", seq, (seq * 3, seq * 5)))
                sequence += [seq * 3, seq * 5, *done.done.tokens]

            async def logged() -> bool:  # appends are batched after the reply
                return bool(await read_log(client, SCHEMA, "t3") == sequence)

            await await_until(logged, 10, "the four turns in the token log")
            await b.send(LinkRestore("t3", CONFIG, None, seen_seq=4))
            # durable_seq: the log it was rebuilt from holds every turn up to seq 4.
            assert await b.recv() == LinkOpened("t3", len(sequence), 4, 4)
            _, original = await a.turn(chunk("t3", 5, (1, 2)))
            _, rebuilt = await b.turn(chunk("t3", 5, (1, 2)))
            assert rebuilt.done.tokens == original.done.tokens and rebuilt.length == original.length
            for link in (a, b):
                await link.send(LinkClose("t3"))
                assert isinstance(await link.recv(), LinkClosed)
            assert await client.exists(SCHEMA.log("t3")) == 0
        await client.aclose()

    with microturn("worker", worker_args(redis_url, "w-other"), workdir) as other:
        asyncio.run(run(other))


def test_idle_session_is_closed_its_keys_deleted_and_its_pages_freed(worker: Proc, redis_url: str) -> None:
    async def run() -> None:
        client = redis.from_url(redis_url, decode_responses=False)
        record = SessionRecord(worker="w-main", token_sha256="0" * 64, model="tiny", created_ms=0)
        await write_session(client, SCHEMA, "t4", record, 60)
        async with link_to(worker) as connection:
            link = Link(connection)
            await link.send(LinkOpen("t4", OpenConfig(idle_timeout_s=0.5)))
            await link.recv()
            await link.turn(chunk("t4", 1, (1, 2, 3)))
            assert stats(worker)["pages_used"] > 0
            assert await link.recv(timeout=10) == LinkClosed("t4", "idle_timeout")
        assert stats(worker)["sessions"] == 0 and stats(worker)["pages_used"] == 0
        assert await client.exists(SCHEMA.session("t4"), SCHEMA.log("t4")) == 0
        await client.aclose()

    asyncio.run(run())


def test_bad_frames_get_typed_errors_and_the_link_stays_usable(worker: Proc) -> None:
    async def run() -> None:
        async with link_to(worker) as connection:
            link = Link(connection)
            await connection.send(b"\xc1 not msgpack")
            error = await link.recv()
            assert (
                isinstance(error, LinkError)
                and error.error.code == ErrorCode.INVALID_MESSAGE
                and error.sid == ""
            )
            await link.send(LinkOpen("t5", CONFIG))
            await link.recv()
            await link.send(chunk("t5", 1, (10**6,)))
            error = await link.recv()
            assert (
                isinstance(error, LinkError)
                and error.error.code == ErrorCode.TOKEN_OUT_OF_RANGE
                and not error.error.fatal
            )
            await link.send(LinkAttach("no-such-session"))
            error = await link.recv()
            assert isinstance(error, LinkError) and error.error.code == ErrorCode.SESSION_NOT_FOUND
            await link.send(chunk("no-such-session", 3, (1,)))  # answered, never dropped silently
            error = await link.recv()
            assert isinstance(error, LinkError) and error.error.code == ErrorCode.SESSION_NOT_FOUND
            assert error.error.seq == 3 and error.error.fatal
            _, done = await link.turn(chunk("t5", 2, (1,)))
            assert done.length == 4
            await link.send(LinkClose("t5"))
            await link.recv()

    asyncio.run(run())


def test_link_secret_is_required_when_set(redis_url: str, workdir: Path) -> None:
    async def run(worker: Proc) -> None:
        with pytest.raises(websockets.InvalidStatus):
            async with link_to(worker, {"x-microturn-link-secret": "wrong"}):
                pass
        async with link_to(worker, {"x-microturn-link-secret": "s3cret"}) as connection:
            await connection.send(encode_link(LinkOpen("t6", CONFIG)))
            assert isinstance(decode_link(await connection.recv()), LinkOpened)

    args = worker_args(redis_url, "w-secret", "--link-secret", "s3cret")
    with microturn("worker", args, workdir) as worker:
        asyncio.run(run(worker))


def test_sigterm_drains_hands_sessions_over_and_leaves_the_registry(redis_url: str, workdir: Path) -> None:
    """Drain migrates (docs/failover.md): instead of ending each session (`closed: evicted`, the old
    behaviour), the worker makes its log durable and tells the gateway to restore it elsewhere."""

    async def run(worker: Proc) -> None:
        client = redis.from_url(redis_url, decode_responses=False)
        assert await read_worker(client, SCHEMA, "w-drain") is not None
        async with link_to(worker) as connection:
            link = Link(connection)
            await link.send(LinkOpen("t7", CONFIG, (), "0" * 64, 1))
            await link.recv()
            _, done = await link.turn(chunk("t7", 1, (1, 2)))
            worker.popen.send_signal(signal.SIGTERM)
            migrate = await link.recv()
            assert isinstance(migrate, LinkMigrate) and (migrate.sid, migrate.durable_seq) == ("t7", 1)
            # With another worker in the registry (this module's w-main) the session was warmed
            # there first (make before break) and the frame names it; alone, it names none.
            assert migrate.target in (None, "w-main")
            assert await read_log(client, SCHEMA, "t7") == [1, 2, *done.done.tokens]
        assert worker.popen.wait(20) == 0
        assert await read_worker(client, SCHEMA, "w-drain") is None
        assert await client.zscore(SCHEMA.workers(), "w-drain") is None
        await client.aclose()

    with microturn("worker", worker_args(redis_url, "w-drain"), workdir) as worker:
        asyncio.run(run(worker))


def test_a_session_restored_elsewhere_keeps_its_keys_when_this_worker_lets_go(
    worker: Proc, redis_url: str
) -> None:
    """The record names another worker (the session was restored there): expiring here deletes nothing."""

    async def run() -> None:
        client = redis.from_url(redis_url, decode_responses=False)
        record = SessionRecord(worker="w-elsewhere", token_sha256="0" * 64, model="tiny", created_ms=0)
        await write_session(client, SCHEMA, "t8", record, 60)
        async with link_to(worker) as connection:
            link = Link(connection)
            await link.send(LinkOpen("t8", OpenConfig(idle_timeout_s=0.5)))
            await link.recv()
            await link.turn(chunk("t8", 1, (1, 2, 3)))
            assert await link.recv(timeout=10) == LinkClosed("t8", "idle_timeout")
        # `closed` goes out only once the worker's cleanup of the session is done (service.py,
        # `_forget_then_tell`): a wrong delete would have landed before it, so the keys are checked now.
        assert await client.exists(SCHEMA.session("t8"), SCHEMA.log("t8")) == 2
        await client.aclose()

    asyncio.run(run())


def test_a_prefix_given_as_text_is_logged_and_kept_across_cuts_and_a_restore(
    worker: Proc, redis_url: str, workdir: Path, reference: Engine
) -> None:
    """`keep_prefix_text`: the worker opens the session with its tokens (logged as tokens of no
    turn), keeps them at every cut, and a worker restoring it counts the same prefix."""
    from worker.engine.memory.window import resolve_prefix

    config = OpenConfig(
        stop_token_ids=(),
        context_policy="truncate",
        max_context_tokens=64,
        retention_ratio=0.5,
        keep_prefix_text="hello world, be brief",
    )
    engine_config, prefix = resolve_prefix(config, reference.text)
    assert engine_config.keep_prefix_tokens == len(prefix) > 0
    twin = reference.open_session(config=engine_config, history=prefix)

    async def run(other: Proc) -> None:
        client = redis.from_url(redis_url, decode_responses=False)
        async with link_to(worker) as first, link_to(other) as second:
            a, b = Link(first), Link(second)
            await a.send(LinkOpen("t9", config))
            opened = await a.recv()
            assert isinstance(opened, LinkOpened) and opened.length == len(prefix)
            for seq in range(1, 13):
                tokens = tuple((seq * 7 + j) % 200 + 1 for j in range(8))
                _, done = await a.turn(chunk("t9", seq, tokens, k=2))
                expected = reference.run_turn(
                    twin, tokens=list(tokens), seq=seq, max_output_tokens=2, timeout=30
                )
                assert (done.done.tokens, done.length) == (expected.tokens, expected.length)

            async def logged() -> bool:
                return (await read_log_state(client, SCHEMA, "t9")).durable_seq == 12

            await await_until(logged, 10, "the twelve turns in the token log")
            state = await read_log_state(client, SCHEMA, "t9")
            assert state.tokens[: len(prefix)] == prefix and len(state.tokens) == expected.length
            await b.send(LinkRestore("t9", config, None, seen_seq=12))
            assert await b.recv() == LinkOpened("t9", expected.length, 12, 12)
            _, rebuilt = await b.turn(chunk("t9", 13, (1, 2, 3, 4, 5, 6, 7, 8), k=2))
            want = reference.run_turn(
                twin, tokens=[1, 2, 3, 4, 5, 6, 7, 8], seq=13, max_output_tokens=2, timeout=30
            )
            assert (rebuilt.done.tokens, rebuilt.length) == (want.tokens, want.length)
            for link in (a, b):
                await link.send(LinkClose("t9"))
                await link.recv()
        await client.aclose()

    with microturn("worker", worker_args(redis_url, "w-prefix"), workdir) as other:
        asyncio.run(run(other))
