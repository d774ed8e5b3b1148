"""The one owner of every worker-side session: its phase, the link it answers to, what it remembers.

A session here is one `WorkerSession` in `WorkerSessions`, whatever it is doing: opening, served,
moving to another worker in a drain, switching, handed over, or a copy of another worker's session
warmed here for that worker's drain. Its phase (worker/server/lifecycle.py) changes only through
the owner's methods, each a checked move of the table, so a drain (switchover.py, handover.py), a
copy (warm.py, kv_receiver.py) and the link's frames (service.py) all read and change one state.
The engine's `Session` holds the tokens and the KV.

Its token log (token_log.py: what Redis holds, and this worker's mirror of it) is the owner's too:
a log starts when the session opens, takes a turn only while the session is served here, and is
dropped when it ends or is handed over, each in the same method as that move, so no caller can log
a turn for a session handed over or forget a log it still writes. Nothing else calls the writer's
per-session methods (tests/worker/server/test_lifecycle.py checks the source); what is not one
session's (the flush task, the heartbeat's repair of a Redis that lost data) uses `log_writer`.

Binding invariant: a live session is bound to at most one link, the last one that opened, attached
or restored it. Its outputs go there and nowhere else; with no link bound (the client went away)
outputs are kept only in the replay buffer, for an `attach` to send again.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final, Protocol

from shared.protocol.key_limits import AuthLimits
from shared.protocol.link import LinkDone, LinkMigrate, ToGateway
from shared.protocol.messages import InputChunk, OpenConfig
from shared.store.log_format import Cut
from worker.server.lifecycle import SERVED, IllegalTransition, Phase, SessionLifecycle
from worker.server.restore import REPLAY_DONES, RestorePlan
from worker.server.token_log import TokenLogWriter
from worker.tokenizer.incremental import TextTail

# While Redis refuses a flush, `flush_durably` asks again this often.
DURABLE_RETRY_S: Final = 0.05


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
    """Every worker-side session by id, every change of phase (a checked lifecycle move), and
    every session's token log."""

    def __init__(self, log: TokenLogWriter) -> None:
        self._sessions: dict[str, WorkerSession] = {}
        self._log = log
        # Sessions with traffic since the last heartbeat: their Redis TTLs get refreshed then.
        self.touched: set[str] = set()

    @property
    def log_writer(self) -> TokenLogWriter:
        """The writer itself, for what is no one session's: its flush task, the final flush, the
        heartbeat's re-write of what Redis lost (its lock, its damaged set)."""
        return self._log

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

    def durable_seq(self, session: WorkerSession) -> int | None:
        """The last seq of the session whose turn Redis is known to hold (None: none yet)."""
        return self._log.durable_seq(session.sid)

    def held(self) -> list[tuple[WorkerSession, bytes]]:
        """Each live session with its log as Redis should hold it (confirmed flushes only)."""
        logs = self._log.held_logs()
        return [(s, logs[s.sid]) for s in self.live() if s.sid in logs]

    # ---- a client's session ---------------------------------------------------------------------

    def open(self, session: WorkerSession, *, log: bytes = b"", durable_seq: int | None = None) -> None:
        """A new session, OPENING (a fresh open or a restore with no copy here to take over); its
        log starts from `log`, what Redis holds for it (a restore's; up to `durable_seq`)."""
        assert session.phase is Phase.OPENING
        self._replace(session)
        self.touched.add(session.sid)
        self._log.start(session.sid, log, durable_seq)

    def adopt(self, sid: str, *, log: bytes, durable_seq: int | None) -> WorkerSession | None:
        """A restore of `sid` takes over the copy warmed here: COPY -> OPENING, its log started
        as `open` starts one; None: no copy."""
        copy = self.copy(sid)
        if copy is None:
            return None
        copy.lifecycle.move(Phase.OPENING)
        copy.asked_by = None
        self.touched.add(sid)
        self._log.start(sid, log, durable_seq)
        return copy

    def opened(self, session: WorkerSession) -> None:
        session.lifecycle.move(Phase.READY)

    def bind(self, session: WorkerSession, link: LinkPeer) -> LinkPeer | None:
        """`link` opened, attached or restored the live session: its outputs go there from now on;
        the link it was bound to before (None: none)."""
        previous, session.link = session.link, link
        self.touched.add(session.sid)
        return previous

    def detach(self, session: WorkerSession, link: LinkPeer) -> None:
        """`link` lets the session go (its client went away): outputs wait in the replay buffer."""
        if session.link is link:
            session.link = None

    def log_turn(
        self,
        session: WorkerSession,
        seq: int,
        inputs: tuple[int, ...],
        outputs: tuple[int, ...],
        *,
        tail: TextTail,
        cut: Cut | None = None,
    ) -> bool:
        """A turn answered here (or tokens of no turn, `NO_SEQ`) joins the session's log, queued for
        the next flush, and its keys' TTLs are refreshed at the next beat. False, logging nothing:
        the session is no longer served here (it ended, or was handed over: a turn ending after
        that re-runs on its next worker)."""
        if self._sessions.get(session.sid) is not session or session.phase not in SERVED:
            return False
        self._log.append(session.sid, seq, inputs, outputs, session.idle_timeout_s, tail=tail, cut=cut)
        self.touched.add(session.sid)
        return True

    def log_rewind(self, session: WorkerSession, length: int, tail: TextTail) -> bool:
        """The session's history was taken back to its first `length` tokens (`tail` held back):
        logged after every turn so far, queued for the next flush; False as `log_turn`."""
        if self._sessions.get(session.sid) is not session or session.phase not in SERVED:
            return False
        self._log.append_rewind(session.sid, length, tail, session.idle_timeout_s)
        return True

    async def flush(self) -> bool:
        """Make every log's queued turns durable; False when Redis refused (they stay queued).
        True means every turn logged before the call is durable (token_log.py `flush`)."""
        return await self._log.flush()

    async def flush_durably(self) -> None:
        """`flush` until Redis takes it: a drain's switch or handover must not name a target before
        every turn it answered here is durable, so while Redis is down it waits for it to be back."""
        while not await self.flush():
            await asyncio.sleep(DURABLE_RETRY_S)

    def close(self, sid: str) -> WorkerSession | None:
        """The live session `sid` is over here (closed, expired, failed to open): CLOSED; its
        queued turns are dropped with its log here (`forget` deletes its keys)."""
        session = self.get(sid)
        if session is None:
            return None
        self._end(session)
        self._log.drop(sid)
        return session

    async def forget(self, sid: str) -> None:
        """A session closed here: its Redis keys go, when its record still names this worker (one
        this worker lost track of may live on elsewhere by now)."""
        await self._log.forget(sid)

    # ---- a drain or a rebalance ------------------------------------------------------------------

    def start_moving(self, session: WorkerSession) -> None:
        """A drain or a rebalance asks for its copy elsewhere; it is served here until the switch."""
        session.lifecycle.move(Phase.MOVING)

    def stay(self, session: WorkerSession) -> None:
        """A rebalance's copy failed or was late: it is served here as before, as if never asked."""
        session.lifecycle.move(Phase.READY)

    def switch(self, session: WorkerSession) -> None:
        """Its copy is warm: from now on its chunks wait in the gateway's tail."""
        session.lifecycle.move(Phase.SWITCHING)

    def hand_over(self, session: WorkerSession) -> LinkPeer | None:
        """`migrate` goes out for it: it answers and logs nothing more here (a turn that ends after
        this re-runs on its next worker); its link (None: detached)."""
        session.lifecycle.move(Phase.HANDED_OVER)
        self.touched.discard(session.sid)
        link, session.link = session.link, None
        return link

    def release(self, session: WorkerSession, target: str | None) -> LinkMigrate:
        """A session handed over whose log a flush has made durable since: the `migrate` that sends
        its gateway on from the log's durable seq (to `target`, where its copy is; None: anywhere);
        its log is forgotten here, the next worker writes it from now on."""
        if session.phase is not Phase.HANDED_OVER:
            raise IllegalTransition(f"worker session: {session.phase.value} is released before its handover")
        frame = LinkMigrate(session.sid, self._log.durable_seq(session.sid), target)
        self._log.drop(session.sid)
        return frame

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
