"""One client socket on `/v1/realtime`: the asyncio shell around its session machine.

Why so thin: every decision is the Sans-I/O `SessionMachine`'s (gateway/session/machine.py); this
module only moves bytes and performs the actions it asks for (gateway/session/actions.py):
- the receive loop decodes each client frame through the socket's dialect (gateway/dialect.py) and
  hands the machine one message at a time, reading the next only once the machine is not `busy`;
- the link pool calls `on_frame` / `on_link_lost` / `on_taken_over` (the `LinkListener`) from the
  shared link reader, which must never wait: those feed the machine and queue what it says;
- one task performs the effects (Redis, the credential) one at a time, in order, and answers the
  machine with each result; timers are the loop's `call_later`; counts go to the gateway's metrics;
- the clocks are read here, never in the machine: each event is handed the monotonic time it
  happened, and the credential's admission an `Instant` (both clocks);
- frames to the worker go out in the order the machine queued them: the receive loop sends a
  chunk inline (the hot path: no task switch, no Redis), anything queued from a callback is sent by
  a short-lived task, and whoever sends first sends what is queued behind it;
- the `Outbox` is the client's one writer.

Invariants: everything runs on the event loop and the machine never awaits, so a machine call and
the draining of its actions are never interleaved with another event. A frame queued for a worker
the session has since left is dropped (the restore carried it in the tail).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Coroutine
from typing import Any, Final

from redis.exceptions import RedisError
from starlette.websockets import WebSocket

from gateway.auth.session_auth import Principal, SessionAuth
from gateway.dialect import Dialect, Frame
from gateway.links import Link
from gateway.services import GatewayServices
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
    Effect,
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
)
from gateway.session.guard import Instant
from gateway.session.machine import MachineConfig, SessionMachine
from gateway.session.outbox import Outbox
from shared.errors import InternalError, MicroturnError, WorkerUnavailable
from shared.protocol.link import LinkClose, ToGateway
from shared.protocol.messages import ClientMessage
from shared.store.registry import new_resume_token

logger = logging.getLogger(__name__)

# How long a fatal error and its close may take to go out once the receive loop has stopped.
CLOSE_FLUSH_S: Final = 5.0


class ClientSession:
    def __init__(
        self, ws: WebSocket, dialect: Dialect, services: GatewayServices, principal: Principal | None = None
    ) -> None:
        self._ws = ws
        self._dialect = dialect
        self._s = services
        self._auth = (
            SessionAuth(principal, services.auth)
            if principal is not None and services.auth is not None
            else None
        )
        self.machine = SessionMachine(
            MachineConfig(services.limits, services.settings.open_timeout_s),
            guard=self._auth,
            new_sid=lambda: uuid.uuid4().hex,
            new_token=new_resume_token,
        )
        dialect.attach(self.machine.turns.limits)  # one admission rule per session, both dialects
        self.outbox = Outbox(
            ws, dialect, services.metrics, self.machine.turns.limits.observe_turn, self._run_released
        )
        self._ready = asyncio.Event()  # set while the machine takes the next client message
        self._ready.set()
        self._effects: asyncio.Queue[Effect] = asyncio.Queue()
        self._timers: dict[Timer, asyncio.TimerHandle] = {}
        self._to_worker: deque[SendWorker] = deque()
        self._sending = False
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- the socket's life ----------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the accepted socket until it closes; then let the session go."""
        reader = asyncio.create_task(self._read_loop(), name="client-reader")
        writer = asyncio.create_task(self.outbox.run(), name="client-writer")
        effects = asyncio.create_task(self._run_effects(), name="session-effects")
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer not in done and self.outbox.closing:
                # The receive loop stopped after a fatal error: let the error and the close go out.
                await asyncio.wait({writer}, timeout=CLOSE_FLUSH_S)
        finally:
            for task in (reader, writer, effects, *self._tasks):
                task.cancel()
            await asyncio.gather(reader, writer, effects, *self._tasks, return_exceptions=True)
            await self._release()

    async def _read_loop(self) -> None:
        try:
            greeting = self._dialect.greeting()
            for reply in greeting.replies:
                self.outbox.put_frame(reply)
            for request in greeting.messages:
                await self._ready.wait()
                await self.handle_message(request, time.monotonic())
            while True:
                await self._ready.wait()  # the machine serves one client request at a time
                if self.outbox.closing:
                    return
                event = await self._ws.receive()
                if event["type"] == "websocket.disconnect":
                    return
                received = time.monotonic()
                text: str | None = event.get("text")
                data: Frame | None = text if text is not None else event.get("bytes")
                if data is not None:
                    await self.handle_frame(data, received)
        except Exception:  # every client error is answered by the machine: this is the socket failing
            logger.exception("receive loop of session %s failed", self.machine.sid)

    async def handle_frame(self, data: Frame, received: float) -> None:
        """One client frame: decoded by the dialect, then each request it carries served in order."""
        try:
            decoded = self._dialect.decode(data)
        except MicroturnError as exc:
            self.machine.refuse(exc)
            await self._drain()
            return
        for reply in decoded.replies:
            self.outbox.put_frame(reply)
        for message in decoded.messages:
            await self._ready.wait()  # a frame may carry an open and what follows it
            if self.outbox.closing:
                return
            await self.handle_message(message, received)

    async def handle_message(self, message: ClientMessage, received: float) -> None:
        try:
            self.machine.receive(message, received)
        except Exception:
            logger.exception("client message handling failed (session %s)", self.machine.sid)
            self.machine.refuse(InternalError("internal gateway error"), fatal=True)
        await self._drain()

    def _run_released(self, messages: tuple[ClientMessage, ...]) -> None:
        """Requests the dialect held back until now (input queued behind a response), in order.

        Run here, from the writer, without awaiting: the dialect only holds requests back while
        a response runs, so none of the reader's requests can be between them and their turn.
        """
        now = time.monotonic()
        try:
            for message in messages:
                self.machine.receive(message, now)
        except Exception:
            logger.exception("released message handling failed (session %s)", self.machine.sid)
            self.machine.refuse(InternalError("internal gateway error"), fatal=True)
        self._apply()

    async def _release(self) -> None:
        """The socket is gone: the machine lets the session go; its last actions are done here."""
        self.machine.socket_closed(close_session=self._dialect.closes_on_disconnect)
        for action in self.machine.actions():
            if isinstance(action, SendWorker):
                with contextlib.suppress(WorkerUnavailable):  # an unreachable worker ends it anyway
                    await self._link(action).send(action.frame)
            elif isinstance(action, ReleaseAuth):
                if self._auth is not None:
                    await self._auth.release()
            else:
                self._do(action)

    # ---- the link pool's callbacks (no awaiting) -------------------------------------------------

    def on_frame(self, frame: ToGateway) -> None:
        self.machine.worker_frame(frame, time.monotonic())
        self._apply()

    def on_link_lost(self, link: Link) -> None:
        self.machine.link_lost()
        self._apply()

    def on_taken_over(self) -> None:
        self.machine.taken_over()
        self._apply()

    # ---- performing actions -----------------------------------------------------------------------

    async def _drain(self) -> None:
        """Perform the machine's actions, sending worker frames inline (the receive loop's path)."""
        self._apply(spawn=False)
        if self._to_worker:
            await self._send_queued()

    def _apply(self, *, spawn: bool = True) -> None:
        """Perform the machine's actions without awaiting; worker frames queue in order."""
        for action in self.machine.actions():
            self._do(action)
        if self.machine.busy:
            self._ready.clear()
        else:
            self._ready.set()
        if spawn and self._to_worker and not self._sending:
            self._spawn(self._send_queued())

    def _do(self, action: Action) -> None:
        if isinstance(action, SendClient):
            self.outbox.put(action.message, action.started)
        elif isinstance(action, SendWorker):
            self._to_worker.append(action)
        elif isinstance(action, Count):
            self._s.metrics.count(action.metric, action.by)
        elif isinstance(action, CloseSocket):
            self.outbox.close(action.code)
        elif isinstance(action, Bind):
            self._s.pool.bind(action.sid, self, self._s.pool.link(action.worker.url, action.worker.worker_id))
        elif isinstance(action, Unbind):
            self._s.pool.unbind(action.sid, self)
        elif isinstance(action, ArmTimer):
            self._cancel_timer(action.timer)
            loop = asyncio.get_running_loop()
            self._timers[action.timer] = loop.call_later(action.delay_s, self._fire, action.timer)
        elif isinstance(action, CancelTimer):
            self._cancel_timer(action.timer)
        else:
            self._effects.put_nowait(action)

    def _link(self, action: SendWorker) -> Link:
        return self._s.pool.link(action.worker.url, action.worker.worker_id)

    async def _send_queued(self) -> None:
        """Send the queued worker frames in order; one sender at a time (the others leave theirs)."""
        if self._sending:
            return
        self._sending = True
        try:
            while self._to_worker:
                action = self._to_worker.popleft()
                if action.worker != self.machine.worker and not isinstance(action.frame, LinkClose):
                    continue  # the session left that worker: the restore carried this in its tail
                try:
                    await self._link(action).send(action.frame)
                except WorkerUnavailable as exc:
                    logger.info(
                        "session %s: %s not sent (%s)", self.machine.sid, action.frame.op, exc.message
                    )
                    self.machine.send_failed(action.frame, exc)
                    self._apply()
        finally:
            self._sending = False

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _fire(self, timer: Timer) -> None:
        self._timers.pop(timer, None)
        self.machine.timer_fired(timer)
        self._apply()

    def _cancel_timer(self, timer: Timer) -> None:
        handle = self._timers.pop(timer, None)
        if handle is not None:
            handle.cancel()

    # ---- effects (one at a time, in order) -----------------------------------------------------------

    async def _run_effects(self) -> None:
        while True:
            effect = await self._effects.get()
            try:
                await self._perform(effect)
            except MicroturnError as exc:
                self.machine.effect_failed(exc)
            except (RedisError, OSError) as exc:
                logger.warning("session store error (session %s): %r", self.machine.sid, exc)
                self.machine.store_failed()
            except Exception:
                logger.exception("%s of session %s crashed", type(effect).__name__, self.machine.sid)
                self.machine.effect_failed(InternalError("internal gateway error"))
            self._apply(spawn=False)
            await self._send_queued()

    async def _perform(self, effect: Effect) -> None:
        store, machine = self._s.store, self.machine
        if isinstance(effect, Place):
            placed = await store.place_new(effect.sid, effect.token, effect.config, effect.auth)
            machine.placed(placed.record, placed.url)
        elif isinstance(effect, Move):
            placed = await store.move(effect.sid, effect.record, effect.config, effect.target)
            machine.placed(placed.record, placed.url)
        elif isinstance(effect, Lookup):
            record, config = await store.lookup(effect.sid, effect.resume_token)
            machine.looked_up(record, config)
        elif isinstance(effect, FindWorker):
            machine.worker_found(await store.worker_url(effect.worker_id))
        elif isinstance(effect, Delete):
            await store.delete(effect.sid)
            machine.deleted()
        elif isinstance(effect, AdmitOpen):
            assert self._auth is not None
            await self._auth.admit_open(effect.sid, Instant(time.monotonic(), time.time()))
            machine.admitted()
        elif isinstance(effect, AdmitResume):
            assert self._auth is not None
            at = Instant(time.monotonic(), time.time())
            await self._auth.admit_resume(effect.sid, effect.created_ms, effect.granted, at)
            machine.admitted()
        elif isinstance(effect, ReleaseAuth):
            try:
                if self._auth is not None:
                    await self._auth.release()
            finally:  # a session closed meanwhile is told so even when the release failed
                machine.auth_released()
        elif isinstance(effect, EndOnWorker):
            try:
                await self._s.pool.link(effect.worker.url, effect.worker.worker_id).send(
                    LinkClose(effect.sid)
                )
            except WorkerUnavailable:
                # No worker to tell: end the session in Redis so it cannot be resumed or restored.
                with contextlib.suppress(RedisError, OSError):
                    await store.delete(effect.sid)
