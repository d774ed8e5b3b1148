"""One client socket's session as a Sans-I/O state machine: events in, actions out.

Why this shape (websockets' `Protocol` is the model): every decision about a session on this
gateway is here, in one class, with no I/O, no clock and no event loop, so each event and the
transition it causes can be read in one place and tested by playing events and reading actions
(tests/gateway/test_session_machine.py). It is a function of its inputs: time comes in with the
events (a client message's `received`, a worker frame's `arrived`: monotonic seconds), and what it
counts goes out as `Count` actions; it reads no clock and moves no metric (tests/test_architecture.py
checks both in the source of the machine's modules and of its credential, session_auth.py). The
asyncio shell (client_session.py, beside it) only moves bytes: it decodes client frames, routes
worker frames, reads the clocks, performs the effects, the timers and the counts (actions.py) and
answers each effect with its result method.

Events: a client message (`receive`), a frame the client sent that could not be decoded
(`refuse`), a worker frame (`worker_frame`), the link lost or the session taken over, a send that
failed, an effect's result (`placed`, `looked_up`, `worker_found`, `deleted`, `admitted`,
`effect_failed`), a timer, the socket gone (`socket_closed`). Each may queue actions; the caller
drains them with `actions()`, in order.

The flows (docs/design.md section 5): open = [admit] -> place -> `open` -> `opened`; resume = look up
-> [admit] -> find its worker -> `attach` -> `opened`, or a restore; restore = (pause) -> move ->
`restore` with the undurable turns -> `opened`, up to `RESTORE_BACKOFF_S` attempts; close = `close`
-> `closed`, or, unconfirmed, delete. One effect at a time: a flow waits for its result.

Invariants:
- The phase changes only through `self.life` (lifecycle.py: the table of allowed moves).
- Every check that can refuse a chunk runs before it is forwarded: a refused chunk changes nothing.
- A chunk forwarded (or held while the session moves) is in flight until its `done` or `error`,
  and in the undurable turns until its turn is durable (turns.py): a restore re-runs it, so every
  chunk gets exactly one `output.done` (docs/failover.md). Held chunks are queued to the new worker
  right after its `opened`, before any later chunk.
- `busy` is True while a flow the client asked for (open, resume, close) runs: the shell reads no
  further client message until it is False, so a client's messages are served in order.
- The session is bound to a worker's link (`Bind`) before a request is sent there, so its answer
  cannot arrive unrouted; a request that got no answer unbinds it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.limits import LimitValues
from gateway.session.actions import (
    Action,
    AdmitOpen,
    AdmitResume,
    ArmTimer,
    Bind,
    CancelTimer,
    CloseSocket,
    Count,
    Delete,
    EndOnWorker,
    FindWorker,
    Lookup,
    Metric,
    Move,
    Place,
    ReleaseAuth,
    SendClient,
    SendWorker,
    Timer,
    Unbind,
    WorkerRef,
)
from gateway.session.flow import (
    PLACEMENT_ATTEMPTS,
    RESTORE_BACKOFF_S,
    STORE_RETRY_MS,
    Flow,
    Origin,
    Reply,
    Step,
)
from gateway.session.guard import Expire, SessionGuard, Verdict
from gateway.session.lifecycle import Phase, Request, SessionLifecycle
from gateway.session.turns import Turns
from shared.errors import (
    CapacityExhausted,
    MicroturnError,
    SessionExpired,
    SessionNotFound,
    WorkerUnavailable,
)
from shared.protocol.close_codes import CLOSE_NORMAL, close_code_for, error_message_from
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
    ToGateway,
    ToWorker,
)
from shared.protocol.messages import (
    ClientMessage,
    CloseReason,
    InputChunk,
    OpenConfig,
    OutputCancel,
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
)

if TYPE_CHECKING:
    from shared.store.registry import SessionRecord

logger = logging.getLogger(__name__)

_CHUNK_FORWARDED = Count(Metric.CHUNKS_FORWARDED)  # one per forwarded chunk: built once (hot path)


@dataclass(frozen=True, slots=True)
class MachineConfig:
    """The gateway settings one session uses (read once, in the shell)."""

    limits: LimitValues
    open_timeout_s: float


class SessionMachine:
    def __init__(
        self,
        config: MachineConfig,
        *,
        guard: SessionGuard | None = None,
        new_sid: Callable[[], str],
        new_token: Callable[[], str],
    ) -> None:
        limits = config.limits
        if guard is not None and 0 < guard.chunks_per_s < limits.max_chunks_per_s:
            limits = dataclasses.replace(limits, max_chunks_per_s=guard.chunks_per_s)  # the key's caps
        self._cfg = config
        self._guard = guard
        self._new_sid, self._new_token = new_sid, new_token
        # The time of the event being handled (monotonic s): the only clock the rate limit reads.
        self._now = 0.0
        self.turns = Turns(limits, self._event_time)
        self.life = SessionLifecycle()
        self._out: list[Action] = []
        self.sid: str | None = None
        self.config = OpenConfig()
        self._record: SessionRecord | None = None
        self._token = ""  # a new session's resume token, until `session.opened` carries it
        self.worker: WorkerRef | None = None  # the worker the session is bound to (or being placed on)
        self._bound = False
        self._flow: Flow | None = None
        self._close_deferred = False  # `session.close` while restoring: served once the restore ends
        # The last seq the session finished, as this socket knows it (the worker's at `opened`, then
        # each done): every done up to it has been queued for the client; a chunk at or below it can
        # only be refused.
        self._warning: SessionExpiring | None = None  # the credential's deadline, once armed
        self._expiry: Expire | None = None

    # ---- the caller's side -----------------------------------------------------------------------

    def actions(self) -> list[Action]:
        """The actions queued since the last call, in order."""
        out, self._out = self._out, []
        return out

    @property
    def busy(self) -> bool:
        """A flow the client asked for runs: read its next message only once this is False."""
        return (
            self.life.phase in (Phase.OPENING, Phase.CLOSING)
            or self._close_deferred
            or self.flow is Step.DELETE_AFTER_CLOSE
        )

    @property
    def flow(self) -> Step | None:
        return None if self._flow is None else self._flow.step

    # ---- client messages -------------------------------------------------------------------------

    def _event_time(self) -> float:
        return self._now

    def receive(self, msg: ClientMessage, received: float) -> None:
        """One decoded client message, `received` at that monotonic time; every refusal is answered
        here as a typed error."""
        self._now = received
        seq = msg.seq if isinstance(msg, InputChunk | OutputCancel) else None
        try:
            if isinstance(msg, InputChunk):
                self._chunk(msg, received)
            elif isinstance(msg, Ping):
                self._to_client(Pong(msg.data))
            elif isinstance(msg, OutputCancel):
                self._cancel(msg)
            elif isinstance(msg, SessionOpen):
                self._open(msg.config)
            elif isinstance(msg, SessionResume):
                self._resume(msg)
            elif isinstance(msg, SessionClose):
                self._close()
        except MicroturnError as exc:
            self._error(exc, seq)

    def refuse(self, exc: MicroturnError, *, fatal: bool | None = None) -> None:
        """A client frame that could not be decoded (or was too large), or could not be served."""
        self._error(exc, fatal=fatal)

    def _chunk(self, msg: InputChunk, received: float) -> None:
        sid, worker, phase = self.sid, self.worker, self.life.phase
        self.life.check(Request.CHUNK)  # served while ACTIVE, and held while RESTORING
        assert sid is not None and worker is not None, "an active session has a worker"
        self.turns.check_seq(msg)
        if self._guard is not None:
            self._guard.check_chunk(received)
        limit = msg.max_output_tokens if msg.max_output_tokens is not None else self.config.max_output_tokens
        frame = LinkChunk(sid, msg)
        # Held while RESTORING: it goes to the new worker with the tail, or right after its restore.
        held = phase is Phase.RESTORING
        self.turns.admit(msg, wants_output=limit > 0, received=received, frame=frame, sent=not held)
        if not held:
            self._out += (SendWorker(frame, worker), _CHUNK_FORWARDED)

    def _cancel(self, msg: OutputCancel) -> None:
        self.life.check(Request.CANCEL)
        assert self.sid is not None and self.worker is not None, "an active session has a worker"
        self._out.append(SendWorker(LinkCancel(self.sid, msg.seq), self.worker))

    # ---- open --------------------------------------------------------------------------------------

    def _open(self, config: OpenConfig) -> None:
        self.life.check(Request.OPEN)
        self.life.move(Phase.OPENING)
        self.sid, self.config, self._token = self._new_sid(), config, self._new_token()
        if self._guard is not None:
            self._flow = Flow(Step.ADMIT_OPEN)
            self._out.append(AdmitOpen(self.sid))
        else:
            self._place_new(Flow(Step.PLACE))

    def _place_new(self, flow: Flow) -> None:
        assert self.sid is not None
        flow.step, flow.attempt = Step.PLACE, flow.attempt + 1
        self._flow = flow
        grant = self._guard.grant() if self._guard is not None else None
        self._out.append(Place(self.sid, self._token, self.config, grant))

    def _opened_reply(self, model: str) -> Reply:
        sid, token = self.sid, self._token
        assert sid is not None
        limits = self.turns.limits.values.as_map()
        if self._guard is not None:
            limits.update(self._guard.limits_map())
        return lambda opened: [SessionOpened(sid, token, model, limits)]

    # ---- resume ------------------------------------------------------------------------------------

    def _resume(self, msg: SessionResume) -> None:
        self.life.check(Request.OPEN)
        self.life.move(Phase.OPENING)
        self.sid = msg.session_id
        self._flow = Flow(Step.LOOKUP, origin=Origin.RESUME, seen_seq=msg.last_seq)
        self._out.append(Lookup(msg.session_id, msg.resume_token))

    def looked_up(self, record: SessionRecord, config: OpenConfig) -> None:
        if not self._expects(Step.LOOKUP):
            return
        assert self.sid is not None
        self._record, self.config = record, config
        if self._guard is not None:
            self._step(Step.ADMIT_RESUME, AdmitResume(self.sid, record.created_ms, record.auth))
        else:
            self._step(Step.FIND_WORKER, FindWorker(record.worker))

    def admitted(self) -> None:
        if self._expects(Step.ADMIT_OPEN):
            self._place_new(Flow(Step.PLACE))
        elif self._expects(Step.ADMIT_RESUME):
            assert self._record is not None
            self._step(Step.FIND_WORKER, FindWorker(self._record.worker))

    def worker_found(self, url: str | None) -> None:
        if not self._expects(Step.FIND_WORKER):
            return
        assert self.sid is not None and self._record is not None and self._flow is not None
        if url is None:  # its worker is gone: rebuild the session elsewhere
            self._restore(Origin.RESUME)
            return
        sid = self.sid

        def resumed(opened: LinkOpened) -> list[ServerMessage]:
            return [SessionResumed(sid, opened.length, opened.finished_seq)]

        self._request(
            Step.ATTACH, WorkerRef(url, self._record.worker), LinkAttach(sid, self._flow.seen_seq), resumed
        )

    # ---- restore -----------------------------------------------------------------------------------

    def _restore(self, origin: Origin, *, target: str | None = None) -> None:
        """Place the session on a live worker and rebuild it there from its token log and tail;
        first on `target` (the worker a draining one warmed a copy on), if it can take it."""
        assert self.sid is not None
        sid = self.sid
        if origin is Origin.RESUME:
            assert self._flow is not None
            seen = self._flow.seen_seq

            def reply(opened: LinkOpened) -> list[ServerMessage]:
                return [
                    SessionResumed(sid, opened.length, opened.finished_seq),
                    SessionRestored(sid, opened.length),
                ]

        else:
            # Every done up to the finished seq has been queued for the client: it is what it saw.
            seen = self.turns.finished_seq

            def reply(opened: LinkOpened) -> list[ServerMessage]:
                return [SessionRestored(sid, opened.length)]

        self._flow = Flow(Step.MOVE, origin=origin, seen_seq=seen, reply=reply, target=target)
        self._move_attempt()

    def _move_attempt(self) -> None:
        flow = self._flow
        assert flow is not None and self.sid is not None and self._record is not None
        if flow.attempt >= len(RESTORE_BACKOFF_S):
            self._restore_failed(flow.last or WorkerUnavailable("no worker could take the session"))
            return
        delay = RESTORE_BACKOFF_S[flow.attempt]
        flow.attempt += 1
        if delay:
            flow.step = Step.BACKOFF
            self._out.append(ArmTimer(Timer.BACKOFF, delay))
        else:
            flow.step = Step.MOVE
            target = flow.target if flow.attempt == 1 else None  # a retry goes wherever placement says
            self._out.append(Move(self.sid, self._record, self.config, target))

    def placed(self, record: SessionRecord, url: str) -> None:
        """`Place` or `Move` wrote the record naming the worker at `url`: send it the request."""
        flow = self._flow
        if flow is None or flow.step not in (Step.PLACE, Step.MOVE) or self.sid is None:
            return
        sid, worker = self.sid, WorkerRef(url, record.worker)
        self._record = record
        if flow.step is Step.PLACE:
            frame: ToWorker = LinkOpen(
                sid, self.config, (), record.token_sha256, record.created_ms, record.auth
            )
            self._request(Step.OPEN, worker, frame, self._opened_reply(record.model))
            return
        tail = self.turns.undurable.snapshot()
        flow.replayed = len(tail)
        restore = LinkRestore(
            sid, self.config, None, flow.seen_seq, record.token_sha256, record.created_ms, tail, record.auth
        )
        self._request(Step.RESTORE, worker, restore, flow.reply or (lambda opened: []))

    def _restore_failed(self, exc: MicroturnError) -> None:
        flow = self._flow
        assert flow is not None
        if flow.origin is Origin.RESUME:
            self._fail_open(exc)
            return
        # Fatal for this socket, not for the session: its record and log stay, so a later
        # session.resume (when a worker has room again) restores it.
        logger.warning("could not restore session %s: %s", self.sid, exc)
        self._flow = None
        self._unbind()
        self.life.end_session()
        self._error(exc, fatal=True)
        self._after_restore()

    def _after_restore(self) -> None:
        if self._close_deferred:
            self._close_deferred = False
            try:
                self._close()
            except MicroturnError as exc:
                self._error(exc)

    def _move(self, why: str, *, target: str | None = None) -> None:
        """The session leaves its worker (lost or draining): restore it elsewhere with its tail."""
        if self.life.phase is not Phase.ACTIVE or self.sid is None or self._record is None:
            return
        logger.warning(
            "session %s leaves its worker (%s); restoring with %d undurable chunk(s)",
            self.sid,
            why,
            len(self.turns.undurable),
        )
        self._unbind()  # the old worker's late frames are not ours any more
        self.life.move(Phase.RESTORING)
        self._restore(Origin.MOVE, target=target)

    # ---- requests to a worker ------------------------------------------------------------------------

    def _request(self, step: Step, worker: WorkerRef, frame: ToWorker, reply: Reply) -> None:
        assert self.sid is not None and self._flow is not None
        self._flow.step, self._flow.reply, self._flow.frame = step, reply, frame
        self.worker = worker
        self._bound = True
        self._out += [
            Bind(self.sid, worker),
            SendWorker(frame, worker),
            ArmTimer(Timer.REQUEST, self._cfg.open_timeout_s),
        ]

    def _opened(self, frame: LinkOpened) -> None:
        flow = self._flow
        if flow is None or flow.step not in (Step.OPEN, Step.ATTACH, Step.RESTORE) or flow.reply is None:
            logger.warning("unexpected opened for session %s", frame.sid)
            return
        self._out.append(CancelTimer(Timer.REQUEST))
        for message in flow.reply(frame):  # queued before any frame that follows `opened`
            self._to_client(message)
        self._flow = None
        assert self.worker is not None and self._record is not None
        self.turns.opened(frame)
        if flow.step is Step.RESTORE:
            self.turns.undurable.durable(frame.durable_seq)
            for held in self.turns.undurable.take_unsent():  # before any chunk that arrives after this
                self._out.append(SendWorker(held, self.worker))
            self._out += (Count(Metric.SESSIONS_RESTORED), Count(Metric.CHUNKS_REPLAYED, flow.replayed))
            logger.info(
                "session %s restored on %s (length %d)", self.sid, self.worker.worker_id, frame.length
            )
        if flow.step is Step.OPEN:
            self._out.append(Count(Metric.SESSIONS_OPENED))
            logger.info("session %s opened on worker %s", self.sid, self.worker.worker_id)
        elif flow.origin is Origin.RESUME:
            self._out.append(Count(Metric.SESSIONS_RESUMED))
        was = self.life.phase
        self.life.move(Phase.ACTIVE)
        if was is Phase.OPENING:
            self._start_guard()
        else:
            self._after_restore()

    def _request_failed(self, exc: MicroturnError) -> None:
        """The pending open/attach/restore got no `opened`: unbind, then the flow's next step."""
        flow = self._flow
        assert flow is not None and self.sid is not None
        self._out.append(CancelTimer(Timer.REQUEST))
        self._unbind()
        worker = self.worker.worker_id if self.worker is not None else "?"
        recoverable = isinstance(exc, WorkerUnavailable | CapacityExhausted)
        if flow.step is Step.OPEN:
            logger.warning("open on worker %s failed (%s)", worker, exc)
            flow.step, flow.last = Step.DELETE_AFTER_OPEN, exc
            flow.fail_with = None if recoverable and flow.attempt < PLACEMENT_ATTEMPTS else exc
            self._out.append(Delete(self.sid))
        elif flow.step is Step.ATTACH:
            if recoverable or isinstance(exc, SessionNotFound):
                logger.warning("attach of %s on worker %s failed (%s); restoring", self.sid, worker, exc)
                self._restore(Origin.RESUME)
            else:
                self._fail_open(exc)
        elif flow.step is Step.RESTORE:
            if recoverable:
                logger.warning("restore of %s on %s failed (%s)", self.sid, worker, exc)
                flow.last = exc
                self._move_attempt()
            else:
                self._restore_failed(exc)

    def deleted(self) -> None:
        flow = self._flow
        if flow is not None and flow.step is Step.DELETE_AFTER_OPEN:
            if flow.fail_with is not None:
                self._fail_open(flow.fail_with)
            else:
                self._place_new(flow)
        elif flow is not None and flow.step is Step.DELETE_AFTER_CLOSE:
            self._flow = None
            self._closed_here()

    def store_failed(self) -> None:
        """The awaited effect could not reach the session store (Redis)."""
        self.effect_failed(
            WorkerUnavailable("the session store is unavailable", retry_after_ms=STORE_RETRY_MS), store=True
        )

    def effect_failed(self, exc: MicroturnError, *, store: bool = False) -> None:
        """The awaited effect failed with `exc`; `store`: it could not reach the session store."""
        flow = self._flow
        if flow is None:
            return
        if flow.step is Step.DELETE_AFTER_CLOSE:
            self._flow = None
            self._error(exc)  # the session stays GONE on this socket; its keys expire with their TTL
            return
        if flow.step is Step.PLACE and isinstance(exc, CapacityExhausted) and not store:
            # The workers that had room could not be reached (now suspect): that is the truth.
            self._fail_open(flow.last or exc)
        elif flow.step is Step.MOVE and isinstance(exc, CapacityExhausted | WorkerUnavailable) and not store:
            flow.last = exc
            self._move_attempt()
        elif flow.step is Step.MOVE:
            self._restore_failed(exc)
        else:  # the open's or resume's store and credential steps, and a failed open's delete
            self._fail_open(exc)

    def send_failed(self, frame: ToWorker, exc: MicroturnError) -> None:
        """A `SendWorker` could not be sent. A chunk is left to the restore the link loss starts (the
        new worker gets it with the tail); a request or a close fails; a cancel is refused."""
        if isinstance(frame, LinkCancel):
            self._error(exc, frame.seq)
        elif self._flow is not None and frame is self._flow.frame:
            if self._flow.step in (Step.OPEN, Step.ATTACH, Step.RESTORE):
                self._request_failed(exc)
        elif isinstance(frame, LinkClose) and self.life.phase is Phase.CLOSING:
            self._close_unconfirmed()

    def _fail_open(self, exc: MicroturnError) -> None:
        """An open or resume failed recoverably: the socket is back to IDLE, the client is told."""
        self._flow = None
        if self.life.phase is Phase.OPENING:
            self._unbind()
            self.life.move(Phase.IDLE)
            self.sid, self._record, self.worker = None, None, None
            if self._guard is not None:
                self._out.append(ReleaseAuth())
        self._error(exc)

    # ---- close -------------------------------------------------------------------------------------

    def _close(self) -> None:
        """`session.close`: the worker ends the session and confirms; unconfirmed, it ends here."""
        if self.life.phase is Phase.RESTORING:
            self._close_deferred = True  # served once the restore ends, either way
            return
        self.life.check(Request.CLOSE)
        if self.life.phase is Phase.IDLE:  # nothing to close: say so politely and hang up
            self._to_client(SessionClosed("closed"))
            self._end(CLOSE_NORMAL)
            return
        assert self.sid is not None and self.worker is not None, "an active session has a worker"
        self.life.move(Phase.CLOSING)
        self._flow = Flow(Step.CLOSE)
        self._out += [
            SendWorker(LinkClose(self.sid), self.worker),
            ArmTimer(Timer.CLOSE, self._cfg.open_timeout_s),
        ]

    def _close_unconfirmed(self) -> None:
        # The worker could not confirm: end the session here, so it cannot be resumed.
        logger.warning("worker did not confirm close of %s; deleting its keys", self.sid)
        assert self.sid is not None
        self._out.append(CancelTimer(Timer.CLOSE))
        self._unbind()
        self.life.end_session()
        self._flow = Flow(Step.DELETE_AFTER_CLOSE)
        self._out.append(Delete(self.sid))

    def _closed_here(self) -> None:
        self._to_client(SessionClosed("closed"))
        self._end(CLOSE_NORMAL)

    def _on_closed(self, reason: CloseReason) -> None:
        """The worker ended the session (closed, idle) or another socket took it over."""
        self._flow = None
        self._close_deferred = False
        self._out += [CancelTimer(Timer.CLOSE), CancelTimer(Timer.REQUEST), CancelTimer(Timer.BACKOFF)]
        self.life.end_session()
        self._unbind()
        self._to_client(SessionClosed(reason))
        self._end(CLOSE_NORMAL)

    # ---- the worker's frames ---------------------------------------------------------------------------

    def worker_frame(self, frame: ToGateway, arrived: float) -> None:
        """A frame from the session's worker, `arrived` at that monotonic time."""
        self._now = arrived
        flow = self.flow
        pending = flow in (Step.OPEN, Step.ATTACH, Step.RESTORE)
        if isinstance(frame, LinkOpened):
            self._opened(frame)
        elif isinstance(frame, LinkClosed):
            self._on_closed(frame.reason)
        elif isinstance(frame, LinkMigrate):
            self.turns.undurable.durable(frame.durable_seq)
            if self.life.phase is Phase.ACTIVE:
                self._out.append(Count(Metric.SESSIONS_MIGRATED))
                self._move("its worker is draining", target=frame.target)
        elif isinstance(frame, LinkError) and frame.error.seq is None and pending:
            self._request_failed(frame.error.to_exception())
        elif pending:
            # A delta/done of an earlier binding racing our attach: the worker replays the dones
            # after `opened`, so forwarding this one too would deliver it twice.
            logger.debug("session %s: dropping %s before opened", frame.sid, frame.op)
        elif isinstance(frame, LinkDelta):
            if self.turns.undurable.delta_is_new(frame):
                self._to_client(frame.delta)
        elif isinstance(frame, LinkDone):
            self._done(frame)
        elif isinstance(frame, LinkError):
            error = frame.error
            if error.seq is not None:
                self.turns.refused(error.seq)
            self._to_client(error)
            if error.fatal:
                self.life.end_session()
                self._unbind()
                self._end(close_code_for(error.code))

    def _done(self, frame: LinkDone) -> None:
        counted = self.turns.done(frame)
        if counted is None:
            logger.info("session %s: dropping a second done for seq %d", frame.sid, frame.done.seq)
            return
        started, grown = counted
        self._out.append(SendClient(frame.done, started))
        if self._guard is not None:
            self._judge(self._guard.on_done(grown))

    def link_lost(self) -> None:
        """The link to the session's worker broke; the pool already dropped the binding."""
        self._bound = False
        if self.flow in (Step.OPEN, Step.ATTACH, Step.RESTORE):
            url = self.worker.url if self.worker is not None else "?"
            self._request_failed(WorkerUnavailable(f"link to {url} broke"))
        elif self.life.phase is Phase.CLOSING and self.flow is Step.CLOSE:
            self._close_unconfirmed()
        else:
            self._move("the link to its worker broke")

    def taken_over(self) -> None:
        """Another socket on this gateway resumed the session (the same as its `closed`)."""
        logger.info("session %s taken over by another socket", self.sid)
        self._bound = False
        self._on_closed("taken_over")

    # ---- timers and the credential ------------------------------------------------------------------------

    def timer_fired(self, timer: Timer) -> None:
        flow = self.flow
        if timer is Timer.REQUEST and flow in (Step.OPEN, Step.ATTACH, Step.RESTORE):
            url = self.worker.url if self.worker is not None else "?"
            self._request_failed(WorkerUnavailable(f"worker at {url} did not answer in time"))
        elif timer is Timer.CLOSE and flow is Step.CLOSE:
            self._close_unconfirmed()
        elif timer is Timer.BACKOFF and flow is Step.BACKOFF:
            assert self._flow is not None and self.sid is not None and self._record is not None
            self._flow.step = Step.MOVE
            self._out.append(Move(self.sid, self._record, self.config))
        elif timer is Timer.AUTH_WARN and self._warning is not None:
            self._judge(self._warning)
        elif timer is Timer.AUTH_EXPIRE and self._expiry is not None:
            self._judge(self._expiry)

    def _start_guard(self) -> None:
        if self._guard is None:
            return
        verdict, deadline = self._guard.start(self._now)
        if deadline is not None:
            self._warning, self._expiry = deadline.warning, deadline.expiry
            self._out += [
                ArmTimer(Timer.AUTH_WARN, deadline.warn_in_s),
                ArmTimer(Timer.AUTH_EXPIRE, deadline.expire_in_s),
            ]
        self._judge(verdict)

    def _judge(self, verdict: Verdict) -> None:
        if isinstance(verdict, SessionExpiring):
            if not self.life.ended:
                self._to_client(verdict)
        elif isinstance(verdict, Expire):
            self._expire(verdict.why)

    def _expire(self, why: str) -> None:
        """The session reached a limit of its credential: it ends on the worker, the client is told."""
        sid, worker = self.sid, self.worker
        if self.life.ended or sid is None:
            return
        logger.info("session %s expired: %s", sid, why)
        self._flow = None
        self._close_deferred = False
        self._out += [CancelTimer(t) for t in (Timer.REQUEST, Timer.CLOSE, Timer.BACKOFF, Timer.AUTH_WARN)]
        self._unbind()
        if worker is not None:
            self._out.append(EndOnWorker(sid, worker))
        self.life.end_session()
        self._error(SessionExpired(why), fatal=True)

    # ---- the socket's end ------------------------------------------------------------------------------

    def socket_closed(self, *, close_session: bool = False) -> None:
        """The socket is gone: the session detaches from its worker (it stays there until its idle
        timeout, for a resume) unless it is over; `close_session`: end it instead (a dialect with no
        resume)."""
        self.life.end_socket()
        self._flow = None
        self._close_deferred = False
        self._out += [CancelTimer(t) for t in Timer]
        if self._guard is not None:
            self._out.append(ReleaseAuth())
        sid, worker, bound = self.sid, self.worker, self._bound
        if sid is None:
            return
        self._unbind()
        if bound and worker is not None and not self.life.gone:
            frame: ToWorker = LinkClose(sid) if close_session else LinkDetach(sid)
            self._out.append(SendWorker(frame, worker))

    # ---- helpers ------------------------------------------------------------------------------------------

    def _step(self, step: Step, effect: Action) -> None:
        assert self._flow is not None
        self._flow.step = step
        self._out.append(effect)

    def _expects(self, step: Step) -> bool:
        return self._flow is not None and self._flow.step is step

    def _unbind(self) -> None:
        if self._bound and self.sid is not None:
            self._out.append(Unbind(self.sid))
        self._bound = False

    def _to_client(self, message: ServerMessage) -> None:
        self._out.append(SendClient(message))

    def _error(self, exc: MicroturnError, seq: int | None = None, *, fatal: bool | None = None) -> None:
        message = error_message_from(exc, seq, fatal=fatal)
        self._to_client(message)
        if message.fatal:
            self._end(close_code_for(exc.code))

    def _end(self, code: int) -> None:
        self.life.end_socket()
        self._out.append(CloseSocket(code))
