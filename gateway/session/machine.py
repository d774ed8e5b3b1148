"""One client socket's session as a Sans-I/O state machine: events in, actions out.

Why this shape (websockets' `Protocol` is the model): every decision about a session on this
gateway is made here or in the flow this machine runs (flows.py), with no I/O, no clock and no
event loop, so each event and the transition it causes can be read in one place and tested by
playing events and reading actions (tests/gateway/test_session_machine.py). It is a function of its
inputs: time comes in with the events (a client message's `received`, a worker frame's `arrived`:
monotonic seconds), and what it counts goes out as `Count` actions; it reads no clock and moves no
metric (tests/test_architecture.py checks both in the source of the machine's modules and of its
credential, session_auth.py). The asyncio shell (client_session.py, beside it) only moves bytes:
it decodes client frames, routes worker frames, reads the clocks, performs the effects, the timers
and the counts (actions.py) and answers each effect with its result method.

Events: a client message (`receive`), a frame the client sent that could not be decoded
(`refuse`), a worker frame (`worker_frame`), the link lost or the session taken over, a send that
failed, an effect's result (`placed`, `looked_up`, `worker_found`, `deleted`, `admitted`,
`effect_failed`), a timer, the socket gone (`socket_closed`). Each may queue actions; the caller
drains them with `actions()`, in order.

What is where: this class keeps the chunk path, the worker frames, the phase (lifecycle.py: the
table of allowed moves), the request a worker answers with `opened`, the credential and the
socket's end. Open, resume, restore and close are flows (flows.py), one at a time: an effect's
result goes to the flow in progress, which decides its next step.

Invariants:
- The phase changes only through `self.life` (lifecycle.py); a flow's step only through the flow,
  checked against the phase (flows.py `STEPS`): no flow runs while the session is ACTIVE.
- Every check that can refuse a chunk runs before it is forwarded: a refused chunk changes nothing.
- A chunk forwarded (or held while the session moves) is in flight until its `done` or `error`,
  and in the undurable turns until its turn is durable (turns.py): a restore re-runs it, so every
  chunk gets exactly one `output.done` (docs/failover.md). Held chunks are queued to the new worker
  right after its `opened`, before any later chunk.
- A rewind or a cancel goes to the worker in order with the chunks around it, and a rewind holds
  the chunks (and edits) sent after it until it is answered; one in flight when the session moves
  goes again to the next worker, so it too gets exactly one answer (edits.py).
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
from typing import TYPE_CHECKING, Final

from gateway.limits import LimitValues
from gateway.metric_families import Metric
from gateway.session.actions import (
    Action,
    ArmTimer,
    Bind,
    CancelTimer,
    CloseSocket,
    Count,
    EndOnWorker,
    ReleaseAuth,
    SendClient,
    SendWorker,
    Timer,
    Unbind,
    WorkerRef,
)
from gateway.session.edits import Edit, PendingEdits, awaits_answer
from gateway.session.flows import (
    AnyFlow,
    CloseFlow,
    CloseStep,
    OpenFlow,
    Origin,
    RestoreFlow,
    ResumeFlow,
    Step,
)
from gateway.session.guard import Expire, SessionGuard, Verdict
from gateway.session.lifecycle import IllegalTransition, Phase, Request, SessionLifecycle
from gateway.session.turns import Turns
from shared.errors import MicroturnError, SessionExpired, WorkerUnavailable
from shared.protocol.close_codes import CLOSE_NORMAL, close_code_for, error_message_from
from shared.protocol.link import (
    LinkCancel,
    LinkChunk,
    LinkClose,
    LinkClosed,
    LinkDelta,
    LinkDetach,
    LinkDone,
    LinkError,
    LinkMigrate,
    LinkOpened,
    LinkRewind,
    LinkRewound,
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
    SessionResume,
    SessionRewind,
)

if TYPE_CHECKING:
    from shared.store.registry import SessionRecord

logger = logging.getLogger(__name__)

# What a client is told to wait when the session store cannot be reached.
STORE_RETRY_MS: Final = 1000

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
        self.guard = guard
        self._new_sid, self._new_token = new_sid, new_token
        # The time of the event being handled (monotonic s): the only clock the rate limit reads.
        self._now = 0.0
        self.turns = Turns(limits, self._event_time)
        self.life = SessionLifecycle()
        self._out: list[Action] = []
        self.sid: str | None = None
        self.config = OpenConfig()
        self.record: SessionRecord | None = None  # the session's record in Redis, once placed or looked up
        self.worker: WorkerRef | None = None  # the worker the session is bound to (or being placed on)
        self._bound = False
        self._flow: AnyFlow | None = None  # the one flow in progress (flows.py)
        self._close_deferred = False  # `session.close` while restoring: served once the restore ends
        # The worker closed the session of a keyed socket: `session.closed` waits for the slot's release.
        self._closing: CloseReason | None = None
        self._warning: SessionExpiring | None = None  # the credential's deadline, once armed
        self._expiry: Expire | None = None
        # Rewinds and cancels not through to the worker yet, in order with the chunks (edits.py).
        self.edits = PendingEdits()

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
            or self.step is CloseStep.DELETE
        )

    @property
    def step(self) -> Step | None:
        """The step of the flow in progress."""
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
            elif isinstance(msg, SessionRewind):
                self._rewind(msg)
            elif isinstance(msg, SessionOpen):
                self._open(msg.config)
            elif isinstance(msg, SessionResume):
                self._resume(msg)
            elif isinstance(msg, SessionClose):
                self._close()
        except MicroturnError as exc:
            self.error(exc, seq)

    def refuse(self, exc: MicroturnError, *, fatal: bool | None = None) -> None:
        """A client frame that could not be decoded (or was too large), or could not be served."""
        self.error(exc, fatal=fatal)

    def _chunk(self, msg: InputChunk, received: float) -> None:
        sid, worker, phase = self.sid, self.worker, self.life.phase
        self.life.check(Request.CHUNK)  # served while ACTIVE, and held while RESTORING
        assert sid is not None and worker is not None, "an active session has a worker"
        self.turns.check_seq(msg)
        if self.guard is not None:
            self.guard.check_chunk(received)
        limit = msg.max_output_tokens if msg.max_output_tokens is not None else self.config.max_output_tokens
        frame = LinkChunk(sid, msg)
        # Held while RESTORING: it goes to the new worker with the tail, or right after its restore.
        # Held while an edit is pending too: it goes once the edit is through (a rewind: answered,
        # so durable), never on the history before it, on this worker or the next (edits.py).
        held = phase is Phase.RESTORING or self.edits.count > 0
        self.turns.admit(msg, wants_output=limit > 0, received=received, frame=frame, sent=not held)
        if not held:
            self._out += (SendWorker(frame, worker), _CHUNK_FORWARDED)

    def _cancel(self, msg: OutputCancel) -> None:
        self.life.check(Request.CANCEL)  # served while ACTIVE, and held while RESTORING
        assert self.sid is not None, "an active session has a sid"
        self._edit(LinkCancel(self.sid, msg.seq, msg.keep_output_tokens))

    def _rewind(self, msg: SessionRewind) -> None:
        """`session.rewind`: the worker cancels the session's turns, edits its history, logs the
        edit and answers `rewound`; the gateway keeps it until then (edits.py)."""
        self.life.check(Request.REWIND)  # served while ACTIVE, and held while RESTORING
        assert self.sid is not None, "an active session has a sid"
        self._edit(LinkRewind(self.sid, msg))

    def _edit(self, frame: Edit) -> None:
        """A rewind or a cancel: after the chunks admitted so far, before any admitted later."""
        self.edits.add(frame, self.turns.last_seq)
        self._release()

    def _release(self) -> None:
        """Send what waits and may go now, in order: the held chunks up to the first pending edit,
        then that edit (a plain cancel, and on to the next; a rewind, and wait for its answer)."""
        worker = self.worker
        if self.life.phase is not Phase.ACTIVE or worker is None:
            return  # held until the restore's `opened`
        undurable = self.turns.undurable
        while True:
            self._out += [SendWorker(held, worker) for held in undurable.take_unsent(self.edits.boundary)]
            frame = self.edits.next_to_send(self.turns.first_in_flight)
            if frame is None:
                return
            self._out.append(SendWorker(frame, worker))
            if awaits_answer(frame):
                return

    def _open(self, config: OpenConfig) -> None:
        self.life.check(Request.OPEN)
        self.life.move(Phase.OPENING)
        self.sid, self.config = self._new_sid(), config
        self.run(OpenFlow(self._new_token()))

    def _resume(self, msg: SessionResume) -> None:
        self.life.check(Request.OPEN)
        self.life.move(Phase.OPENING)
        self.sid = msg.session_id
        self.run(ResumeFlow(msg.resume_token, msg.last_seq))

    def _close(self) -> None:
        """`session.close`: the worker ends the session and confirms; unconfirmed, it ends here."""
        if self.life.phase is Phase.RESTORING:
            self._close_deferred = True  # served once the restore ends, either way
            return
        self.life.check(Request.CLOSE)
        if self.life.phase is Phase.IDLE:  # nothing to close: say so politely and hang up
            self.closed_here()
            return
        assert self.sid is not None and self.worker is not None, "an active session has a worker"
        self.life.move(Phase.CLOSING)
        self.run(CloseFlow(self._cfg.open_timeout_s))

    # ---- effects' results: each goes to the flow in progress (ignored with none) ----------------------

    def admitted(self) -> None:
        if self._flow is not None:
            self._flow.admitted(self)

    def looked_up(self, record: SessionRecord, config: OpenConfig) -> None:
        if self._flow is not None:
            self._flow.looked_up(self, record, config)

    def worker_found(self, url: str | None) -> None:
        if self._flow is not None:
            self._flow.worker_found(self, url)

    def placed(self, record: SessionRecord, url: str) -> None:
        """`Place` or `Move` wrote the record naming the worker at `url`: send it the request."""
        if self._flow is not None:
            self._flow.placed(self, record, url)

    def deleted(self) -> None:
        if self._flow is not None:
            self._flow.deleted(self)

    def store_failed(self) -> None:
        """The awaited effect could not reach the session store (Redis)."""
        self.effect_failed(
            WorkerUnavailable("the session store is unavailable", retry_after_ms=STORE_RETRY_MS), store=True
        )

    def effect_failed(self, exc: MicroturnError, *, store: bool = False) -> None:
        """The awaited effect failed with `exc`; `store`: it could not reach the session store."""
        if self._flow is not None:
            self._flow.effect_failed(self, exc, store=store)

    def send_failed(self, frame: ToWorker, exc: MicroturnError) -> None:
        """A `SendWorker` could not be sent. A chunk or a rewind is left to the restore the link loss
        starts (the new worker gets the chunk with the tail, the rewind right after); a request or a
        close fails; a plain cancel is refused."""
        flow = self._flow
        if isinstance(frame, LinkRewind | LinkCancel):
            if isinstance(frame, LinkCancel) and not awaits_answer(frame):
                self.error(exc, frame.seq)
        elif flow is not None and flow.awaits_opened:
            if frame is flow.frame:
                self._request_failed(exc)
        elif flow is not None:
            flow.send_failed(self, frame)

    # ---- what the flows use (flows.py `Host`) -----------------------------------------------------------

    def emit(self, *actions: Action) -> None:
        self._out += actions

    def run(self, flow: AnyFlow) -> None:
        self._flow = flow
        try:
            flow.start(self)
        except IllegalTransition:
            self._flow = None  # refused at its first step: no flow half started
            raise

    def end_flow(self) -> None:
        self._flow = None

    def request(self, worker: WorkerRef, frame: ToWorker) -> None:
        assert self.sid is not None
        self.worker = worker
        self._bound = True
        self._out += [
            Bind(self.sid, worker),
            SendWorker(frame, worker),
            ArmTimer(Timer.REQUEST, self._cfg.open_timeout_s),
        ]

    def fail_open(self, exc: MicroturnError) -> None:
        self._flow = None
        if self.life.phase is Phase.OPENING:
            self.unbind()
            self.life.move(Phase.IDLE)
            self.sid, self.record, self.worker = None, None, None
            if self.guard is not None:
                self._out.append(ReleaseAuth())
        self.error(exc)

    def after_restore(self) -> None:
        if self._close_deferred:
            self._close_deferred = False
            try:
                self._close()
            except MicroturnError as exc:
                self.error(exc)

    def closed_here(self) -> None:
        self._to_client(SessionClosed("closed"))
        self._end(CLOSE_NORMAL)

    def unbind(self) -> None:
        if self._bound and self.sid is not None:
            self._out.append(Unbind(self.sid))
        self._bound = False

    def error(self, exc: MicroturnError, seq: int | None = None, *, fatal: bool | None = None) -> None:
        message = error_message_from(exc, seq, fatal=fatal)
        self._to_client(message)
        if message.fatal:
            self._end(close_code_for(exc.code))

    # ---- the request a worker answers with `opened` (open, attach, restore) ----------------------------

    def _opened(self, frame: LinkOpened) -> None:
        flow = self._flow
        if flow is None or not flow.awaits_opened:
            logger.warning("unexpected opened for session %s", frame.sid)
            return
        assert self.worker is not None and self.record is not None
        self._out.append(CancelTimer(Timer.REQUEST))
        self._flow = None
        self.turns.opened(frame)
        flow.opened(self, frame)  # the client's answer, queued before any frame that follows `opened`
        was = self.life.phase
        self.life.move(Phase.ACTIVE)
        self._release()  # what waited while it moved: the held chunks, then the edits, in order
        if was is Phase.OPENING:
            self._start_guard()
        else:
            self.after_restore()

    def _request_failed(self, exc: MicroturnError) -> None:
        """The pending open/attach/restore got no `opened`: unbind, then the flow's next step."""
        flow = self._flow
        assert flow is not None and self.sid is not None
        self._out.append(CancelTimer(Timer.REQUEST))
        self.unbind()
        flow.request_failed(self, exc)

    # ---- the worker's frames ---------------------------------------------------------------------------

    def worker_frame(self, frame: ToGateway, arrived: float) -> None:
        """A frame from the session's worker, `arrived` at that monotonic time."""
        self._now = arrived
        pending = self._flow is not None and self._flow.awaits_opened
        if isinstance(frame, LinkOpened):
            self._opened(frame)
        elif isinstance(frame, LinkClosed):
            self._on_closed(frame.reason)
        elif isinstance(frame, LinkMigrate):
            self.turns.undurable.durable(frame.durable_seq)
            if self.life.phase is Phase.ACTIVE:
                self._out.append(Count(Metric.SESSIONS_MIGRATED))
                self._move("its worker moved it", target=frame.target)
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
        elif isinstance(frame, LinkRewound):
            self.turns.undurable.durable(frame.durable_seq)
            self._to_client(frame.rewound)
            self._edit_answered()
        elif isinstance(frame, LinkError):
            error = frame.error
            if error.seq is not None:
                self.turns.refused(error.seq)
                if self.edits.count:  # a rewind sent again after a move may wait for this turn
                    self.edits.turn_refused(error.seq)
                    self._release()
            elif not error.fatal and self.edits.awaited:  # a worker's refusal with no seq answers it
                self._to_client(error)
                self._edit_answered()
                return
            self._to_client(error)
            if error.fatal:
                self.life.end_session()
                self.unbind()
                self._end(close_code_for(error.code))

    def _done(self, frame: LinkDone) -> None:
        counted = self.turns.done(frame)
        if counted is None:
            logger.info("session %s: dropping a second done for seq %d", frame.sid, frame.done.seq)
            return
        started, grown = counted
        self._out.append(SendClient(frame.done, started))
        if self.edits.count:  # a rewind sent again after a move may wait for this turn
            self.edits.turn_done(frame.done.seq, frame.length, len(frame.done.tokens))
            self._release()
        if self.guard is not None:
            self._judge(self.guard.on_done(grown))

    def _edit_answered(self) -> None:
        """The rewind at the worker was answered: what waited behind it goes, in order."""
        self.edits.answered()
        self._release()

    def _move(self, why: str, *, target: str | None = None) -> None:
        """The session leaves its worker (lost or draining): restore it elsewhere with its tail."""
        if self.life.phase is not Phase.ACTIVE or self.sid is None or self.record is None:
            return
        logger.warning(
            "session %s leaves its worker (%s); restoring with %d undurable chunk(s)",
            self.sid,
            why,
            len(self.turns.undurable),
        )
        self.unbind()  # the old worker's late frames are not ours any more
        self.life.move(Phase.RESTORING)
        # Applied and logged there, or not: every edit goes again to the next worker (a rewind is
        # idempotent), and the chunks behind it still wait for it (edits.py).
        self.edits.moved(self.turns.in_flight)
        # Every done up to the finished seq has been queued for the client: it is what it saw.
        self.run(RestoreFlow(Origin.MOVE, self.turns.finished_seq, target))

    def _on_closed(self, reason: CloseReason) -> None:
        """The worker ended the session (closed, idle) or another socket took it over."""
        self._flow = None
        self._close_deferred = False
        self._out += [CancelTimer(Timer.CLOSE), CancelTimer(Timer.REQUEST), CancelTimer(Timer.BACKOFF)]
        self.life.end_session()
        self.unbind()
        if self.guard is not None:
            # The credential's slot goes back first, `session.closed` once it has (`auth_released`):
            # a client that then opens another session with the same key, on any socket, finds the
            # slot free rather than held until this socket's close.
            self._closing = reason
            self._out.append(ReleaseAuth())
            return
        self._to_client(SessionClosed(reason))
        self._end(CLOSE_NORMAL)

    def auth_released(self) -> None:
        """A `ReleaseAuth` was performed: a session closed while it ran is told so now."""
        reason, self._closing = self._closing, None
        if reason is not None:
            self._to_client(SessionClosed(reason))
            self._end(CLOSE_NORMAL)

    def link_lost(self) -> None:
        """The link to the session's worker broke; the pool already dropped the binding."""
        self._bound = False
        flow = self._flow
        if flow is not None and flow.awaits_opened:
            url = self.worker.url if self.worker is not None else "?"
            self._request_failed(WorkerUnavailable(f"link to {url} broke"))
        elif flow is not None:
            flow.link_lost(self)
        else:
            self._move("the link to its worker broke")

    def taken_over(self) -> None:
        """Another socket on this gateway resumed the session (the same as its `closed`)."""
        logger.info("session %s taken over by another socket", self.sid)
        self._bound = False
        self._on_closed("taken_over")

    # ---- timers and the credential ------------------------------------------------------------------------

    def timer_fired(self, timer: Timer) -> None:
        flow = self._flow
        if timer is Timer.REQUEST:
            if flow is not None and flow.awaits_opened:
                url = self.worker.url if self.worker is not None else "?"
                self._request_failed(WorkerUnavailable(f"worker at {url} did not answer in time"))
        elif timer is Timer.AUTH_WARN:
            if self._warning is not None:
                self._judge(self._warning)
        elif timer is Timer.AUTH_EXPIRE:
            if self._expiry is not None:
                self._judge(self._expiry)
        elif flow is not None:
            flow.timer_fired(self, timer)  # a close's or a restore's own timer

    def _start_guard(self) -> None:
        if self.guard is None:
            return
        verdict, deadline = self.guard.start(self._now)
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
        self.unbind()
        if worker is not None:
            self._out.append(EndOnWorker(sid, worker))
        self.life.end_session()
        self.error(SessionExpired(why), fatal=True)

    # ---- the socket's end ------------------------------------------------------------------------------

    def socket_closed(self, *, close_session: bool = False) -> None:
        """The socket is gone: the session detaches from its worker (it stays there until its idle
        timeout, for a resume) unless it is over; `close_session`: end it instead (a dialect with no
        resume)."""
        self.life.end_socket()
        self._flow = None
        self._close_deferred = False
        self._closing = None  # nobody left to tell
        self._out += [CancelTimer(t) for t in Timer]
        if self.guard is not None:
            self._out.append(ReleaseAuth())
        sid, worker, bound = self.sid, self.worker, self._bound
        if sid is None:
            return
        self.unbind()
        if bound and worker is not None and not self.life.gone:
            frame: ToWorker = LinkClose(sid) if close_session else LinkDetach(sid)
            self._out.append(SendWorker(frame, worker))

    def _to_client(self, message: ServerMessage) -> None:
        self._out.append(SendClient(message))

    def _end(self, code: int) -> None:
        self.life.end_socket()
        self._out.append(CloseSocket(code))
