"""The one owner of every worker-side session: its phase, the link it answers to, what it remembers.

A session here is one `WorkerSession` in `WorkerSessions`, whatever it is doing: opening, served,
moving to another worker in a drain, switching, handed over, or a copy of another worker's session
warmed here for that worker's drain. Its phase (worker/server/lifecycle.py) changes only through
the owner's methods, each a checked move of the table, so a drain (switchover.py, handover.py), a
copy (warm.py, kv_receiver.py) and the link's frames (service.py) all read and change one state.
The engine's `Session` holds the tokens and the KV; the token log (token_log.py) what Redis holds.

Binding invariant: a live session is bound to at most one link, the last one that opened, attached
or restored it. Its outputs go there and nowhere else; with no link bound (the client went away)
outputs are kept only in the replay buffer, for an `attach` to send again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from shared.protocol.key_limits import AuthLimits
from shared.protocol.link import LinkDone, ToGateway
from shared.protocol.messages import InputChunk, OpenConfig
from worker.server.lifecycle import Phase, SessionLifecycle
from worker.server.restore import REPLAY_DONES, RestorePlan


class LinkPeer(Protocol):
    """The sending half of one gateway's link; `send` never blocks."""

    def send(self, frame: ToGateway) -> None: ...


@dataclass(eq=False)
class WorkerSession:
    sid: str
    lifecycle: SessionLifecycle = field(default_factory=lambda: SessionLifecycle(Phase.OPENING))
    stream: bool = False
    idle_timeout_s: float = 0.0
    link: LinkPeer | None = None
    # Its tokens (a COPY: those its KV covers).
    length: int = 0
    # The last seq the session finished here (None: none yet), as `opened` reports it.
    finished_seq: int | None = None
    # Chunks that arrived while it opened: run in order once it is READY.
    waiting: list[InputChunk] = field(default_factory=list)
    replay: deque[LinkDone] = field(default_factory=lambda: deque(maxlen=REPLAY_DONES))
    # What the session record holds, so this worker can re-write it after Redis lost its data.
    config: OpenConfig = field(default_factory=OpenConfig)
    token_sha256: str | None = None
    created_ms: int = 0
    auth: AuthLimits | None = None
    # Set while a restore opens the session: what `opened` still has to log, answer and run.
    restore: RestorePlan | None = None
    # Set while a fresh session opens with `keep_prefix_text`: its tokens, logged once it is open.
    prefix: list[int] = field(default_factory=list)
    # Chunks submitted to the engine and not answered yet: a switch waits for none (switchover.py).
    in_flight: int = 0
    # Chunks answered here (a drain reports how many it served while the session's copy warmed).
    turns_answered: int = 0
    # A COPY: the link of the draining worker that asked for it (its `warmed` goes there), and
    # whether its KV came over from that worker (kv_receiver.py) rather than from nothing.
    asked_by: LinkPeer | None = None
    kv_imported: bool = False

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    def send(self, frame: ToGateway) -> None:
        if self.link is not None:
            self.link.send(frame)

    def record(self, done: LinkDone) -> None:
        self.replay.append(done)
        self.length = done.length
        self.finished_seq = done.done.seq

    def missed(self, seen_seq: int | None) -> list[LinkDone]:
        """The dones after the last one the client saw, as far as the replay buffer reaches."""
        return [d for d in self.replay if seen_seq is None or d.done.seq > seen_seq]


class WorkerSessions:
    """Every worker-side session by id, and every change of phase (a checked lifecycle move)."""

    def __init__(self) -> None:
        self._sessions: dict[str, WorkerSession] = {}
        # Sessions with traffic since the last heartbeat: their Redis TTLs get refreshed then.
        self.touched: set[str] = set()

    # ---- reading --------------------------------------------------------------------------------

    def get(self, sid: str) -> WorkerSession | None:
        """The live session `sid` (held here for a client), or None."""
        session = self._sessions.get(sid)
        return session if session is not None and session.lifecycle.live else None

    def entry(self, sid: str) -> WorkerSession | None:
        """Whatever this worker has under `sid` (a live session, a copy, one handed over)."""
        return self._sessions.get(sid)

    def copy(self, sid: str) -> WorkerSession | None:
        session = self._sessions.get(sid)
        return session if session is not None and session.phase is Phase.COPY else None

    def live(self) -> list[WorkerSession]:
        return [s for s in self._sessions.values() if s.lifecycle.live]

    def copies(self) -> Iterator[WorkerSession]:
        return (s for s in list(self._sessions.values()) if s.phase is Phase.COPY)

    # ---- a client's session ---------------------------------------------------------------------

    def open(self, session: WorkerSession) -> None:
        """A new session, OPENING (a fresh open or a restore with no copy here to take over)."""
        assert session.phase is Phase.OPENING
        self._replace(session)
        self.touched.add(session.sid)

    def adopt(self, sid: str) -> WorkerSession | None:
        """A restore of `sid` takes over the copy warmed here: COPY -> OPENING; None: no copy."""
        copy = self.copy(sid)
        if copy is None:
            return None
        copy.lifecycle.move(Phase.OPENING)
        copy.asked_by = None
        self.touched.add(sid)
        return copy

    def opened(self, session: WorkerSession) -> None:
        session.lifecycle.move(Phase.READY)

    def close(self, sid: str) -> WorkerSession | None:
        """The live session `sid` is over here (closed, expired, failed to open): CLOSED."""
        session = self.get(sid)
        if session is None:
            return None
        self._end(session)
        return session

    # ---- a drain --------------------------------------------------------------------------------

    def start_moving(self, session: WorkerSession) -> None:
        """A drain asks for its copy elsewhere; it is served here until the switch."""
        session.lifecycle.move(Phase.MOVING)

    def switch(self, session: WorkerSession) -> None:
        """Its copy is warm: from now on its chunks wait in the gateway's tail."""
        session.lifecycle.move(Phase.SWITCHING)

    def hand_over(self, session: WorkerSession) -> LinkPeer | None:
        """`migrate` goes out for it: it answers nothing more here; its link (None: detached)."""
        session.lifecycle.move(Phase.HANDED_OVER)
        self.touched.discard(session.sid)
        link, session.link = session.link, None
        return link

    # ---- copies of other workers' sessions ------------------------------------------------------

    def add_copy(self, sid: str, asked_by: LinkPeer | None, *, kv_imported: bool = False) -> WorkerSession:
        copy = WorkerSession(sid, SessionLifecycle(Phase.COPY), asked_by=asked_by, kv_imported=kv_imported)
        self._replace(copy)
        return copy

    def drop_copy(self, sid: str, copy: WorkerSession | None = None) -> bool:
        """The copy of `sid` (that one, when given) ends: COPY -> CLOSED; False: no such copy."""
        current = self.copy(sid)
        if current is None or (copy is not None and current is not copy):
            return False
        self._end(current)
        return True

    # ---- links and TTLs -------------------------------------------------------------------------

    def unbind_link(self, link: LinkPeer) -> int:
        count = 0
        for session in self.live():
            if session.link is link:
                session.link = None
                count += 1
        return count

    def take_touched(self) -> dict[str, float]:
        """The touched live sessions and their idle timeouts, clearing the set."""
        touched = {}
        for sid in self.touched:
            session = self.get(sid)
            if session is not None:
                touched[sid] = session.idle_timeout_s
        self.touched.clear()
        return touched

    def _replace(self, session: WorkerSession) -> None:
        previous = self._sessions.get(session.sid)
        if previous is not None and previous.phase not in (Phase.CLOSED, Phase.HANDED_OVER):
            raise ValueError(f"session {session.sid} is already here ({previous.phase.value})")
        self._sessions[session.sid] = session

    def _end(self, session: WorkerSession) -> None:
        session.lifecycle.move(Phase.CLOSED)
        self.touched.discard(session.sid)
        if self._sessions.get(session.sid) is session:
            del self._sessions[session.sid]
