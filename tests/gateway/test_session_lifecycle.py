"""The client session's lifecycle (gateway/lifecycle.py) through `ClientSession`, with fakes.

No socket, no process, no sleep: a scripted worker answers on a fake link, the session store is in
memory (tests/gateway/session_fakes.py), and each test feeds client messages and reads what the
socket would send. The real-process counterparts are test_system.py and test_fault_*.py.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import pytest

from gateway.lifecycle import SERVED, TRANSITIONS, IllegalTransition, Phase, Request, SessionLifecycle
from shared.errors import ErrorCode
from shared.protocol.close_codes import CLOSE_NORMAL
from shared.protocol.link import (
    LinkAttach,
    LinkChunk,
    LinkClose,
    LinkClosed,
    LinkDetach,
    LinkOpen,
    LinkRestore,
    UndurableTurn,
)
from shared.protocol.messages import (
    ClientMessage,
    Error,
    InputChunk,
    OpenConfig,
    OutputCancel,
    OutputDone,
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    SessionRestored,
    SessionResume,
    SessionResumed,
)
from tests.gateway.session_fakes import Gateway, Socket

OPEN = SessionOpen(OpenConfig())


def chunk(seq: int) -> InputChunk:
    return InputChunk(seq, tokens=(1, 2))


def run(test: Callable[[Gateway], Awaitable[None]]) -> None:
    asyncio.run(test(Gateway()))


async def opened(gw: Gateway) -> Socket:
    sock = gw.socket()
    [reply] = await sock.send(OPEN)
    assert isinstance(reply, SessionOpened) and sock.session.life.phase is Phase.ACTIVE
    return sock


async def until(condition: Callable[[], bool]) -> None:
    """Let a flow started in another task run to the point where it waits for the worker."""
    for _ in range(20):
        if condition():
            return
        await asyncio.sleep(0)  # a bare yield to the event loop, not a timed wait
    raise AssertionError("the flow never got there")


def dones(replies: list[object]) -> list[int]:
    return [m.seq for m in replies if isinstance(m, OutputDone)]


# ---- open, chunk, close -------------------------------------------------------------------------


def test_open_places_the_session_and_a_chunk_is_answered() -> None:
    async def test(gw: Gateway) -> None:
        sock = await opened(gw)
        assert [type(f) for f in sock.worker.received] == [LinkOpen]
        assert dones(await sock.send(chunk(1))) == [1]
        assert sock.worker.received[-1] == LinkChunk(sock.session.sid or "", InputChunk(1, (1, 2)))

    run(test)


def test_close_ends_the_session_on_the_worker_and_nothing_is_detached() -> None:
    async def test(gw: Gateway) -> None:
        sock = await opened(gw)
        assert await sock.send(SessionClose()) == [SessionClosed("closed")]
        assert (sock.closed_with, sock.session.life.phase) == (CLOSE_NORMAL, Phase.GONE)
        await sock.disconnect()
        assert [type(f) for f in sock.worker.received] == [LinkOpen, LinkClose]

    run(test)


def test_a_close_the_worker_cannot_confirm_deletes_the_session() -> None:
    async def test(gw: Gateway) -> None:
        sock = await opened(gw)
        gw.link("w1").broken = True
        assert await sock.send(SessionClose()) == [SessionClosed("closed")]
        assert sock.session.life.phase is Phase.GONE and gw.store.deleted == [sock.session.sid]

    run(test)


def test_a_socket_that_goes_away_detaches_its_live_session() -> None:
    async def test(gw: Gateway) -> None:
        sock = await opened(gw)
        await sock.disconnect()
        assert sock.session.life.phase is Phase.ENDED
        assert sock.worker.received[-1] == LinkDetach(sock.session.sid or "")

    run(test)


def test_a_session_the_worker_ends_is_gone_and_not_detached() -> None:
    async def test(gw: Gateway) -> None:
        sock = await opened(gw)
        gw.pool.dispatch(gw.link("w1"), LinkClosed(sock.session.sid or "", "idle_timeout"))
        assert sock.replies() == [SessionClosed("idle_timeout")] and sock.closed_with == CLOSE_NORMAL
        await sock.disconnect()
        assert sock.session.life.phase is Phase.GONE
        assert [type(f) for f in sock.worker.received] == [LinkOpen]

    run(test)


# ---- link loss, restore -------------------------------------------------------------------------


def test_link_loss_restores_with_the_tail_and_holds_chunks_meanwhile() -> None:
    async def test(gw: Gateway) -> None:
        sock = await opened(gw)
        sid = sock.session.sid or ""
        assert dones(await sock.send(chunk(1))) == [1]  # delivered, not durable yet
        gw.workers["w1"].answering = False
        await sock.send(chunk(2))  # in flight when the link breaks
        gw.workers["w2"].answering = False
        gw.pool.link_lost(gw.link("w1"))
        await until(lambda: bool(gw.workers["w2"].received))  # the restore frame is out
        assert await sock.send(chunk(3)) == []  # held, not refused
        [restore] = gw.workers["w2"].received
        assert isinstance(restore, LinkRestore) and restore.seen_seq == 1
        delivered, in_flight = (
            UndurableTurn(InputChunk(1, (1, 2)), (7,)),
            UndurableTurn(InputChunk(2, (1, 2))),
        )
        assert restore.tail == (delivered, in_flight)
        gw.workers["w2"].answering = True  # the new worker answers the restore, then the held chunk
        gw.pool.dispatch(gw.link("w2"), gw.workers["w2"].answer(restore)[0])
        restore_task = sock.session._restore_task
        assert restore_task is not None
        await restore_task
        replies = sock.replies()
        assert isinstance(replies[0], SessionRestored) and dones(replies) == [3]
        assert sock.session.life.phase is Phase.ACTIVE and gw.store.records[sid][0].worker == "w2"
        assert [f.chunk.seq for f in gw.workers["w2"].received if isinstance(f, LinkChunk)] == [3]

    run(test)


def test_a_restore_no_worker_can_take_ends_the_socket_and_keeps_the_session() -> None:
    async def test(gw: Gateway) -> None:
        sock = await opened(gw)
        gw.store.full.add("w2")
        gw.pool.link_lost(gw.link("w1"))  # w1 is suspect now: no worker has room
        restore_task = sock.session._restore_task
        assert restore_task is not None
        await restore_task
        [error] = sock.replies()
        assert isinstance(error, Error) and (error.code, error.fatal) == (ErrorCode.CAPACITY_EXHAUSTED, True)
        assert sock.session.life.phase is Phase.GONE and sock.session.sid in gw.store.records

    run(test)


# ---- resume, takeover ---------------------------------------------------------------------------


def test_resume_takes_the_session_over_from_the_older_socket() -> None:
    async def test(gw: Gateway) -> None:
        first = await opened(gw)
        await first.send(chunk(1))
        sid = first.session.sid or ""
        second = gw.socket()
        resume = SessionResume(sid, first.resume_token, last_seq=1)
        assert await second.send(resume) == [SessionResumed(sid, 3, 1)]
        assert first.replies() == [SessionClosed("taken_over")] and first.session.life.phase is Phase.GONE
        assert gw.workers["w1"].received[-1] == LinkAttach(sid, 1)
        assert dones(await second.send(chunk(2))) == [2]

    run(test)


def test_resume_of_a_session_whose_worker_is_gone_restores_it_elsewhere() -> None:
    async def test(gw: Gateway) -> None:
        first = await opened(gw)
        await first.send(chunk(1))
        await first.disconnect()
        sid = first.session.sid or ""
        gw.store.full.add("w1")  # its registry entry expired
        second = gw.socket()
        replies = await second.send(SessionResume(sid, first.resume_token, last_seq=1))
        assert replies == [SessionResumed(sid, 0, 1), SessionRestored(sid, 0)]
        # The client saw turn 1 finish: the rebuilt session refuses it again rather than re-run it.
        [refused] = await second.send(chunk(1))
        assert isinstance(refused, Error) and refused.code == ErrorCode.BAD_SEQUENCE and not refused.fatal

    run(test)


def test_an_open_refused_recoverably_leaves_the_socket_idle() -> None:
    async def test(gw: Gateway) -> None:
        gw.store.full.update(("w1", "w2"))
        other = gw.socket()
        [busy] = await other.send(OPEN)
        assert isinstance(busy, Error) and busy.code == ErrorCode.CAPACITY_EXHAUSTED
        assert other.session.life.phase is Phase.IDLE and other.session.sid is None

    run(test)


# ---- the resent chunk (docs/failover.md: every chunk gets exactly one output.done) -------------


def test_a_resent_answered_chunk_is_refused_and_its_turn_is_restored_once() -> None:
    """A client resends a chunk it already has the answer for; the worker is lost before the turn is
    durable. The turn must reach the new worker as delivered (forced once), not as a chunk to run
    again: a re-run would answer it twice and run and log the turn a second time."""

    async def test(gw: Gateway) -> None:
        sock = await opened(gw)
        assert dones(await sock.send(chunk(1))) == [1]
        gw.workers["w1"].answering = False  # the link breaks before any refusal comes back
        [refused] = await sock.send(chunk(1))
        assert isinstance(refused, Error) and (refused.code, refused.seq) == (ErrorCode.BAD_SEQUENCE, 1)
        gw.pool.link_lost(gw.link("w1"))
        restore_task = sock.session._restore_task
        assert restore_task is not None
        await restore_task
        [restore] = [f for f in gw.workers["w2"].received if isinstance(f, LinkRestore)]
        assert restore.tail == (UndurableTurn(InputChunk(1, (1, 2)), (7,)),)
        assert dones(sock.replies()) == []  # no second answer for seq 1
        assert dones(await sock.send(chunk(2))) == [2]

    run(test)


# ---- every refused move -------------------------------------------------------------------------


async def reach(gw: Gateway, phase: Phase) -> Socket:
    """A socket in `phase`, reached the way a client and its worker get it there."""
    sock = gw.socket()
    if phase is Phase.IDLE:
        return sock
    if phase is Phase.OPENING:
        gw.workers["w1"].answering = False
        asyncio.get_running_loop().create_task(sock.send(OPEN))
        await until(lambda: sock.session.life.phase is phase)
        return sock
    await sock.send(OPEN)
    if phase is Phase.ACTIVE:
        return sock
    if phase is Phase.RESTORING:
        gw.workers["w2"].answering = False
        gw.pool.link_lost(gw.link("w1"))
    elif phase is Phase.CLOSING:
        gw.workers["w1"].answering = False
        asyncio.get_running_loop().create_task(sock.send(SessionClose()))
        await until(lambda: sock.session.life.phase is phase)
    elif phase is Phase.ENDED:
        await sock.disconnect()
    elif phase is Phase.GONE:
        gw.pool.dispatch(gw.link("w1"), LinkClosed(sock.session.sid or "", "idle_timeout"))
    else:
        raise AssertionError(f"no way to reach {phase} yet: add one here")
    assert sock.session.life.phase is phase
    sock.replies()
    return sock


REQUESTS: dict[Request, ClientMessage] = {
    Request.OPEN: OPEN,
    Request.CHUNK: chunk(1),
    Request.CANCEL: OutputCancel(1),
    Request.CLOSE: SessionClose(),
}
REFUSED = [(r, p) for r, p in itertools.product(Request, Phase) if p not in SERVED[r]]


@pytest.mark.parametrize(("request_", "phase"), REFUSED, ids=[f"{r.name}-{p.name}" for r, p in REFUSED])
def test_a_request_out_of_order_is_refused_with_a_typed_client_error(request_: Request, phase: Phase) -> None:
    async def test(gw: Gateway) -> None:
        sock = await reach(gw, phase)
        sent = {w: len(worker.received) for w, worker in gw.workers.items()}
        replies = await sock.send(REQUESTS[request_])
        assert sock.session.life.phase is phase  # nothing moved
        assert {w: len(worker.received) for w, worker in gw.workers.items()} == sent  # nothing sent
        expected = sock.session.life.refusal(request_)
        assert expected is not None
        moving = (request_, phase) == (Request.CANCEL, Phase.RESTORING)
        assert expected.code == (ErrorCode.WORKER_UNAVAILABLE if moving else ErrorCode.INVALID_MESSAGE)
        if not sock.session.outbox.closing:  # a socket whose close is queued sends nothing more
            [error] = replies
            assert isinstance(error, Error) and (error.code, error.fatal) == (expected.code, False)
        else:
            assert replies == []

    run(test)


@pytest.mark.parametrize("phase", list(Phase))
def test_every_phase_is_reachable(phase: Phase) -> None:
    async def test(gw: Gateway) -> None:
        assert (await reach(gw, phase)).session.life.phase is phase

    run(test)


ILLEGAL = [(a, b) for a, b in itertools.product(Phase, Phase) if b not in TRANSITIONS[a]]


@pytest.mark.parametrize(("start", "to"), ILLEGAL, ids=[f"{a.name}-{b.name}" for a, b in ILLEGAL])
def test_a_move_the_table_does_not_allow_raises_an_internal_error(start: Phase, to: Phase) -> None:
    life = SessionLifecycle(start)
    with pytest.raises(IllegalTransition) as raised:
        life.move(to)
    assert raised.value.code == ErrorCode.INTERNAL and life.phase is start
