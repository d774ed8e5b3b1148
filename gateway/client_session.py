"""One client socket on `/v1/realtime`: its messages, its session's link, its worker's frames.

Why this shape: the gateway keeps no session state beyond live sockets, so everything a session
needs on this gateway lives in one `ClientSession` and dies with the socket. Three things drive it,
all on the event loop, none blocking the others:

- the receive loop, which handles one client message at a time (`session.open` and
  `session.resume` await Redis and the worker's `opened`; chunks only await the link write);
- the link reader, which calls `on_frame` / `on_link_lost` / `on_taken_over` synchronously;
  those only update state and queue messages in the `Outbox`, never await;
- a restore task, started when the worker link breaks (docs/design.md section 5 "Worker loss").

All three change the session's phase only through `self.life` (lifecycle.py: the phases, the allowed
moves and the requests each phase serves). Open, resume and close (session_flows.py) and restore
(restore_flow.py), the flows that place the session on a worker and end it there, live in the base
classes `SessionFlows` <- `RestoreFlow` <- `ClientSession`; this module is the socket, the chunks
and the worker's frames.

Invariants:
- Redis is touched only at open, resume, close and restore, all through `SessionStore`
  (session_store.py); never per chunk.
- With auth on, `SessionAuth` (session_auth.py) holds the session's slot among its key's sessions
  from open/resume until the socket ends, whatever ends it; per chunk it only compares two numbers.
- Every chunk forwarded to the worker is in `_in_flight` until its `done` or its `error` arrives,
  and in the undurable tail (gateway/undurable.py) until its turn is durable in the token log. When the
  worker is lost, the chunks in flight are not failed back: the restoring worker gets the tail and
  re-runs them, so every chunk gets exactly one `output.done` (docs/failover.md). Chunks that arrive
  while the session moves are held in the tail and sent once it is restored.
- Every check that can refuse a chunk runs before the chunk is forwarded; a refused chunk leaves the
  session untouched (recoverable error, socket stays open).
- `detach` is sent on disconnect only while this socket is still the bound listener and the phase
  is not GONE (closed, taken over, expired, lost for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Coroutine
from typing import Any, Final

from redis.exceptions import RedisError
from starlette.websockets import WebSocket

from gateway.auth.session_auth import Principal, SessionAuth
from gateway.dialect import Dialect
from gateway.lifecycle import Phase, Request, SessionEnded, SessionLifecycle
from gateway.limits import SessionLimits
from gateway.links import Link
from gateway.outbox import Outbox
from gateway.restore_flow import RestoreFlow
from gateway.services import GatewayServices
from gateway.session_flows import PendingOpen
from gateway.undurable import UndurableTurns
from shared.errors import (
    BadSequence,
    InternalError,
    MicroturnError,
    WorkerUnavailable,
)
from shared.protocol.close_codes import CLOSE_NORMAL, close_code_for
from shared.protocol.link import (
    LinkCancel,
    LinkChunk,
    LinkClosed,
    LinkDelta,
    LinkDetach,
    LinkDone,
    LinkError,
    LinkMigrate,
    LinkOpened,
    ToGateway,
)
from shared.protocol.messages import (
    ClientMessage,
    CloseReason,
    InputChunk,
    OpenConfig,
    OutputCancel,
    Ping,
    Pong,
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionResume,
)
from shared.store.registry import SessionRecord

logger = logging.getLogger(__name__)

# How long a fatal error and its close may take to go out once the receive loop has stopped.
CLOSE_FLUSH_S: Final = 5.0


class ClientSession(RestoreFlow):
    def __init__(
        self, ws: WebSocket, dialect: Dialect, services: GatewayServices, principal: Principal | None = None
    ) -> None:
        self._ws = ws
        self._dialect = dialect
        self._s = services
        self._auth: SessionAuth | None = None
        limits = services.limits
        if principal is not None and services.auth is not None:
            self._auth = SessionAuth(principal, services.auth, self._warn_expiring, self._expire)
            if 0 < self._auth.chunks_per_s < limits.max_chunks_per_s:  # the key's rate caps the gateway's
                limits = dataclasses.replace(limits, max_chunks_per_s=self._auth.chunks_per_s)
        self._limits = SessionLimits(limits)
        self.outbox = Outbox(ws, dialect, services.metrics, self._limits.observe_turn)
        self.life = SessionLifecycle()  # its phase, changed only through `life.move` (lifecycle.py)
        self.sid: str | None = None
        self._config = OpenConfig()
        self._record: SessionRecord | None = None
        self._link: Link | None = None
        self._pending: PendingOpen | None = None
        self._closed_future: asyncio.Future[CloseReason | None] | None = None
        self._restore_task: asyncio.Task[None] | None = None
        # seq -> monotonic arrival time, for every chunk forwarded and not yet answered.
        self._in_flight: dict[int, float] = {}
        self._undurable = UndurableTurns()
        # The last seq the session finished, as this socket knows it (the worker's at `opened`, then
        # each done; None: none): every done up to it has been queued for the client, and a chunk at
        # or below it can only be refused (the worker's seq ordering is past it).
        self._finished_seq: int | None = None
        self._length = 0  # the session's length after its last done: a turn's tokens are the growth
        self._expire_task: asyncio.Task[None] | None = None

    # ---- socket lifecycle ---------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the accepted socket until it closes; then let the session go (detach)."""
        reader = asyncio.create_task(self._read_loop(), name="client-reader")
        writer = asyncio.create_task(self.outbox.run(), name="client-writer")
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer not in done and self.outbox.closing:
                # The receive loop stopped after a fatal error: let the error and the close go out.
                await asyncio.wait({writer}, timeout=CLOSE_FLUSH_S)
        finally:
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            await self._release()

    async def _read_loop(self) -> None:
        try:
            while not self.outbox.closing:
                message = await self._ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                received = time.monotonic()
                text: str | None = message.get("text")
                data: str | bytes | None = text if text is not None else message.get("bytes")
                if data is not None:
                    await self.handle_frame(data, received)
        except Exception:  # handle_frame answers every error itself: this is the socket failing
            logger.exception("receive loop of session %s failed", self.sid)

    async def handle_frame(self, data: str | bytes, received: float) -> None:
        """One client frame: decoded, checked, served; every error is answered here."""
        try:
            decoded = self._dialect.decode(data)
        except MicroturnError as exc:
            self._error(exc)
            return
        for reply in decoded.replies:
            self.outbox.put_frame(reply)
        for msg in decoded.messages:
            await self.handle_message(msg, received)

    async def handle_message(self, msg: ClientMessage, received: float) -> None:
        seq = msg.seq if isinstance(msg, InputChunk | OutputCancel) else None
        try:
            await self._dispatch(msg, received)
        except SessionEnded:
            pass
        except MicroturnError as exc:
            self._error(exc, seq)
        except RedisError as exc:
            logger.warning("session store error: %r", exc)
            self._error(WorkerUnavailable("the session store is unavailable", retry_after_ms=1000), seq)
        except Exception:
            logger.exception("client message handling failed (session %s)", self.sid)
            self._error(InternalError("internal gateway error"), seq, fatal=True)

    async def _release(self) -> None:
        """The socket is gone: stop restoring, and detach the session if it is still ours."""
        self.life.end_socket()
        if self._restore_task is not None:
            self._restore_task.cancel()
            await asyncio.gather(self._restore_task, return_exceptions=True)
        self._fail_pending(SessionEnded())
        if self._auth is not None:
            await self._auth.release()
        sid = self.sid
        if sid is None:
            return
        link = self._s.pool.bound_link(sid, self)
        self._s.pool.unbind(sid, self)
        if link is not None and not self.life.gone:
            # A worker that cannot be reached is gone, and its loss ends the session there anyway.
            with contextlib.suppress(WorkerUnavailable):
                await link.send(LinkDetach(sid))

    # ---- client messages ----------------------------------------------------------------------

    async def _dispatch(self, msg: ClientMessage, received: float) -> None:
        if isinstance(msg, InputChunk):
            await self._chunk(msg, received)
        elif isinstance(msg, Ping):
            self.outbox.put(Pong(msg.data))
        elif isinstance(msg, OutputCancel):
            await self._cancel(msg)
        elif isinstance(msg, SessionOpen):
            await self._start(self._open(msg.config))
        elif isinstance(msg, SessionResume):
            await self._start(self._resume(msg))
        elif isinstance(msg, SessionClose):
            await self._close()

    async def _start(self, flow: Coroutine[Any, Any, None]) -> None:
        """Run an open or resume flow; on a recoverable failure the socket is back to IDLE."""
        refusal = self.life.refusal(Request.OPEN)
        if refusal is not None:
            flow.close()
            raise refusal
        self.life.move(Phase.OPENING)
        try:
            await flow
        except BaseException:
            if self.life.phase is Phase.OPENING:
                self._forget_session()
                if self._auth is not None:
                    await self._auth.release()
            raise
        if self._auth is not None and self.life.phase is Phase.ACTIVE:
            self._auth.start()

    def _forget_session(self) -> None:
        if self.sid is not None:
            self._s.pool.unbind(self.sid, self)
        self.life.move(Phase.IDLE)
        self.sid = None
        self._record = None
        self._link = None

    async def _chunk(self, msg: InputChunk, received: float) -> None:
        link, sid = self._link, self.sid
        if self.life.phase is not Phase.ACTIVE or link is None or sid is None:
            self.life.check(Request.CHUNK)  # served otherwise only while RESTORING
            if self.life.phase is not Phase.RESTORING or sid is None:
                raise InternalError(f"a {self.life.phase.value} session without a link")
            # Held, not refused: it goes to the new worker with the tail, or right after its restore.
            self._admit(msg)
            self._in_flight[msg.seq] = received
            self._undurable.add(LinkChunk(sid, msg), sent=False)
            return
        self._admit(msg)
        # In flight before the write: the done can arrive while the write is still draining.
        self._in_flight[msg.seq] = received
        frame = LinkChunk(sid, msg)
        self._undurable.add(frame, sent=True)
        try:
            await link.send(frame)
        except WorkerUnavailable:
            # The link broke under this write: its reader restores the session, and the restoring
            # worker gets this chunk with the tail (it may or may not have arrived here).
            logger.info("session %s: chunk %d goes to the restoring worker", sid, msg.seq)
            return
        self._s.metrics.chunks_forwarded += 1

    def _admit(self, msg: InputChunk) -> None:
        """Every check that can refuse a chunk; raises having changed nothing, or charges its limits."""
        if msg.seq in self._in_flight:
            raise BadSequence(f"seq {msg.seq} is already running")
        finished = self._finished_seq
        if finished is not None and msg.seq <= finished:
            # The worker would refuse it too, but forwarding it would replace the turn's entry in the
            # undurable tail (its delivered output) with a chunk to run: a restore would then run,
            # log and answer the turn a second time.
            raise BadSequence(f"seq {msg.seq} is not above the last finished seq {finished}")
        if self._auth is not None:
            self._auth.check_chunk()
        wants_output = (
            msg.max_output_tokens if msg.max_output_tokens is not None else self._config.max_output_tokens
        ) > 0
        self._limits.admit_chunk(
            msg.seq,
            tokens=None if msg.tokens is None else len(msg.tokens),
            text_chars=len(msg.text or ""),
            wants_output=wants_output,
        )

    async def _cancel(self, msg: OutputCancel) -> None:
        self.life.check(Request.CANCEL)
        if self._link is None or self.sid is None:
            raise InternalError("an active session without a link")
        await self._link.send(LinkCancel(self.sid, msg.seq))

    # ---- worker frames (called by the link reader: no awaiting here) --------------------------

    def on_frame(self, frame: ToGateway) -> None:
        if isinstance(frame, LinkOpened):
            pending = self._pending
            if pending is None or pending.future.done():
                logger.warning("unexpected opened for session %s", frame.sid)
                return
            for message in pending.reply(frame):  # queued before any frame that follows `opened`
                self.outbox.put(message)
            # Cleared here, not when the awaiting coroutine resumes: the replayed dones that follow
            # `opened` on the link are dispatched before it does, and must be forwarded.
            self._pending = None
            pending.future.set_result(frame)
        elif isinstance(frame, LinkClosed):
            self._on_closed(frame.reason)
        elif isinstance(frame, LinkMigrate):
            self._undurable.durable(frame.durable_seq)
            if self.life.phase is Phase.ACTIVE and self._link is not None:
                self._s.metrics.sessions_migrated += 1
                self._move(self._link, "its worker is draining")
        elif isinstance(frame, LinkError) and frame.error.seq is None and self._pending is not None:
            if not self._pending.future.done():
                self._pending.future.set_exception(frame.error.to_exception())
        elif self._pending is not None:
            # A delta/done of an earlier binding racing our attach: the worker replays the dones
            # after `opened`, so forwarding this one too would deliver it twice.
            logger.debug("session %s: dropping %s before opened", frame.sid, frame.op)
        elif isinstance(frame, LinkDelta):
            if self._undurable.delta_is_new(frame):
                self.outbox.put(frame.delta)
        elif isinstance(frame, LinkDone):
            done = frame.done
            if not self._undurable.delivered(frame):
                logger.info("session %s: dropping a second done for seq %d", frame.sid, done.seq)
                return
            started = self._in_flight.pop(done.seq, None)
            self._limits.settle(done.seq)
            if self._finished_seq is None or done.seq > self._finished_seq:
                self._finished_seq = done.seq
            self.outbox.put(done, started)
            # In + out: the growth of the session (at least its outputs, should truncation shrink it).
            grown, self._length = max(frame.length - self._length, len(done.tokens)), frame.length
            if self._auth is not None:
                self._auth.on_done(grown)
        elif isinstance(frame, LinkError):
            error = frame.error
            if error.seq is not None:
                self._in_flight.pop(error.seq, None)
                self._limits.settle(error.seq)
                self._undurable.refused(error.seq)
            self.outbox.put(error)
            if error.fatal:
                self.life.end_session()
                if self.sid is not None:
                    self._s.pool.unbind(self.sid, self)
                self._end(close_code_for(error.code))

    def _on_closed(self, reason: CloseReason) -> None:
        self.life.end_session()
        if self.sid is not None:
            self._s.pool.unbind(self.sid, self)
        self._fail_pending(SessionEnded())
        if self._closed_future is not None and not self._closed_future.done():
            self._closed_future.set_result(reason)
        self.outbox.put(SessionClosed(reason))
        self._end(CLOSE_NORMAL)

    def on_taken_over(self) -> None:
        # Another socket on this gateway resumed the session; the worker will not tell us (the
        # binding stays on the same link), so this is the same as its closed(taken_over).
        logger.info("session %s taken over by another socket", self.sid)
        self._on_closed("taken_over")
