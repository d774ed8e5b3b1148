"""`WorkerService` in-process: frames in through `dispatch`, frames out to a recording link.

The service runs in the test's own event loop over a real tiny engine and a real Redis (for the
token log), with no socket and no uvicorn between the test and it, so each test reads exactly which
frames one frame in causes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest

from shared.errors import ErrorCode
from shared.protocol.link import (
    LinkAttach,
    LinkChunk,
    LinkClose,
    LinkClosed,
    LinkDone,
    LinkError,
    LinkMigrate,
    LinkOpen,
    LinkOpened,
    LinkRestore,
    LinkRewind,
    LinkWarm,
    LinkWarmed,
    ToGateway,
)
from shared.protocol.messages import InputChunk, OpenConfig, SessionRewind
from shared.settings import WorkerSettings
from shared.store.connection import resilient_redis
from shared.store.schema import KeySchema
from tests.conftest import Servers
from tests.wait import await_until
from worker.engine import Engine
from worker.server.handover import migrate_all
from worker.server.service import WorkerService
from worker.server.token_log import read_log

CONFIG = OpenConfig(max_output_tokens=2, stop_token_ids=())


class RecordingLink:
    """A gateway's link as the service sees it: `send` only; every frame is kept in order."""

    def __init__(self) -> None:
        self.frames: list[ToGateway] = []

    def send(self, frame: ToGateway) -> None:
        self.frames.append(frame)

    async def next(self, kind: type[ToGateway], timeout_s: float = 30) -> ToGateway:
        """The first frame of `kind` not taken yet (frames before it are taken too)."""

        def found() -> bool:
            return any(isinstance(f, kind) for f in self.frames)

        await await_until(found, timeout_s, f"a {kind.__name__} frame")
        while True:
            frame = self.frames.pop(0)
            if isinstance(frame, kind):
                return frame


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine.load("tiny", kv_tokens=4096, page_size=16) as tiny:
        yield tiny


@pytest.fixture(scope="module")
def redis_url(servers: Servers) -> str:
    return servers.redis("redis")


def run(engine: Engine, redis_url: str, body: Callable[[WorkerService], Awaitable[None]]) -> None:
    async def main() -> None:
        client = resilient_redis(redis_url)
        schema = KeySchema(f"t{uuid.uuid4().hex[:10]}")
        service = WorkerService(
            engine, WorkerSettings(), client, schema, asyncio.get_running_loop(), worker_id="w-test"
        )
        try:
            await asyncio.wait_for(body(service), 60)
        finally:
            await client.aclose()

    asyncio.run(main())


def chunk(sid: str, seq: int, tokens: tuple[int, ...]) -> LinkChunk:
    return LinkChunk(sid, InputChunk(seq, tokens=tokens))


def test_open_then_chunks_are_answered_in_order_and_logged(engine: Engine, redis_url: str) -> None:
    async def body(service: WorkerService) -> None:
        link = RecordingLink()
        service.dispatch(link, LinkOpen("s1", CONFIG, history=(1, 2, 3)))
        assert await link.next(LinkOpened) == LinkOpened("s1", 3, None, None)
        sequence = [1, 2, 3]
        for seq in (1, 2):
            service.dispatch(link, chunk("s1", seq, (seq, seq + 1)))
            done = await link.next(LinkDone)
            assert isinstance(done, LinkDone) and done.done.seq == seq and len(done.done.tokens) == 2
            sequence += [seq, seq + 1, *done.done.tokens]
            assert done.length == len(sequence)
            assert await service.sessions.flush()  # one flush per turn: a first append, then more
        assert await read_log(service.redis, service.schema, "s1") == sequence[3:]
        session = service.sessions.get("s1")
        assert session is not None and service.sessions.durable_seq(session) == 2
        # The first append gave the log its TTL (later ones leave it to the heartbeat's refresh).
        assert await service.redis.pttl(service.schema.log("s1")) > 0

    run(engine, redis_url, body)


def test_a_chunk_for_a_session_not_here_is_refused_with_its_seq(engine: Engine, redis_url: str) -> None:
    async def body(service: WorkerService) -> None:
        link = RecordingLink()
        service.dispatch(link, chunk("nobody", 7, (1,)))
        error = await link.next(LinkError)
        assert isinstance(error, LinkError)
        assert (error.sid, error.error.code, error.error.seq) == ("nobody", ErrorCode.SESSION_NOT_FOUND, 7)

    run(engine, redis_url, body)


def test_attach_moves_the_session_to_the_new_link_and_replays_what_it_missed(
    engine: Engine, redis_url: str
) -> None:
    async def body(service: WorkerService) -> None:
        first, second = RecordingLink(), RecordingLink()
        service.dispatch(first, LinkOpen("s2", CONFIG))
        await first.next(LinkOpened)
        for seq in (1, 2):
            service.dispatch(first, chunk("s2", seq, (4, 5)))
            await first.next(LinkDone)
        service.dispatch(second, LinkAttach("s2", seen_seq=1))
        opened = await second.next(LinkOpened)
        assert isinstance(opened, LinkOpened) and opened.finished_seq == 2
        replayed = await second.next(LinkDone)
        assert isinstance(replayed, LinkDone) and replayed.done.seq == 2  # the one it had not seen
        service.dispatch(second, chunk("s2", 3, (6,)))
        done = await second.next(LinkDone)
        assert isinstance(done, LinkDone) and done.done.seq == 3
        assert not any(isinstance(f, LinkDone) for f in first.frames)  # the old link hears nothing more

    run(engine, redis_url, body)


def test_a_restored_session_continues_exactly_where_the_original_is(engine: Engine, redis_url: str) -> None:
    async def body(service: WorkerService) -> None:
        link = RecordingLink()
        service.dispatch(link, LinkOpen("s3", CONFIG))
        await link.next(LinkOpened)
        history: list[int] = []
        for seq in (1, 2):
            service.dispatch(link, chunk("s3", seq, (seq * 3, seq * 5)))
            done = await link.next(LinkDone)
            assert isinstance(done, LinkDone)
            history += [seq * 3, seq * 5, *done.done.tokens]
        service.dispatch(link, LinkRestore("s3-copy", CONFIG, tokens=tuple(history), seen_seq=2))
        opened = await link.next(LinkOpened)
        assert isinstance(opened, LinkOpened) and opened.length == len(history)
        answers = []
        for sid in ("s3", "s3-copy"):
            service.dispatch(link, chunk(sid, 3, (1, 2)))
            answer = await link.next(LinkDone)
            assert isinstance(answer, LinkDone) and answer.sid == sid
            answers.append((answer.done.tokens, answer.length))
        assert answers[0] == answers[1]

    run(engine, redis_url, body)


def test_close_ends_the_session_and_deletes_its_keys(engine: Engine, redis_url: str) -> None:
    async def body(service: WorkerService) -> None:
        link = RecordingLink()
        service.dispatch(link, LinkOpen("s4", CONFIG))
        await link.next(LinkOpened)
        service.dispatch(link, chunk("s4", 1, (9,)))
        await link.next(LinkDone)
        assert await service.sessions.flush()
        assert await service.redis.exists(service.schema.log("s4")) == 1
        service.dispatch(link, LinkClose("s4"))
        assert await link.next(LinkClosed) == LinkClosed("s4", "closed")
        assert service.sessions.get("s4") is None

        async def deleted() -> bool:
            return not await service.redis.exists(service.schema.log("s4"))

        await await_until(deleted, 10, "the closed session's log to be deleted")
        service.dispatch(link, chunk("s4", 2, (9,)))
        error = await link.next(LinkError)
        assert isinstance(error, LinkError) and error.error.code == ErrorCode.SESSION_NOT_FOUND

    run(engine, redis_url, body)


def test_a_drain_hands_each_attached_session_over_with_its_durable_seq(
    engine: Engine, redis_url: str
) -> None:
    async def body(service: WorkerService) -> None:
        link = RecordingLink()
        for sid in ("d1", "d2"):
            service.dispatch(link, LinkOpen(sid, CONFIG))
            await link.next(LinkOpened)
            service.dispatch(link, chunk(sid, 1, (3, 4)))
            await link.next(LinkDone)
        migrated, detached = await migrate_all(service)
        assert (migrated, detached) == (2, 0)
        migrates = [f for f in link.frames if isinstance(f, LinkMigrate)]
        assert sorted(migrates, key=lambda m: m.sid) == [LinkMigrate("d1", 1), LinkMigrate("d2", 1)]
        # Sent before the gateway had the migrate: left unanswered, for the session's next worker
        # (the gateway holds the chunk in its tail and sends the rewind again there).
        link.frames.clear()
        service.dispatch(link, LinkRewind("d1", SessionRewind(to_seq=1)))
        service.dispatch(link, chunk("d1", 2, (5,)))
        service.dispatch(link, LinkOpen("late", CONFIG))  # a draining worker takes no new session
        refused = await link.next(LinkError)
        assert isinstance(refused, LinkError) and refused.error.code == ErrorCode.WORKER_UNAVAILABLE
        assert refused.sid == "late" and link.frames == []  # nothing for d1

    run(engine, redis_url, body)


def test_a_copy_the_asking_worker_withdraws_ends_and_the_session_can_be_copied_here_again(
    engine: Engine, redis_url: str
) -> None:
    """A rebalance whose move did not switch keeps its session and closes its copy on the link that
    asked for it (switchover.py `stays`): the copy ends at once, so the next move of that session here
    is not refused as already here; a close from any other link leaves the copy alone."""

    async def main(owner_engine: Engine) -> None:
        client = resilient_redis(redis_url)
        schema, loop = KeySchema(f"t{uuid.uuid4().hex[:10]}"), asyncio.get_running_loop()
        owner = WorkerService(owner_engine, WorkerSettings(), client, schema, loop, worker_id="w-owner")
        target = WorkerService(engine, WorkerSettings(), client, schema, loop, worker_id="w-target")
        try:
            gateway = RecordingLink()
            owner.dispatch(gateway, LinkOpen("moved", CONFIG, history=(1, 2, 3)))
            await gateway.next(LinkOpened)
            owner.dispatch(gateway, chunk("moved", 1, (4, 5)))
            await gateway.next(LinkDone)
            assert await owner.sessions.flush()
            asked, other, again = RecordingLink(), RecordingLink(), RecordingLink()
            target.dispatch(asked, LinkWarm("moved", CONFIG))
            first = await asked.next(LinkWarmed)
            target.dispatch(other, LinkClose("moved"))
            assert await other.next(LinkClosed) == LinkClosed("moved", "closed")
            assert target.sessions.copy("moved") is not None
            target.dispatch(asked, LinkClose("moved"))
            assert await asked.next(LinkClosed) == LinkClosed("moved", "closed")
            assert target.sessions.copy("moved") is None
            # Asked again at once: the first copy's engine close, still on its way, takes nothing.
            target.dispatch(again, LinkWarm("moved", CONFIG))
            warmed = await again.next(LinkWarmed)
            assert warmed == first  # the same log read again: the same tokens, the same seq
            assert target.sessions.copy("moved") is not None
            owner.dispatch(gateway, chunk("moved", 2, (6,)))  # still served where it was
            assert isinstance(await gateway.next(LinkDone), LinkDone)
        finally:
            await client.aclose()

    with Engine.load("tiny", kv_tokens=4096, page_size=16) as owner_engine:
        asyncio.run(asyncio.wait_for(main(owner_engine), 60))
