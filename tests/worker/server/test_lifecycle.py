"""The worker-side session's phase table (worker/server/lifecycle.py) and its one owner (sessions.py)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import redis.asyncio as redis

from shared.protocol.link import LinkMigrate, ToGateway
from shared.store.log_format import NO_SEQ, encode_log_record
from shared.store.schema import KeySchema
from worker.server.lifecycle import (
    HELD_ELSEWHERE,
    LIVE,
    SERVED,
    TRANSITIONS,
    IllegalTransition,
    Phase,
    SessionLifecycle,
)
from worker.server.sessions import WorkerSession, WorkerSessions
from worker.server.token_log import TokenLogWriter
from worker.tokenizer.incremental import EMPTY_TAIL

REPO = Path(__file__).resolve().parents[3]


def owner() -> WorkerSessions:
    """An owner whose log writer never reaches Redis here (only a flush would: none runs)."""
    client = redis.Redis(host="127.0.0.1", port=1)  # made, never connected
    return WorkerSessions(TokenLogWriter(client, KeySchema(), grace_s=1.0, worker_id="w"))


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
    (Phase.MOVING, Phase.READY),  # a rebalance's copy failed or was late: the session stays
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
    assert {Phase.READY, Phase.MOVING, Phase.SWITCHING} == SERVED


class Link:
    def __init__(self) -> None:
        self.frames: list[ToGateway] = []

    def send(self, frame: ToGateway) -> None:
        self.frames.append(frame)


def test_a_drain_moves_a_session_through_its_owner_and_it_stays_known_as_handed_over() -> None:
    sessions, link = owner(), Link()
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
    sessions, asking = owner(), Link()
    copy = sessions.add_copy("c", asking, kv_imported=True)
    assert sessions.get("c") is None and sessions.copy("c") is copy and list(sessions.copies()) == [copy]
    with pytest.raises(ValueError):
        sessions.add_copy("c", asking)  # one copy per id
    assert sessions.adopt("c", log=b"", durable_seq=None) is copy
    assert copy.phase is Phase.OPENING and copy.asked_by is None
    assert sessions.get("c") is copy and sessions.adopt("c", log=b"", durable_seq=None) is None
    assert not sessions.drop_copy("c")  # no longer a copy: the live session stays
    other = sessions.add_copy("d", asking)
    assert not sessions.drop_copy("d", WorkerSession("d"))  # only that copy
    assert sessions.drop_copy("d", other) and sessions.entry("d") is None and other.phase is Phase.CLOSED


def test_a_turn_is_logged_only_while_its_session_is_served_here() -> None:
    sessions, link = owner(), Link()
    writer = sessions.log_writer
    session = WorkerSession("s", link=link, idle_timeout_s=5.0)
    sessions.open(session, log=b"", durable_seq=None)
    assert not sessions.log_turn(session, 1, (1,), (2,), tail=EMPTY_TAIL)  # still opening
    assert writer.unflushed() == 0
    sessions.opened(session)
    assert sessions.log_turn(session, NO_SEQ, (7,), (), tail=EMPTY_TAIL)  # a system prompt: no turn
    assert sessions.log_turn(session, 1, (1,), (2,), tail=EMPTY_TAIL)
    sessions.start_moving(session)
    assert sessions.log_turn(session, 2, (3,), (4,), tail=EMPTY_TAIL)  # served while its copy warms
    sessions.switch(session)
    assert sessions.log_rewind(session, 2, EMPTY_TAIL)  # a turn in flight at the switch ends here
    assert writer.unflushed() == 1 and sessions.held() == [(session, b"")]
    with pytest.raises(IllegalTransition):
        sessions.release(session, "w2")  # only once it is handed over
    assert sessions.hand_over(session) is link
    # Handed over: a turn that ends now re-runs on the next worker, so nothing more is logged.
    assert not sessions.log_turn(session, 3, (5,), (6,), tail=EMPTY_TAIL)
    assert not sessions.log_rewind(session, 1, EMPTY_TAIL)
    assert sessions.release(session, "w2") == LinkMigrate("s", None, "w2")  # nothing flushed here
    assert writer.unflushed() == 0 and writer.held_logs() == {}  # the next worker writes it now


def test_a_restore_starts_the_log_from_what_redis_holds_and_a_close_drops_it() -> None:
    sessions = owner()
    writer = sessions.log_writer
    session = WorkerSession("r")
    logged = encode_log_record(4, (1, 2, 3))
    sessions.open(session, log=logged, durable_seq=4)
    assert sessions.durable_seq(session) == 4 and writer.held_logs() == {"r": logged}
    sessions.opened(session)
    assert sessions.log_turn(session, 5, (1,), (), tail=EMPTY_TAIL)
    assert sessions.close("r") is session and session.phase is Phase.CLOSED
    assert not sessions.log_turn(session, 6, (1,), (), tail=EMPTY_TAIL)
    assert writer.unflushed() == 0 and writer.held_logs() == {} and sessions.durable_seq(session) is None
    copy = sessions.add_copy("c", None, kv_imported=True)
    assert sessions.adopt("c", log=encode_log_record(9, (5,)), durable_seq=9) is copy
    assert sessions.durable_seq(copy) == 9


# The token log writer's per-session methods: only the owner calls them (sessions.py says why).
PER_SESSION = re.compile(r"\.(start|append|append_rewind|drop|forget|durable_seq)\(")


def test_only_the_owner_calls_the_token_log_writer_per_session() -> None:
    offending = []
    for path in sorted((REPO / "worker").rglob("*.py")):
        if path.name in ("sessions.py", "token_log.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(token_log|log_writer|_log)\b", line) and PER_SESSION.search(line):
                offending.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offending == []
    assert PER_SESSION.search("self.token_log.append(sid, seq)")  # the check sees a direct call
