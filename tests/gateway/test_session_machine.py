"""The gateway session machine (gateway/session/machine.py), played as events with no I/O.

Each test feeds events (client messages, worker frames, effect results, timers, the link lost) and
reads the actions the machine queues: nothing here is a socket, a link, Redis or an event loop.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest

from gateway.limits import LimitValues
from gateway.metric_families import Metric
from gateway.metrics import GatewayMetrics
from gateway.session.actions import (
    Action,
    AdmitOpen,
    ArmTimer,
    Bind,
    CloseSocket,
    Count,
    Delete,
    EndOnWorker,
    FindWorker,
    Lookup,
    Move,
    Place,
    ReleaseAuth,
    SendClient,
    SendWorker,
    Timer,
    Unbind,
    WorkerRef,
)
from gateway.session.flows import (
    PLACEMENT_ATTEMPTS,
    RESTORE_BACKOFF_S,
    STEPS,
    CloseStep,
    OpenStep,
    RestoreStep,
    ResumeStep,
    Step,
    check_step,
)
from gateway.session.guard import Deadline, Expire, Verdict
from gateway.session.lifecycle import SERVED, IllegalTransition, Phase, Request
from gateway.session.machine import MachineConfig, SessionMachine
from shared.errors import CapacityExhausted, ErrorCode, SessionNotFound, WorkerUnavailable
from shared.protocol.close_codes import CLOSE_NORMAL
from shared.protocol.key_limits import AuthLimits
from shared.protocol.link import (
    LinkAttach,
    LinkCancel,
    LinkChunk,
    LinkClose,
    LinkClosed,
    LinkDelta,
    LinkDetach,
    LinkDone,
    LinkError,
    LinkMigrate,
    LinkOpen,
    LinkOpened,
    LinkRestore,
    LinkRewind,
    LinkRewound,
)
from shared.protocol.messages import (
    ClientMessage,
    Error,
    InputChunk,
    OpenConfig,
    OutputCancel,
    OutputDelta,
    OutputDone,
    Ping,
    Pong,
    ServerMessage,
    SessionClose,
    SessionClosed,
    SessionExpiring,
    SessionOpen,
    SessionOpened,
    SessionRestored,
    SessionResume,
    SessionResumed,
    SessionRewind,
    SessionRewound,
    Timing,
)
from shared.store.registry import SessionRecord

LIMITS = LimitValues(65536, 4096, 1000.0, 1000, 100_000, 100)
W1, W2 = WorkerRef("ws://w1", "w1"), WorkerRef("ws://w2", "w2")
SID = "s1"


def record(worker: WorkerRef) -> SessionRecord:
    return SessionRecord(worker=worker.worker_id, token_sha256="ab" * 32, model="m", created_ms=1)


def machine(guard: FakeGuard | None = None) -> SessionMachine:
    ids = itertools.count(1)
    return SessionMachine(
        MachineConfig(LIMITS, open_timeout_s=5.0),
        guard=guard,
        new_sid=lambda: f"s{next(ids)}",
        new_token=lambda: "tok",
    )


def client(m: SessionMachine) -> list[ServerMessage]:
    """The messages for the client among the queued actions (the rest are dropped)."""
    return [a.message for a in m.actions() if isinstance(a, SendClient)]


def of(actions: list[Action], kind: type) -> list[object]:
    return [a for a in actions if isinstance(a, kind)]


def done(seq: int, tokens: tuple[int, ...], length: int, durable: int | None = None) -> LinkDone:
    return LinkDone(SID, OutputDone(seq, tokens, None, "length", Timing(0.0, 0.0)), length, durable)


def chunk(seq: int) -> InputChunk:
    return InputChunk(seq, (seq,), max_output_tokens=1)


def opened(m: SessionMachine, worker: WorkerRef = W1) -> SessionMachine:
    """A machine with an open session on `worker`."""
    m.receive(SessionOpen(OpenConfig()), 0.0)
    if m.actions() == [AdmitOpen(SID)]:  # with a credential, it admits the session first
        m.admitted()
        [place] = m.actions()
        assert isinstance(place, Place) and place.auth is not None
    assert m.busy
    m.placed(record(worker), worker.url)
    bind, send, arm = m.actions()
    assert bind == Bind(SID, worker) and arm == ArmTimer(Timer.REQUEST, 5.0)
    assert isinstance(send, SendWorker) and isinstance(send.frame, LinkOpen) and send.worker == worker
    m.worker_frame(LinkOpened(SID, 0), 0.0)
    assert [type(x) for x in client(m)] == [SessionOpened] and m.life.phase is Phase.ACTIVE
    return m


def test_a_chunk_goes_to_the_worker_and_its_done_to_the_client() -> None:
    m = opened(machine())
    m.receive(chunk(1), 7.0)
    assert m.actions() == [SendWorker(LinkChunk(SID, chunk(1)), W1), Count(Metric.CHUNKS_FORWARDED)]
    m.worker_frame(LinkDelta(SID, OutputDelta(1, 0, 5)), 0.0)
    m.worker_frame(done(1, (5,), 3), 0.0)
    actions = m.actions()
    assert actions[0] == SendClient(OutputDelta(1, 0, 5)) and actions[1] == SendClient(
        done(1, (5,), 3).done, 7.0
    )


def test_a_lost_worker_is_replaced_and_every_chunk_gets_exactly_one_done() -> None:
    m = opened(machine())
    for seq in (1, 2):
        m.receive(chunk(seq), 0.0)
    m.worker_frame(done(1, (5,), 3), 0.0)  # 1 answered, not yet durable; 2 in flight
    m.actions()
    m.link_lost()
    assert m.actions() == [Move(SID, record(W1), OpenConfig())] and m.life.phase is Phase.RESTORING
    m.receive(chunk(3), 0.0)  # held while the session moves
    assert m.actions() == []
    m.placed(record(W2), W2.url)
    restore = next(a.frame for a in m.actions() if isinstance(a, SendWorker))
    assert isinstance(restore, LinkRestore) and restore.seen_seq == 1
    assert [(t.chunk.seq, t.output) for t in restore.tail] == [(1, (5,)), (2, None), (3, None)]
    m.receive(chunk(4), 0.0)  # held too, but it arrived after the restore frame was built
    m.worker_frame(LinkOpened(SID, 3, finished_seq=1, durable_seq=None), 0.0)
    actions = m.actions()
    assert [a.frame for a in actions if isinstance(a, SendWorker)] == [LinkChunk(SID, chunk(4))]
    assert [a.message for a in actions if isinstance(a, SendClient)] == [SessionRestored(SID, 3)]
    m.worker_frame(done(1, (5,), 3), 0.0)  # the new worker re-sends a turn the client had: dropped
    m.worker_frame(done(2, (6,), 5), 0.0)
    assert [d.seq for d in client(m) if isinstance(d, OutputDone)] == [2]


def sent(m: SessionMachine) -> list[object]:
    """The frames for the worker among the queued actions (the rest are dropped)."""
    return [a.frame for a in m.actions() if isinstance(a, SendWorker)]


def test_a_rewind_goes_to_the_worker_and_holds_what_follows_until_it_is_answered() -> None:
    m = opened(machine())
    m.receive(chunk(1), 0.0)
    m.worker_frame(done(1, (5,), 3), 0.0)
    m.actions()
    m.receive(SessionRewind(to_seq=1), 0.0)
    m.receive(OutputCancel(1, keep_output_tokens=0), 0.0)  # behind the rewind: one at the worker at a time
    m.receive(chunk(2), 0.0)  # behind both: held until they are durable
    assert sent(m) == [LinkRewind(SID, SessionRewind(to_seq=1))]
    m.worker_frame(LinkRewound(SID, SessionRewound(3), durable_seq=1), 0.0)
    actions = m.actions()
    assert [a.message for a in actions if isinstance(a, SendClient)] == [SessionRewound(3)]
    assert of(actions, SendWorker) == [SendWorker(LinkCancel(SID, 1, keep_output_tokens=0), W1)]
    assert len(m.turns.undurable) == 1  # chunk 2; turn 1 is in the log, the rewind after it
    m.worker_frame(LinkError(SID, Error(ErrorCode.INVALID_MESSAGE, "k is too large", False)), 0.0)
    actions = m.actions()  # a refusal with no seq answers the rewind at the worker, too
    assert [type(a.message) for a in actions if isinstance(a, SendClient)] == [Error]
    assert [a.frame for a in actions if isinstance(a, SendWorker)] == [LinkChunk(SID, chunk(2))]
    m.receive(OutputCancel(2), 0.0)  # a plain cancel with nothing pending goes at once
    assert sent(m) == [LinkCancel(SID, 2)]


def test_a_rewind_in_flight_when_the_worker_is_lost_goes_again_after_the_restore() -> None:
    """Applied and logged on the lost worker, or not: it goes again to the next worker (a rewind
    names a length: applying it twice changes nothing), after the turns before it are answered
    there, and the client gets exactly one `session.rewound`; the chunks sent behind it never run
    before it, and edits sent while the session moves wait for the restore, in order."""
    m = opened(machine())
    m.receive(chunk(1), 0.0)
    m.worker_frame(done(1, (5,), 3), 0.0)  # answered, not durable yet
    m.receive(chunk(2), 0.0)  # in flight
    m.receive(SessionRewind(keep_tokens=4), 0.0)
    m.receive(chunk(3), 0.0)  # behind the rewind
    m.actions()
    rewind = LinkRewind(SID, SessionRewind(keep_tokens=4))
    m.send_failed(rewind, WorkerUnavailable("link broke"))  # left to the restore, as a chunk is
    assert client(m) == []
    m.link_lost()
    assert m.actions() == [Move(SID, record(W1), OpenConfig())]  # nothing refused
    m.receive(chunk(4), 0.0)  # held while the session moves
    m.receive(OutputCancel(4), 0.0)  # held too, in its place
    m.receive(SessionRewind(to_seq=1), 0.0)  # and a rewind
    assert m.actions() == []
    m.placed(record(W2), W2.url)
    restore = next(a.frame for a in m.actions() if isinstance(a, SendWorker))
    assert isinstance(restore, LinkRestore)
    assert [(t.chunk.seq, t.output) for t in restore.tail] == [(1, (5,)), (2, None)]  # not 3 and 4
    m.worker_frame(LinkOpened(SID, 3, finished_seq=1, durable_seq=None), 0.0)
    assert sent(m) == []  # the rewind waits for turn 2, which the new worker runs again
    m.worker_frame(done(2, (6, 7), 5), 0.0)
    assert sent(m) == [rewind]
    m.worker_frame(LinkRewound(SID, SessionRewound(4), durable_seq=2), 0.0)
    actions = m.actions()
    assert [a.message for a in actions if isinstance(a, SendClient)] == [SessionRewound(4)]
    assert [a.frame for a in actions if isinstance(a, SendWorker)] == [
        LinkChunk(SID, chunk(3)),
        LinkChunk(SID, chunk(4)),
        LinkCancel(SID, 4),
        LinkRewind(SID, SessionRewind(to_seq=1)),
    ]
    m.worker_frame(done(3, (8,), 6), 0.0)
    m.worker_frame(done(4, (), 7), 0.0)
    assert [d.seq for d in client(m) if isinstance(d, OutputDone)] == [3, 4]
    m.receive(chunk(5), 0.0)  # behind the second rewind, which is at the worker
    assert sent(m) == []
    m.worker_frame(LinkRewound(SID, SessionRewound(3), durable_seq=4), 0.0)
    assert sent(m) == [LinkChunk(SID, chunk(5))]


def test_a_cancel_keeping_outputs_of_a_turn_the_move_caught_running_goes_as_the_length_it_meant() -> None:
    """The new worker runs the turn again to its end, and another behind it: sent as itself the
    cancel would be refused (the turn is no longer the session's last), so once the turn is
    answered it goes as `keep_tokens` up to its k-th output, which also cancels the turn behind."""
    m = opened(machine())
    m.receive(chunk(1), 0.0)
    m.receive(chunk(2), 0.0)
    m.receive(OutputCancel(1, keep_output_tokens=1), 0.0)
    m.actions()
    m.link_lost()
    m.placed(record(W2), W2.url)
    [restore] = sent(m)
    assert isinstance(restore, LinkRestore) and [t.chunk.seq for t in restore.tail] == [1, 2]
    m.worker_frame(LinkOpened(SID, 0, finished_seq=None, durable_seq=None), 0.0)
    assert sent(m) == []  # the cancel waits for turn 1
    m.worker_frame(done(1, (5, 6, 7), 10), 0.0)  # 7 in, 3 out
    assert sent(m) == [LinkRewind(SID, SessionRewind(keep_tokens=10 - 3 + 1))]
    m.worker_frame(LinkRewound(SID, SessionRewound(8), durable_seq=None), 0.0)
    assert [x for x in client(m) if isinstance(x, SessionRewound)] == [SessionRewound(8)]
    # The same, with the turn refused by the new worker: the cancel goes as itself, to be judged.
    m.receive(chunk(3), 0.0)
    m.receive(OutputCancel(3, keep_output_tokens=1), 0.0)
    m.actions()
    m.link_lost()
    m.placed(record(W1), W1.url)
    m.worker_frame(LinkOpened(SID, 8, finished_seq=2, durable_seq=None), 0.0)
    m.actions()
    m.worker_frame(LinkError(SID, Error(ErrorCode.BACKPRESSURE, "full", False, seq=3)), 0.0)
    assert sent(m) == [LinkCancel(SID, 3, keep_output_tokens=1)]


def test_a_draining_worker_that_leaves_a_rewind_unanswered_moves_it_with_the_session() -> None:
    m = opened(machine())
    m.receive(chunk(1), 0.0)
    m.worker_frame(done(1, (5,), 3, durable=1), 0.0)
    m.receive(SessionRewind(to_seq=1), 0.0)
    m.actions()
    m.worker_frame(LinkMigrate(SID, durable_seq=1), 0.0)  # the rewind came after its switch point
    assert not client(m)
    m.placed(record(W2), W2.url)
    restore = next(a.frame for a in m.actions() if isinstance(a, SendWorker))
    assert isinstance(restore, LinkRestore) and restore.tail == ()
    m.worker_frame(LinkOpened(SID, 3, finished_seq=1, durable_seq=1), 0.0)
    actions = m.actions()  # nothing before it is in flight: it goes at once, after `restored`
    assert [type(a.message) for a in actions if isinstance(a, SendClient)] == [SessionRestored]
    assert of(actions, SendWorker) == [SendWorker(LinkRewind(SID, SessionRewind(to_seq=1)), W2)]


def test_a_restore_retries_on_another_worker_then_ends_the_socket_not_the_session() -> None:
    m = opened(machine())
    m.link_lost()
    for attempt, delay in enumerate(RESTORE_BACKOFF_S):
        if delay:
            assert m.actions() == [ArmTimer(Timer.BACKOFF, delay)]
            m.timer_fired(Timer.BACKOFF)
        assert of(m.actions(), Move), attempt
        m.effect_failed(CapacityExhausted("full"))
    assert [type(x) for x in client(m)] == [Error] and m.life.phase is Phase.GONE


def test_a_draining_worker_moves_the_session() -> None:
    m = opened(machine())
    m.receive(chunk(1), 0.0)
    m.worker_frame(done(1, (5,), 3, durable=1), 0.0)
    m.actions()
    m.worker_frame(LinkMigrate(SID, durable_seq=1), 0.0)
    assert m.actions() == [Count(Metric.SESSIONS_MIGRATED), Unbind(SID), Move(SID, record(W1), OpenConfig())]
    m.placed(record(W2), W2.url)
    restore = next(a.frame for a in m.actions() if isinstance(a, SendWorker))
    assert isinstance(restore, LinkRestore) and restore.tail == ()  # turn 1 is durable


def test_a_drain_with_a_warm_copy_moves_the_session_there_first_then_anywhere() -> None:
    m = opened(machine())
    m.worker_frame(LinkMigrate(SID, durable_seq=None, target="w2"), 0.0)
    assert of(m.actions(), Move) == [Move(SID, record(W1), OpenConfig(), "w2")]
    m.effect_failed(WorkerUnavailable("w2 went away"))
    retried = m.actions()
    if of(retried, Move) == []:  # a backoff first
        m.timer_fired(Timer.BACKOFF)
        retried = m.actions()
    assert of(retried, Move) == [Move(SID, record(W1), OpenConfig())]  # the retry: wherever placement says


def test_resume_attaches_on_the_live_worker_or_restores_when_it_is_gone() -> None:
    m = machine()
    m.receive(SessionResume(SID, "tok", last_seq=4), 0.0)
    assert m.actions() == [Lookup(SID, "tok")]
    m.looked_up(record(W1), OpenConfig())
    assert m.actions() == [FindWorker("w1")]
    m.worker_found(W1.url)
    assert SendWorker(LinkAttach(SID, 4), W1) in m.actions()
    m.worker_frame(LinkError(SID, Error(ErrorCode.SESSION_NOT_FOUND, "gone", fatal=False)), 0.0)
    assert of(m.actions(), Move)  # not on its worker any more: rebuilt elsewhere
    m.placed(record(W2), W2.url)
    restore = next(a.frame for a in m.actions() if isinstance(a, SendWorker))
    assert isinstance(restore, LinkRestore) and restore.seen_seq == 4
    m.worker_frame(LinkOpened(SID, 9, finished_seq=4), 0.0)
    assert client(m) == [SessionResumed(SID, 9, 4), SessionRestored(SID, 9)]
    assert m.life.phase is Phase.ACTIVE and m.turns.finished_seq == 4


def test_a_session_taken_over_by_another_socket_is_closed_here() -> None:
    m = opened(machine())
    m.taken_over()
    assert client(m) == [SessionClosed("taken_over")] and m.life.phase is Phase.GONE


def test_close_is_confirmed_by_the_worker_or_ended_here() -> None:
    m = opened(machine())
    m.receive(SessionClose(), 0.0)
    assert SendWorker(LinkClose(SID), W1) in m.actions() and m.busy
    m.worker_frame(LinkClosed(SID, "closed"), 0.0)
    assert [a for a in m.actions() if isinstance(a, SendClient | CloseSocket)][-2:] == [
        SendClient(SessionClosed("closed")),
        CloseSocket(CLOSE_NORMAL),
    ]
    m = opened(machine())
    m.receive(SessionClose(), 0.0)
    m.actions()
    m.timer_fired(Timer.CLOSE)  # no answer: the keys go, so it cannot be resumed
    assert of(m.actions(), Delete) == [Delete(SID)] and m.busy
    m.deleted()
    assert client(m) == [SessionClosed("closed")] and m.life.phase is Phase.GONE


def test_an_open_tries_the_next_worker_after_one_that_does_not_answer() -> None:
    m = machine()
    m.receive(SessionOpen(OpenConfig()), 0.0)
    for _ in range(PLACEMENT_ATTEMPTS):
        assert of(m.actions(), Place)
        m.placed(record(W1), W1.url)
        m.actions()
        m.timer_fired(Timer.REQUEST)
        assert Delete(SID) in m.actions()
        m.deleted()
    assert [x.code for x in client(m) if isinstance(x, Error)] == [ErrorCode.WORKER_UNAVAILABLE]
    assert m.life.phase is Phase.IDLE and m.sid is None and not m.busy  # the client may try again


def test_a_worker_that_cannot_place_it_refuses_the_open_with_what_it_said() -> None:
    m = machine()
    m.receive(SessionOpen(OpenConfig()), 0.0)
    m.actions()
    m.effect_failed(CapacityExhausted("every worker is full", retry_after_ms=500))
    [error] = client(m)
    assert isinstance(error, Error) and error.code is ErrorCode.CAPACITY_EXHAUSTED
    m.store_failed()  # nothing awaited: ignored
    assert m.actions() == [] and m.life.phase is Phase.IDLE


@pytest.mark.parametrize("request_kind", list(Request))
def test_every_request_is_refused_in_every_phase_that_does_not_serve_it(request_kind: Request) -> None:
    messages: dict[Request, ClientMessage] = {
        Request.OPEN: SessionOpen(OpenConfig()),
        Request.CHUNK: chunk(1),
        Request.CANCEL: OutputCancel(1),
        Request.REWIND: SessionRewind(keep_tokens=1),
        Request.CLOSE: SessionClose(),
    }
    for phase in Phase:
        if phase in SERVED[request_kind] or (phase is Phase.RESTORING and request_kind is Request.CLOSE):
            continue
        m = opened(machine()) if phase is not Phase.IDLE else machine()
        m.life.phase = phase  # set directly: each phase is reached by a test above
        m.receive(messages[request_kind], 0.0)
        actions = m.actions()
        errors = [a.message for a in actions if isinstance(a, SendClient) and isinstance(a.message, Error)]
        assert len(errors) == 1, (request_kind, phase, actions)
        assert not of(actions, SendWorker) and not of(actions, Place), (request_kind, phase)


def test_a_refused_chunk_changes_nothing() -> None:
    m = opened(machine())
    m.receive(chunk(1), 0.0)
    m.actions()
    m.receive(chunk(1), 0.0)  # already running
    [error] = client(m)
    assert isinstance(error, Error) and error.code is ErrorCode.BAD_SEQUENCE and error.seq == 1
    m.worker_frame(done(1, (5,), 3), 0.0)
    m.actions()
    m.receive(chunk(1), 0.0)  # at or below the finished seq
    assert (
        [type(x) for x in client(m)] == [Error]
        and list(m.turns.in_flight) == []
        and len(m.turns.undurable) == 1
    )


def test_ping_is_answered_and_a_socket_end_detaches_or_closes_the_session() -> None:
    m = opened(machine())
    m.receive(Ping({"n": 1}), 0.0)
    assert client(m) == [Pong({"n": 1})]
    m.socket_closed()
    assert m.actions()[-2:] == [Unbind(SID), SendWorker(LinkDetach(SID), W1)]
    m = opened(machine())
    m.socket_closed(close_session=True)  # a dialect with no resume ends it
    assert m.actions()[-1] == SendWorker(LinkClose(SID), W1)


class FakeGuard:
    """A credential's verdicts, set by the test (the real one is gateway/auth/session_auth.py)."""

    def __init__(self, on_done: Callable[[int], Verdict] = lambda tokens: None) -> None:
        self.chunks_per_s = 0.0
        self._on_done = on_done
        self.started_at: float | None = None
        self.chunks_at: list[float] = []  # the time each chunk was checked at

    def limits_map(self) -> dict[str, int | float]:
        return {"max_session_s": 60}

    def grant(self) -> AuthLimits:
        return AuthLimits(key_sha256="k" * 64, max_session_s=60.0)

    def start(self, now: float) -> tuple[Verdict, Deadline | None]:
        self.started_at = now
        return None, Deadline(48.0, SessionExpiring(SID, "max_duration", 12000), 60.0, Expire("60 s"))

    def check_chunk(self, now: float) -> None:
        self.chunks_at.append(now)

    def on_done(self, tokens: int) -> Verdict:
        return self._on_done(tokens)


def test_a_credential_admits_the_open_warns_then_expires_the_session() -> None:
    m = machine(FakeGuard())
    m.receive(SessionOpen(OpenConfig()), 0.0)
    assert m.actions() == [AdmitOpen(SID)]
    m.admitted()
    assert m.actions() == [
        Place(SID, "tok", OpenConfig(), AuthLimits(key_sha256="k" * 64, max_session_s=60.0))
    ]
    m.placed(record(W1), W1.url)
    m.actions()
    m.worker_frame(LinkOpened(SID, 0), 0.0)
    actions = m.actions()
    assert ArmTimer(Timer.AUTH_WARN, 48.0) in actions and ArmTimer(Timer.AUTH_EXPIRE, 60.0) in actions
    m.timer_fired(Timer.AUTH_WARN)
    assert client(m) == [SessionExpiring(SID, "max_duration", 12000)]
    m.timer_fired(Timer.AUTH_EXPIRE)
    actions = m.actions()
    assert EndOnWorker(SID, W1) in actions and m.life.phase is Phase.GONE
    [error] = [a.message for a in actions if isinstance(a, SendClient)]
    assert isinstance(error, Error) and error.code is ErrorCode.SESSION_EXPIRED and error.fatal


def test_a_refused_credential_leaves_the_socket_idle_and_releases_its_slot() -> None:
    m = machine(FakeGuard())
    m.receive(SessionOpen(OpenConfig()), 0.0)
    m.actions()
    m.effect_failed(WorkerUnavailable("slot store down", retry_after_ms=10))
    actions = m.actions()
    assert ReleaseAuth() in actions and m.life.phase is Phase.IDLE and not m.busy


def test_a_keyed_session_the_worker_closed_is_told_so_once_its_slot_is_back() -> None:
    m = opened(machine(FakeGuard()))
    m.worker_frame(LinkClosed(SID, "closed"), 0.0)
    actions = m.actions()
    # The slot's release first: a client that opens again on hearing `session.closed` finds it free.
    assert ReleaseAuth() in actions and not of(actions, SendClient) and not of(actions, CloseSocket)
    m.auth_released()
    actions = m.actions()
    assert [a.message for a in of(actions, SendClient)] == [SessionClosed("closed")]  # type: ignore[attr-defined]
    assert of(actions, CloseSocket) == [CloseSocket(CLOSE_NORMAL)] and m.life.phase is Phase.GONE
    m.auth_released()  # another release (the socket's own) tells nothing twice
    assert m.actions() == []


def test_a_spent_token_budget_expires_the_session_at_its_done() -> None:
    m = opened(machine(FakeGuard(on_done=lambda tokens: Expire("budget spent") if tokens >= 3 else None)))
    m.receive(chunk(1), 0.0)
    m.worker_frame(done(1, (5,), 3), 0.0)
    kinds = [type(a.message) for a in m.actions() if isinstance(a, SendClient)]
    assert kinds == [OutputDone, Error] and m.life.phase is Phase.GONE


def test_an_attach_refused_for_another_reason_fails_the_resume() -> None:
    m = machine()
    m.receive(SessionResume(SID, "tok"), 0.0)
    m.looked_up(record(W1), OpenConfig())
    m.worker_found(W1.url)
    m.actions()
    m.worker_frame(LinkError(SID, Error(ErrorCode.UNAUTHORIZED, "no", fatal=True)), 0.0)
    assert of(m.actions(), Unbind) and m.life.phase is not Phase.ACTIVE
    m2 = machine()
    m2.receive(SessionResume(SID, "tok"), 0.0)
    m2.effect_failed(SessionNotFound("no such session"))
    [error] = client(m2)
    assert isinstance(error, Error) and error.code is ErrorCode.SESSION_NOT_FOUND and error.fatal
    assert m2.life.phase is Phase.ENDED and m2.sid is None


def counts(actions: list[Action]) -> dict[Metric, int]:
    found: dict[Metric, int] = {}
    for action in actions:
        if isinstance(action, Count):
            found[action.metric] = found.get(action.metric, 0) + action.by
    return found


def test_what_the_session_counts_goes_out_as_actions() -> None:
    m = machine()
    m.receive(SessionOpen(OpenConfig()), 0.0)
    m.placed(record(W1), W1.url)
    m.worker_frame(LinkOpened(SID, 0), 0.0)
    assert counts(m.actions()) == {Metric.SESSIONS_OPENED: 1}
    for seq in (1, 2):
        m.receive(chunk(seq), 0.0)
    assert counts(m.actions()) == {Metric.CHUNKS_FORWARDED: 2}
    m.link_lost()
    m.placed(record(W2), W2.url)
    m.worker_frame(LinkOpened(SID, 0, finished_seq=None, durable_seq=None), 0.0)
    assert counts(m.actions()) == {Metric.SESSIONS_RESTORED: 1, Metric.CHUNKS_REPLAYED: 2}
    r = machine()
    r.receive(SessionResume(SID, "tok"), 0.0)
    r.looked_up(record(W1), OpenConfig())
    r.worker_found(W1.url)
    r.worker_frame(LinkOpened(SID, 0), 0.0)
    assert counts(r.actions()) == {Metric.SESSIONS_RESUMED: 1}


def test_every_count_names_a_counter_of_the_gateway_metrics() -> None:
    metrics = GatewayMetrics()
    for metric in Metric:
        if metric.value.label is None:
            metrics.count(metric, 2)
            assert metrics.value(metric) == 2, metric
    with pytest.raises(TypeError):
        metrics.count(Metric.ERRORS)  # a Counter of codes, not an int


def test_time_comes_in_with_the_events() -> None:
    """The rate limit and the credential read the event's time, never a clock: a chunk past the burst
    is refused at one instant and served a moment later, the credential starts at the opened's time."""
    values = dataclasses.replace(LIMITS, max_chunks_per_s=2.0, chunk_burst=1)
    guard = FakeGuard()
    m = SessionMachine(
        MachineConfig(values, open_timeout_s=5.0), guard=guard, new_sid=lambda: SID, new_token=lambda: "t"
    )
    m.receive(SessionOpen(OpenConfig()), 100.0)
    m.admitted()
    m.placed(record(W1), W1.url)
    m.worker_frame(LinkOpened(SID, 0), 100.25)
    assert guard.started_at == 100.25
    m.actions()
    m.receive(chunk(1), 100.5)
    m.receive(chunk(2), 100.5)  # the same instant: over the burst
    [error] = client(m)
    assert isinstance(error, Error) and error.code is ErrorCode.RATE_LIMITED and error.seq == 2
    m.receive(chunk(2), 101.0)  # half a second later by the event's own time: a token is back
    assert of(m.actions(), SendWorker) == [SendWorker(LinkChunk(SID, chunk(2)), W1)]
    assert guard.chunks_at == [100.5, 100.5, 101.0]


# ---- the second state axis: a flow's step, checked against the phase (flows.py `STEPS`) -----------


def test_the_flows_reach_every_allowed_phase_step_pair_and_no_other() -> None:
    """Every flow played through each of its steps (open with a retry, resume into a restore with a
    backoff, a lost worker's restore, an unconfirmed close): the (phase, step) pairs they stand in
    are exactly the table's, and none while ACTIVE, IDLE or ENDED."""
    seen: set[tuple[Phase, Step]] = set()

    def play(m: SessionMachine, *events: Callable[[], None]) -> None:
        for event in events:
            event()
            m.actions()
            if m.step is not None:
                seen.add((m.life.phase, m.step))

    o = machine(FakeGuard())
    play(
        o,
        lambda: o.receive(SessionOpen(OpenConfig()), 0.0),  # open.admit
        o.admitted,  # open.place
        lambda: o.placed(record(W1), W1.url),  # open.open
        lambda: o.timer_fired(Timer.REQUEST),  # open.delete, then place again
        o.deleted,
        lambda: o.placed(record(W1), W1.url),
        lambda: o.worker_frame(LinkOpened(SID, 0), 0.0),
        lambda: o.receive(SessionClose(), 0.0),  # close.close
        lambda: o.timer_fired(Timer.CLOSE),  # unconfirmed: close.delete, once the session is gone
        o.deleted,
    )
    assert o.life.phase is Phase.GONE and o.step is None
    r = machine(FakeGuard())
    play(
        r,
        lambda: r.receive(SessionResume(SID, "tok"), 0.0),  # resume.lookup
        lambda: r.looked_up(record(W1), OpenConfig()),  # resume.admit
        r.admitted,  # resume.find_worker
        lambda: r.worker_found(W1.url),  # resume.attach
        lambda: r.worker_frame(LinkError(SID, Error(ErrorCode.SESSION_NOT_FOUND, "gone", fatal=False)), 0.0),
        lambda: r.effect_failed(CapacityExhausted("full")),  # the resume's restore: a backoff
        lambda: r.timer_fired(Timer.BACKOFF),
        lambda: r.placed(record(W2), W2.url),
        lambda: r.worker_frame(LinkOpened(SID, 0), 0.0),
        r.link_lost,  # a session that lost its worker: restored while RESTORING
        lambda: r.effect_failed(CapacityExhausted("full")),
        lambda: r.timer_fired(Timer.BACKOFF),
        lambda: r.placed(record(W1), W1.url),
        lambda: r.worker_frame(LinkOpened(SID, 0), 0.0),
    )
    assert r.life.phase is Phase.ACTIVE and r.step is None
    allowed = {(phase, step) for phase, steps in STEPS.items() for step in steps}
    assert seen == allowed
    every_step = {*OpenStep, *ResumeStep, *RestoreStep, *CloseStep}
    assert {step for _, step in allowed} == every_step and len(allowed) == 16


def test_a_step_its_phase_does_not_allow_is_a_gateway_bug_answered_internal() -> None:
    every_step: list[Step] = [*OpenStep, *ResumeStep, *RestoreStep, *CloseStep]
    for phase in Phase:
        for step in every_step:
            if step in STEPS[phase]:
                check_step(phase, step)
                continue
            with pytest.raises(IllegalTransition) as refused:
                check_step(phase, step)
            assert refused.value.code is ErrorCode.INTERNAL, (phase, step)
    # In the machine: an open's placement answered while the phase is not OPENING (a bug elsewhere)
    # enters no step and queues nothing; the shell answers the raised error as the effect's failure.
    m = machine()
    m.receive(SessionOpen(OpenConfig()), 0.0)
    m.actions()
    m.life.phase = Phase.RESTORING  # set directly: no event can do this
    with pytest.raises(IllegalTransition) as refused:
        m.placed(record(W1), W1.url)
    assert m.actions() == [] and m.step is OpenStep.PLACE and m.worker is None
    m.effect_failed(refused.value)
    [error] = client(m)
    assert isinstance(error, Error) and error.code is ErrorCode.INTERNAL and error.fatal
