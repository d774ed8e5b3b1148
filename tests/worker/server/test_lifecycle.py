"""The worker-side session's phase table (worker/server/lifecycle.py) and its one owner (sessions.py)."""

from __future__ import annotations

import itertools

import pytest

from shared.protocol.link import ToGateway
from worker.server.lifecycle import (
    HELD_ELSEWHERE,
    LIVE,
    TRANSITIONS,
    IllegalTransition,
    Phase,
    SessionLifecycle,
)
from worker.server.sessions import WorkerSession, WorkerSessions

# Every move the table allows, written out: a change to the table must change this list too.
ALLOWED = {
    (Phase.OPENING, Phase.READY),
    (Phase.OPENING, Phase.HANDED_OVER),
    (Phase.OPENING, Phase.CLOSED),
    (Phase.READY, Phase.MOVING),
    (Phase.READY, Phase.HANDED_OVER),
    (Phase.READY, Phase.CLOSED),
    (Phase.MOVING, Phase.SWITCHING),
    (Phase.MOVING, Phase.HANDED_OVER),
    (Phase.MOVING, Phase.CLOSED),
    (Phase.SWITCHING, Phase.HANDED_OVER),
    (Phase.SWITCHING, Phase.CLOSED),
    (Phase.COPY, Phase.OPENING),
    (Phase.COPY, Phase.CLOSED),
}


def test_the_table_allows_exactly_the_listed_moves_and_refuses_every_other() -> None:
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == ALLOWED
    for source, target in itertools.product(Phase, Phase):
        lifecycle = SessionLifecycle(source)
        if (source, target) in ALLOWED:
            lifecycle.move(target)
            assert lifecycle.phase is target
        else:
            with pytest.raises(IllegalTransition):
                lifecycle.move(target)
            assert lifecycle.phase is source  # a refused move changes nothing


def test_handed_over_and_closed_are_final_and_only_served_phases_are_live() -> None:
    assert TRANSITIONS[Phase.HANDED_OVER] == TRANSITIONS[Phase.CLOSED] == frozenset()
    assert {Phase.OPENING, Phase.READY, Phase.MOVING, Phase.SWITCHING} == LIVE
    assert {Phase.SWITCHING, Phase.HANDED_OVER} == HELD_ELSEWHERE


class Link:
    def __init__(self) -> None:
        self.frames: list[ToGateway] = []

    def send(self, frame: ToGateway) -> None:
        self.frames.append(frame)


def test_a_drain_moves_a_session_through_its_owner_and_it_stays_known_as_handed_over() -> None:
    sessions, link = WorkerSessions(), Link()
    session = WorkerSession("s", link=link)
    sessions.open(session)
    assert sessions.get("s") is session and "s" in sessions.touched
    with pytest.raises(IllegalTransition):
        sessions.switch(session)  # only a moving session switches
    sessions.opened(session)
    sessions.start_moving(session)
    sessions.switch(session)
    assert sessions.get("s") is session  # still live: its chunks in flight finish here
    assert sessions.hand_over(session) is link and session.link is None
    assert sessions.get("s") is None and sessions.entry("s") is session
    assert session.phase is Phase.HANDED_OVER and sessions.take_touched() == {}


def test_a_copy_is_no_live_session_until_a_restore_adopts_it() -> None:
    sessions, asking = WorkerSessions(), Link()
    copy = sessions.add_copy("c", asking, kv_imported=True)
    assert sessions.get("c") is None and sessions.copy("c") is copy and list(sessions.copies()) == [copy]
    with pytest.raises(ValueError):
        sessions.add_copy("c", asking)  # one copy per id
    assert sessions.adopt("c") is copy and copy.phase is Phase.OPENING and copy.asked_by is None
    assert sessions.get("c") is copy and sessions.adopt("c") is None
    assert not sessions.drop_copy("c")  # no longer a copy: the live session stays
    other = sessions.add_copy("d", asking)
    assert not sessions.drop_copy("d", WorkerSession("d"))  # only that copy
    assert sessions.drop_copy("d", other) and sessions.entry("d") is None and other.phase is Phase.CLOSED
