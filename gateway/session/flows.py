"""The flows of a gateway session (open, resume, restore, close): each an object with its own steps.

Why objects: a session has two state axes. Its phase (lifecycle.py) says what the socket serves; its
flow says which effect or worker answer it awaits while it gets onto a worker (open, resume,
restore) or leaves one (close). Each flow owns its steps and the handling of every result it
awaits, so what follows, say, a resume's lookup is read in one method (`ResumeFlow.looked_up`), and
a result a flow does not await at its step is ignored (a late answer for a step it has left).

Why one module: the flows are one concept, how a session reaches a worker and leaves it. They hand
over to each other (a resume whose worker is gone becomes a restore), they share the request a
worker answers with `opened` (`AWAITS_OPENED`), and their steps are checked against the phases in
one table (`STEPS`), next to the steps it names.

The machine (machine.py) runs at most one flow at a time and hands it each result it awaits; it
keeps the chunk path, the worker frames and the phase. A flow reaches the machine through `Host`
(this module cannot import machine.py, which imports it).

The flows (docs/design.md section 5):
- open: [admit] -> place -> `open` -> `opened`; a worker that does not answer: delete the keys and
  place again, up to `PLACEMENT_ATTEMPTS` workers;
- resume: look up -> [admit] -> find its worker -> `attach` -> `opened`; its worker gone, or without
  the session: a restore;
- restore: (pause) -> move -> `restore` with the undurable turns (those before a pending edit) ->
  `opened`, then the held chunks and edits, in order; up to `RESTORE_BACKOFF_S` attempts; for a
  resume (its failure is the resume's), or for a session whose worker was lost or drains (its
  failure ends this socket, not the session);
- close: `close` -> `closed`, or, unconfirmed, delete the session's keys.

Invariants:
- A flow's step changes only through `Flow._enter`, which refuses a step its phase does not allow
  (`STEPS`) with `IllegalTransition`: a gateway bug, answered `internal`, never a flow running in a
  phase no code expects. The step is entered before its effect is queued: a refused step queues
  nothing.
- No step is allowed while the session is ACTIVE: the chunk path runs no code of this module.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final, Generic, Protocol, TypeAlias, TypeVar

from gateway.metric_families import Metric
from gateway.session.actions import (
    Action,
    AdmitOpen,
    AdmitResume,
    ArmTimer,
    CancelTimer,
    Count,
    Delete,
    FindWorker,
    Lookup,
    Move,
    Place,
    SendClient,
    SendWorker,
    Timer,
    WorkerRef,
)
from gateway.session.edits import PendingEdits
from gateway.session.guard import SessionGuard
from gateway.session.lifecycle import IllegalTransition, Phase, SessionLifecycle
from gateway.session.turns import Turns
from shared.errors import CapacityExhausted, MicroturnError, SessionNotFound, WorkerUnavailable
from shared.protocol.link import LinkAttach, LinkClose, LinkOpen, LinkOpened, LinkRestore, ToWorker
from shared.protocol.messages import OpenConfig, SessionOpened, SessionRestored, SessionResumed

if TYPE_CHECKING:  # a value type only: the machine never reaches the store's I/O
    from shared.store.registry import SessionRecord

logger = logging.getLogger(__name__)

# Workers tried for one open before giving up (placement charges each pick, so a dead worker that is
# still registered loses the next pick to a live one).
PLACEMENT_ATTEMPTS: Final = 3
# Pauses before each placement attempt of one restore (the first goes at once: suspects are skipped).
RESTORE_BACKOFF_S: Final = (0.0, 0.25, 0.5, 1.0)


# ---- the steps, and the phases that allow each ----------------------------------------------------


class OpenStep(enum.Enum):
    ADMIT = "open.admit"  # the credential admits a new session
    PLACE = "open.place"  # a worker picked and the new session's record written
    OPEN = "open.open"  # the worker's `opened` for `open`
    DELETE = "open.delete"  # a failed open's keys; then place again, or fail


class ResumeStep(enum.Enum):
    LOOKUP = "resume.lookup"  # the session's record, once its resume token checks out
    ADMIT = "resume.admit"  # the credential admits the resume under the limits it was granted
    FIND_WORKER = "resume.find_worker"  # is the record's worker live
    ATTACH = "resume.attach"  # the worker's `opened` for `attach`


class RestoreStep(enum.Enum):
    BACKOFF = "restore.backoff"  # the pause before the next placement attempt
    MOVE = "restore.move"  # a worker picked and the record pointed there
    RESTORE = "restore.restore"  # the worker's `opened` for `restore`


class CloseStep(enum.Enum):
    CLOSE = "close.close"  # the worker's `closed` for `close`
    DELETE = "close.delete"  # an unconfirmed close's keys


Step: TypeAlias = OpenStep | ResumeStep | RestoreStep | CloseStep

# The steps each phase allows; a step entered in any other phase is a bug (`IllegalTransition`). A
# client's open or resume runs while OPENING, and so does the restore a resume may need; a session
# that left its worker is restored while RESTORING; a close awaits `closed` while CLOSING and,
# unconfirmed, deletes the keys of a session that is GONE. No step while IDLE, ACTIVE or ENDED.
STEPS: Final[Mapping[Phase, frozenset[Step]]] = {
    Phase.IDLE: frozenset(),
    Phase.OPENING: frozenset({*OpenStep, *ResumeStep, *RestoreStep}),
    Phase.ACTIVE: frozenset(),
    Phase.RESTORING: frozenset(RestoreStep),
    Phase.CLOSING: frozenset({CloseStep.CLOSE}),
    Phase.ENDED: frozenset(),
    Phase.GONE: frozenset({CloseStep.DELETE}),
}

# The steps that await the worker's `opened`: a request the machine bound, sent and timed.
AWAITS_OPENED: Final[frozenset[Step]] = frozenset({OpenStep.OPEN, ResumeStep.ATTACH, RestoreStep.RESTORE})


def check_step(phase: Phase, step: Step) -> None:
    """Raise `IllegalTransition` unless `phase` allows `step`."""
    if step not in STEPS[phase]:
        raise IllegalTransition(f"session flow: step {step.value} is not allowed while {phase.value}")


class Origin(enum.Enum):
    """Why a restore runs: the client's resume (its failure is the resume's), or a lost/draining
    worker under a live session (its failure ends this socket, not the session)."""

    RESUME = "resume"
    MOVE = "move"


# ---- what a flow reads and does on its machine ------------------------------------------------------


class Host(Protocol):
    """The session machine as its flows see it (`SessionMachine` in machine.py is the one host)."""

    sid: str | None
    config: OpenConfig
    record: SessionRecord | None  # the session's record in Redis, once placed or looked up
    worker: WorkerRef | None  # the worker the session is bound to (or being placed on)

    @property
    def life(self) -> SessionLifecycle: ...

    @property
    def turns(self) -> Turns: ...

    @property
    def edits(self) -> PendingEdits: ...

    @property
    def guard(self) -> SessionGuard | None: ...

    def emit(self, *actions: Action) -> None:
        """Queue `actions` for the caller, in order."""

    def request(self, worker: WorkerRef, frame: ToWorker) -> None:
        """Bind the session to `worker`, send it `frame` and arm the timer for its `opened`."""

    def run(self, flow: AnyFlow) -> None:
        """Start `flow` as the session's one flow, in place of the one that calls this."""

    def end_flow(self) -> None:
        """The flow is over: no result is awaited any more."""

    def unbind(self) -> None:
        """The worker's late frames are not this session's any more."""

    def error(self, exc: MicroturnError, seq: int | None = None, *, fatal: bool | None = None) -> None:
        """Tell the client; a fatal error ends the socket."""

    def fail_open(self, exc: MicroturnError) -> None:
        """An open or resume failed: the socket is back to IDLE (the client may try again), told."""

    def after_restore(self) -> None:
        """Serve a `session.close` that came while the session was moving."""

    def closed_here(self) -> None:
        """Tell the client its session is closed, and end the socket."""


# ---- the flows ----------------------------------------------------------------------------------------

StepT = TypeVar("StepT", OpenStep, ResumeStep, RestoreStep, CloseStep)


class Flow(Generic[StepT]):
    """A flow in progress: its step, and a method for each result a flow may await. Each result is
    ignored at a step that does not await it, but for a failed effect, which fails an open or resume
    (overridden where a flow recovers)."""

    step: StepT  # set by `start`, changed only by `_enter`

    def __init__(self) -> None:
        self.frame: ToWorker | None = None  # the request awaiting `opened`, while AWAITS_OPENED

    @property
    def awaits_opened(self) -> bool:
        return self.step in AWAITS_OPENED

    def start(self, host: Host) -> None:
        """Enter the first step and queue its effect (the machine set the phase it runs in)."""
        raise NotImplementedError

    def _enter(self, host: Host, step: StepT, *effects: Action) -> None:
        """Move to `step` (refused unless the phase allows it), then queue what it awaits."""
        check_step(host.life.phase, step)
        self.step = step
        host.emit(*effects)

    def _request(self, host: Host, step: StepT, worker: WorkerRef, frame: ToWorker) -> None:
        """Enter `step` and send the request it awaits `opened` for."""
        self._enter(host, step)
        self._send(host, worker, frame)

    def _send(self, host: Host, worker: WorkerRef, frame: ToWorker) -> None:
        self.frame = frame
        host.request(worker, frame)

    # ---- results (the machine calls `opened` and `request_failed` only while `awaits_opened`) ----

    def admitted(self, host: Host) -> None:
        """The credential admitted the session."""

    def looked_up(self, host: Host, record: SessionRecord, config: OpenConfig) -> None:
        """The record of the session to resume."""

    def worker_found(self, host: Host, url: str | None) -> None:
        """The link URL of the record's worker, or None when it is gone."""

    def placed(self, host: Host, record: SessionRecord, url: str) -> None:
        """`Place` or `Move` wrote the record naming the worker at `url`."""

    def deleted(self, host: Host) -> None:
        """The session's keys are deleted."""

    def timer_fired(self, host: Host, timer: Timer) -> None:
        """A flow's own timer (the request's timer is the machine's)."""

    def link_lost(self, host: Host) -> None:
        """The link to the session's worker broke while no `opened` was awaited."""

    def send_failed(self, host: Host, frame: ToWorker) -> None:
        """A frame other than the awaited request could not be sent."""

    def effect_failed(self, host: Host, exc: MicroturnError, *, store: bool) -> None:
        """The awaited effect failed with `exc` (`store`: it could not reach the session store)."""
        host.fail_open(exc)  # the open's or resume's store and credential steps, a failed open's delete

    def opened(self, host: Host, frame: LinkOpened) -> None:
        """The worker answered the request: tell the client, count it (the machine then activates)."""
        raise NotImplementedError

    def request_failed(self, host: Host, exc: MicroturnError) -> None:
        """The request got no `opened` (the machine already unbound it): the flow's next step."""
        raise NotImplementedError


class OpenFlow(Flow[OpenStep]):
    """`session.open`: a new session, placed on a worker that has room."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self.token = token  # the new session's resume token, until `session.opened` carries it
        self.attempt = 0  # placements so far
        self.last: MicroturnError | None = None  # the last recoverable failure, told if none is left
        self.fail_with: MicroturnError | None = None  # told once a failed open's keys are deleted
        self.model = ""  # the placed worker's model, for `session.opened`

    def start(self, host: Host) -> None:
        if host.guard is not None:
            self._enter(host, OpenStep.ADMIT, AdmitOpen(_sid(host)))
        else:
            self._place(host)

    def _place(self, host: Host) -> None:
        self.attempt += 1
        grant = host.guard.grant() if host.guard is not None else None
        self._enter(host, OpenStep.PLACE, Place(_sid(host), self.token, host.config, grant))

    def admitted(self, host: Host) -> None:
        if self.step is OpenStep.ADMIT:
            self._place(host)

    def placed(self, host: Host, record: SessionRecord, url: str) -> None:
        if self.step is not OpenStep.PLACE:
            return
        host.record, self.model = record, record.model
        frame = LinkOpen(_sid(host), host.config, (), record.token_sha256, record.created_ms, record.auth)
        self._request(host, OpenStep.OPEN, WorkerRef(url, record.worker), frame)

    def opened(self, host: Host, frame: LinkOpened) -> None:
        sid = _sid(host)
        limits = host.turns.limits.values.as_map()
        if host.guard is not None:
            limits.update(host.guard.limits_map())
        host.emit(
            SendClient(SessionOpened(sid, self.token, self.model, limits)), Count(Metric.SESSIONS_OPENED)
        )
        logger.info("session %s opened on worker %s", sid, _worker_id(host))

    def request_failed(self, host: Host, exc: MicroturnError) -> None:
        logger.warning("open on worker %s failed (%s)", _worker_id(host), exc)
        self.last = exc
        self.fail_with = None if _recoverable(exc) and self.attempt < PLACEMENT_ATTEMPTS else exc
        self._enter(host, OpenStep.DELETE, Delete(_sid(host)))

    def deleted(self, host: Host) -> None:
        if self.step is not OpenStep.DELETE:
            return
        if self.fail_with is not None:
            host.fail_open(self.fail_with)
        else:
            self._place(host)

    def effect_failed(self, host: Host, exc: MicroturnError, *, store: bool) -> None:
        if self.step is OpenStep.PLACE and isinstance(exc, CapacityExhausted) and not store:
            # The workers that had room could not be reached (now suspect): that is the truth.
            host.fail_open(self.last or exc)
        else:
            super().effect_failed(host, exc, store=store)


class ResumeFlow(Flow[ResumeStep]):
    """`session.resume`: attach to the session on its worker, or restore it when that is gone."""

    def __init__(self, resume_token: str, seen_seq: int | None) -> None:
        super().__init__()
        self.resume_token = resume_token
        self.seen_seq = seen_seq  # the last output seq the client saw

    def start(self, host: Host) -> None:
        self._enter(host, ResumeStep.LOOKUP, Lookup(_sid(host), self.resume_token))

    def looked_up(self, host: Host, record: SessionRecord, config: OpenConfig) -> None:
        if self.step is not ResumeStep.LOOKUP:
            return
        host.record, host.config = record, config
        if host.guard is not None:
            self._enter(host, ResumeStep.ADMIT, AdmitResume(_sid(host), record.created_ms, record.auth))
        else:
            self._find_worker(host)

    def admitted(self, host: Host) -> None:
        if self.step is ResumeStep.ADMIT:
            self._find_worker(host)

    def _find_worker(self, host: Host) -> None:
        self._enter(host, ResumeStep.FIND_WORKER, FindWorker(_record(host).worker))

    def worker_found(self, host: Host, url: str | None) -> None:
        if self.step is not ResumeStep.FIND_WORKER:
            return
        if url is None:  # its worker is gone: rebuild the session elsewhere
            host.run(RestoreFlow(Origin.RESUME, self.seen_seq))
            return
        worker = WorkerRef(url, _record(host).worker)
        self._request(host, ResumeStep.ATTACH, worker, LinkAttach(_sid(host), self.seen_seq))

    def opened(self, host: Host, frame: LinkOpened) -> None:
        resumed = SessionResumed(_sid(host), frame.length, frame.finished_seq)
        host.emit(SendClient(resumed), Count(Metric.SESSIONS_RESUMED))

    def request_failed(self, host: Host, exc: MicroturnError) -> None:
        if _recoverable(exc) or isinstance(exc, SessionNotFound):
            logger.warning(
                "attach of %s on worker %s failed (%s); restoring", host.sid, _worker_id(host), exc
            )
            host.run(RestoreFlow(Origin.RESUME, self.seen_seq))
        else:
            host.fail_open(exc)


class RestoreFlow(Flow[RestoreStep]):
    """Place the session on a live worker and rebuild it there from its token log and the undurable
    turns; first on `target` (the worker a draining one warmed a copy on), if it can take it."""

    def __init__(self, origin: Origin, seen_seq: int | None, target: str | None = None) -> None:
        super().__init__()
        self.origin = origin
        self.seen_seq = seen_seq  # the last output seq the client saw (the restore frame's `seen_seq`)
        self.target = target
        self.attempt = 0  # placement attempts so far
        self.last: MicroturnError | None = None  # the last recoverable failure, told if none is left
        self.replayed = 0  # undurable turns the restore frame carried

    def start(self, host: Host) -> None:
        self._next_attempt(host)

    def _next_attempt(self, host: Host) -> None:
        if self.attempt >= len(RESTORE_BACKOFF_S):
            self._failed(host, self.last or WorkerUnavailable("no worker could take the session"))
            return
        delay = RESTORE_BACKOFF_S[self.attempt]
        self.attempt += 1
        if delay:
            self._enter(host, RestoreStep.BACKOFF, ArmTimer(Timer.BACKOFF, delay))
        else:
            self._move(host, self.target if self.attempt == 1 else None)  # a retry: wherever placement says

    def _move(self, host: Host, target: str | None = None) -> None:
        self._enter(host, RestoreStep.MOVE, Move(_sid(host), _record(host), host.config, target))

    def timer_fired(self, host: Host, timer: Timer) -> None:
        if timer is Timer.BACKOFF and self.step is RestoreStep.BACKOFF:
            self._move(host)

    def placed(self, host: Host, record: SessionRecord, url: str) -> None:
        if self.step is not RestoreStep.MOVE:
            return
        host.record = record
        self._enter(host, RestoreStep.RESTORE)
        tail = host.turns.undurable.snapshot(host.edits.boundary)  # what waits behind an edit goes after
        self.replayed = len(tail)
        frame = LinkRestore(
            _sid(host),
            host.config,
            None,
            self.seen_seq,
            record.token_sha256,
            record.created_ms,
            tail,
            record.auth,
        )
        self._send(host, WorkerRef(url, record.worker), frame)

    def opened(self, host: Host, frame: LinkOpened) -> None:
        sid, worker = _sid(host), host.worker
        assert worker is not None
        if self.origin is Origin.RESUME:
            host.emit(SendClient(SessionResumed(sid, frame.length, frame.finished_seq)))
        host.emit(SendClient(SessionRestored(sid, frame.length)))
        host.turns.undurable.durable(frame.durable_seq)
        # The chunks and edits held while the session moved go next (the machine's `_release`).
        host.emit(Count(Metric.SESSIONS_RESTORED), Count(Metric.CHUNKS_REPLAYED, self.replayed))
        logger.info("session %s restored on %s (length %d)", sid, worker.worker_id, frame.length)
        if self.origin is Origin.RESUME:
            host.emit(Count(Metric.SESSIONS_RESUMED))

    def request_failed(self, host: Host, exc: MicroturnError) -> None:
        if _recoverable(exc):
            logger.warning("restore of %s on %s failed (%s)", host.sid, _worker_id(host), exc)
            self.last = exc
            self._next_attempt(host)
        else:
            self._failed(host, exc)

    def effect_failed(self, host: Host, exc: MicroturnError, *, store: bool) -> None:
        if self.step is not RestoreStep.MOVE:
            super().effect_failed(host, exc, store=store)
        elif isinstance(exc, CapacityExhausted | WorkerUnavailable) and not store:
            self.last = exc
            self._next_attempt(host)
        else:
            self._failed(host, exc)

    def _failed(self, host: Host, exc: MicroturnError) -> None:
        if self.origin is Origin.RESUME:
            host.fail_open(exc)
            return
        # Fatal for this socket, not for the session: its record and log stay, so a later
        # session.resume (when a worker has room again) restores it.
        logger.warning("could not restore session %s: %s", host.sid, exc)
        host.end_flow()
        host.unbind()
        host.life.end_session()
        host.error(exc, fatal=True)
        host.after_restore()


class CloseFlow(Flow[CloseStep]):
    """`session.close`: the worker ends the session and confirms; unconfirmed, it ends here."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.timeout_s = timeout_s  # how long `closed` may take

    def start(self, host: Host) -> None:
        worker = host.worker
        assert worker is not None, "an active session has a worker"
        close = SendWorker(LinkClose(_sid(host)), worker)
        self._enter(host, CloseStep.CLOSE, close, ArmTimer(Timer.CLOSE, self.timeout_s))

    def timer_fired(self, host: Host, timer: Timer) -> None:
        if timer is Timer.CLOSE and self.step is CloseStep.CLOSE:
            self._unconfirmed(host)

    def link_lost(self, host: Host) -> None:
        if host.life.phase is Phase.CLOSING and self.step is CloseStep.CLOSE:
            self._unconfirmed(host)

    def send_failed(self, host: Host, frame: ToWorker) -> None:
        if isinstance(frame, LinkClose) and host.life.phase is Phase.CLOSING:
            self._unconfirmed(host)

    def _unconfirmed(self, host: Host) -> None:
        # The worker could not confirm: end the session here, so it cannot be resumed.
        logger.warning("worker did not confirm close of %s; deleting its keys", host.sid)
        sid = _sid(host)
        host.emit(CancelTimer(Timer.CLOSE))
        host.unbind()
        host.life.end_session()
        self._enter(host, CloseStep.DELETE, Delete(sid))

    def deleted(self, host: Host) -> None:
        if self.step is CloseStep.DELETE:
            host.end_flow()
            host.closed_here()

    def effect_failed(self, host: Host, exc: MicroturnError, *, store: bool) -> None:
        if self.step is CloseStep.DELETE:
            host.end_flow()
            host.error(exc)  # the session stays GONE on this socket; its keys expire with their TTL
        else:
            super().effect_failed(host, exc, store=store)


AnyFlow: TypeAlias = OpenFlow | ResumeFlow | RestoreFlow | CloseFlow


def _sid(host: Host) -> str:
    assert host.sid is not None, "a flow runs for a session"
    return host.sid


def _record(host: Host) -> SessionRecord:
    assert host.record is not None, "placed or looked up before"
    return host.record


def _worker_id(host: Host) -> str:
    return host.worker.worker_id if host.worker is not None else "?"


def _recoverable(exc: MicroturnError) -> bool:
    """Another worker, or the same one later, may well succeed."""
    return isinstance(exc, WorkerUnavailable | CapacityExhausted)
