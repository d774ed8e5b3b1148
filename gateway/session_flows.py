"""Opening, resuming and closing a client's session (the flows that place it on a worker and end
it there), and ending it when it outlives its credential.

Why apart from client_session.py: these are the steps of a socket's life that await Redis and a
worker's `opened` or `closed` (docs/design.md section 5: placement, resume, worker loss); the
per-chunk path and the worker-frame dispatch never call them. `SessionFlows` is the base of
`ClientSession`, which owns the state both share (declared below and in `RestoreFlow`) and answers
the link's callbacks.

Invariants (see client_session.py for the whole picture):
- The session (`sid`) is bound in the link pool before open/attach/restore is sent, so the answer
  cannot arrive unrouted; a request that got no answer unbinds it again.
- A flow that fails leaves nothing placed: an open whose worker refused deletes the session keys
  before trying the next worker.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

from redis.exceptions import RedisError

from gateway.auth.session_auth import SessionAuth
from gateway.lifecycle import Phase, Request, SessionEnded, SessionLifecycle
from gateway.limits import SessionLimits
from gateway.links import Link
from gateway.outbox import Outbox
from gateway.services import GatewayServices
from gateway.undurable import UndurableTurns
from shared.errors import (
    CapacityExhausted,
    InternalError,
    MicroturnError,
    SessionExpired,
    SessionNotFound,
    WorkerUnavailable,
)
from shared.protocol.close_codes import CLOSE_NORMAL, close_code_for, error_message_from
from shared.protocol.link import LinkAttach, LinkClose, LinkOpen, LinkOpened, ToGateway, ToWorker
from shared.protocol.messages import (
    CloseReason,
    OpenConfig,
    ServerMessage,
    SessionClosed,
    SessionExpiring,
    SessionOpened,
    SessionRestored,
    SessionResume,
    SessionResumed,
)
from shared.store.registry import SessionRecord, new_resume_token

logger = logging.getLogger(__name__)

# Workers tried for one open or restore before giving up (placement charges each pick, so a dead
# worker that is still registered loses the next pick to a live one).
PLACEMENT_ATTEMPTS: Final = 3


# Builds the client's answer to an open/attach/restore from the worker's `opened`.
Reply: TypeAlias = Callable[[LinkOpened], list[ServerMessage]]


@dataclass(slots=True)
class PendingOpen:
    """An open/attach/restore awaiting `opened`; `reply` builds the client's answer from it."""

    future: asyncio.Future[LinkOpened]
    reply: Reply


class SessionFlows(abc.ABC):
    """Open, resume and close for one socket, and the primitives every flow uses (send a request and
    await `opened`, activate, fail). `RestoreFlow` extends it with the restore; `ClientSession`, at
    the end of the chain, sets every field declared here and answers the link's callbacks."""

    _s: GatewayServices
    _auth: SessionAuth | None
    _limits: SessionLimits
    outbox: Outbox
    life: SessionLifecycle
    sid: str | None
    _config: OpenConfig
    _record: SessionRecord | None
    _link: Link | None
    _pending: PendingOpen | None
    _undurable: UndurableTurns
    _finished_seq: int | None
    _length: int
    _closed_future: asyncio.Future[CloseReason | None] | None
    _restore_task: asyncio.Task[None] | None
    _expire_task: asyncio.Task[None] | None

    # The link pool routes the session's frames to these (gateway/links.py `LinkListener`).
    @abc.abstractmethod
    def on_frame(self, frame: ToGateway) -> None: ...

    @abc.abstractmethod
    def on_link_lost(self, link: Link) -> None: ...

    @abc.abstractmethod
    def on_taken_over(self) -> None: ...

    @abc.abstractmethod
    async def _restore(self, sid: str, record: SessionRecord, reply: Reply, seen_seq: int | None) -> None:
        """Place the session on a live worker and rebuild it there (restore_flow.py)."""

    def _error(self, exc: MicroturnError, seq: int | None = None, *, fatal: bool | None = None) -> None:
        message = error_message_from(exc, seq, fatal=fatal)
        self.outbox.put(message)
        if message.fatal:
            self._end(close_code_for(exc.code))

    def _end(self, code: int) -> None:
        self.life.end_socket()
        self.outbox.close(code)

    def _fail_pending(self, exc: BaseException) -> None:
        if self._pending is not None and not self._pending.future.done():
            self._pending.future.set_exception(exc)

    # ---- open, resume, close ----------------------------------------------------------------

    async def _request(self, sid: str, link: Link, frame: ToWorker, reply: Reply) -> LinkOpened:
        """Send open/attach/restore on `link` and await `opened`; `reply` is queued when it arrives."""
        future: asyncio.Future[LinkOpened] = asyncio.get_running_loop().create_future()
        self._pending = PendingOpen(future, reply)
        self._s.pool.bind(sid, self, link)
        answered = False
        try:
            await link.send(frame)
            opened = await asyncio.wait_for(future, self._s.settings.open_timeout_s)
            answered = True
            return opened
        except TimeoutError:
            raise WorkerUnavailable(f"worker at {link.url} did not answer {frame.op} in time") from None
        finally:
            if self._pending is not None and self._pending.future is future:
                self._pending = None
            if not answered:  # whatever the worker says later for this request is not ours to route
                self._s.pool.unbind(sid, self)

    def _activate(self, link: Link, record: SessionRecord, opened: LinkOpened) -> None:
        self._link = link
        self._record = record
        self._finished_seq = opened.finished_seq
        self._length = opened.length
        self.life.move(Phase.ACTIVE)

    async def _open(self, config: OpenConfig) -> None:
        s = self._s
        sid = uuid.uuid4().hex
        token = new_resume_token()
        self.sid, self._config = sid, config
        limits = self._limits.values.as_map()
        grant = None
        if self._auth is not None:
            await self._auth.admit_open(sid)
            limits.update(self._auth.limits_map())
            grant = self._auth.grant()
        last: MicroturnError | None = None
        for _ in range(PLACEMENT_ATTEMPTS):
            try:
                placed = await s.store.place_new(sid, token, config, grant)
            except CapacityExhausted:
                # The workers that had room could not be reached (now suspect): that is the truth.
                if last is not None:
                    raise last from None
                raise
            link = s.pool.link(placed.url, placed.record.worker)
            model = placed.record.model

            def reply(opened: LinkOpened, model: str = model) -> list[ServerMessage]:
                return [SessionOpened(sid, token, model, limits)]

            try:
                record = placed.record
                frame = LinkOpen(sid, config, (), record.token_sha256, record.created_ms, record.auth)
                opened = await self._request(sid, link, frame, reply)
            except (WorkerUnavailable, CapacityExhausted) as exc:
                logger.warning("open on worker %s failed (%s); trying another", placed.record.worker, exc)
                await s.store.delete(sid)
                last = exc
                continue
            except MicroturnError:
                await s.store.delete(sid)
                raise
            self._activate(link, placed.record, opened)
            s.metrics.sessions_opened += 1
            logger.info("session %s opened on worker %s", sid, placed.record.worker)
            return
        assert last is not None
        raise last

    async def _resume(self, msg: SessionResume) -> None:
        s = self._s
        sid = msg.session_id
        record, config = await s.store.lookup(sid, msg.resume_token)
        if self._auth is not None:
            await self._auth.admit_resume(sid, record.created_ms, record.auth)
        self.sid, self._config, self._record = sid, config, record

        def resumed(opened: LinkOpened) -> list[ServerMessage]:
            return [SessionResumed(sid, opened.length, opened.finished_seq)]

        url = await s.store.worker_url(record.worker)
        if url is not None:
            link = s.pool.link(url, record.worker)
            try:
                opened = await self._request(sid, link, LinkAttach(sid, msg.last_seq), resumed)
            except (WorkerUnavailable, SessionNotFound, CapacityExhausted) as exc:
                logger.warning("attach of %s on worker %s failed (%s); restoring", sid, record.worker, exc)
            else:
                self._activate(link, record, opened)
                s.metrics.sessions_resumed += 1
                return

        def resumed_elsewhere(opened: LinkOpened) -> list[ServerMessage]:
            return [*resumed(opened), SessionRestored(sid, opened.length)]

        await self._restore(sid, record, resumed_elsewhere, msg.last_seq)
        s.metrics.sessions_resumed += 1

    async def _close(self) -> None:
        """`session.close`: the worker ends the session and confirms; unconfirmed, it ends here."""
        if self.life.phase is Phase.RESTORING and self._restore_task is not None:
            await asyncio.gather(self._restore_task, return_exceptions=True)
        self.life.check(Request.CLOSE)
        if self.life.phase is Phase.IDLE:  # nothing to close: say so politely and hang up
            self.outbox.put(SessionClosed("closed"))
            self._end(CLOSE_NORMAL)
            return
        sid, link = self.sid, self._link
        if sid is None or link is None:
            raise InternalError("an active session without a link")
        self.life.move(Phase.CLOSING)
        self._closed_future = asyncio.get_running_loop().create_future()
        try:
            await link.send(LinkClose(sid))
            reason = await asyncio.wait_for(self._closed_future, self._s.settings.open_timeout_s)
        except (WorkerUnavailable, TimeoutError):
            reason = None
        if reason is None and not self.life.gone:
            # The worker could not confirm: end the session here, so it cannot be resumed.
            logger.warning("worker did not confirm close of %s; deleting its keys", sid)
            self._s.pool.unbind(sid, self)
            self.life.end_session()
            await self._s.store.delete(sid)
            self.outbox.put(SessionClosed("closed"))
            self._end(CLOSE_NORMAL)

    # ---- credential limits (called by SessionAuth's timers and on_done: no awaiting here) ----------

    def _warn_expiring(self, warning: SessionExpiring) -> None:
        if not self.life.ended:
            self.outbox.put(warning)

    def _expire(self, why: str) -> None:
        """The session reached a limit of its credential: it ends on the worker, the client is told."""
        sid, link = self.sid, self._link
        if self.life.ended or sid is None:
            return
        logger.info("session %s expired: %s", sid, why)
        self._fail_pending(SessionEnded())
        self._s.pool.unbind(sid, self)
        if link is not None:
            self._expire_task = asyncio.create_task(self._close_on_worker(link, sid), name=f"expire {sid}")
        self.life.end_session()
        self._error(SessionExpired(why), fatal=True)

    async def _close_on_worker(self, link: Link, sid: str) -> None:
        try:
            await link.send(LinkClose(sid))
        except WorkerUnavailable:
            # No worker to tell: end the session in Redis so it cannot be resumed or restored.
            with contextlib.suppress(RedisError, OSError):
                await self._s.store.delete(sid)
