"""Moving a live session to another worker: after its worker was lost, or when it drains.

Why apart from client_session.py: this is the one flow that runs beside the socket's receive loop
(a task started from the link reader's callbacks) and it owns the exactly-once machinery of
docs/failover.md: the restore frame carries the undurable tail (gateway/undurable.py), chunks that arrive
meanwhile are held and sent once the new worker answered, and nothing in flight is failed back.
`RestoreFlow` extends `SessionFlows` (whose primitives it uses) and `ClientSession` extends it; the
state it reads is the session's own (declared once, in `SessionFlows`).

Invariant: the session stays RESTORING until every held chunk has been sent on the new link and the
link is still the bound one; no await separates that check from becoming ACTIVE, so a chunk that
arrives meanwhile is either held (and sent here) or sent by the receive loop after, never before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from redis.exceptions import RedisError

from gateway.lifecycle import Phase, SessionEnded
from gateway.links import Link
from gateway.session_flows import Reply, SessionFlows
from shared.errors import CapacityExhausted, InternalError, MicroturnError, WorkerUnavailable
from shared.protocol.link import LinkOpened, LinkRestore
from shared.protocol.messages import ServerMessage, SessionRestored
from shared.store.registry import SessionRecord

logger = logging.getLogger(__name__)

# Delays before each placement attempt of one restore (the first goes at once: suspects are skipped).
RESTORE_BACKOFF_S: Final = (0.0, 0.25, 0.5, 1.0)


class RestoreFlow(SessionFlows):
    """The restore flow and the link-loss / migrate entry points; `ClientSession` extends it."""

    async def _restore(self, sid: str, record: SessionRecord, reply: Reply, seen_seq: int | None) -> None:
        """Place the session on a live worker and rebuild it there from its token log; `seen_seq` is
        the last output seq the client saw (`LinkRestore.seen_seq`)."""
        s = self._s
        last: MicroturnError = WorkerUnavailable("no worker could take the session")
        for delay in RESTORE_BACKOFF_S:
            if delay:
                await asyncio.sleep(delay)
            try:
                placed = await s.store.move(sid, record, self._config)
            except CapacityExhausted as exc:
                last = exc
                continue
            link = s.pool.link(placed.url, placed.record.worker)
            tail = self._undurable.snapshot()
            record = placed.record
            frame = LinkRestore(
                sid, self._config, None, seen_seq, record.token_sha256, record.created_ms, tail, record.auth
            )
            try:
                opened = await self._request(sid, link, frame, reply)
                self._undurable.durable(opened.durable_seq)
                await self._send_held(sid, link)
            except (WorkerUnavailable, CapacityExhausted) as exc:
                logger.warning("restore of %s on %s failed (%s)", sid, placed.record.worker, exc)
                last = exc
                continue
            self._activate(link, placed.record, opened)
            s.metrics.sessions_restored += 1
            s.metrics.chunks_replayed += len(tail)
            logger.info("session %s restored on %s (length %d)", sid, placed.record.worker, opened.length)
            return
        raise last

    async def _send_held(self, sid: str, link: Link) -> None:
        """Send the chunks held since the restore frame was built; the session stays RESTORING (so
        new chunks keep being held, in order) until none is left and the link is still ours."""
        while held := self._undurable.take_unsent():
            for chunk in held:
                await link.send(chunk)
        if self._s.pool.bound_link(sid, self) is not link:
            raise WorkerUnavailable(f"link to {link.url} broke during the restore")

    async def _restore_after_loss(self, sid: str, record: SessionRecord) -> None:
        def restored(opened: LinkOpened) -> list[ServerMessage]:
            return [SessionRestored(sid, opened.length)]

        try:
            # Every done up to the finished seq has been queued for the client: it is what it saw.
            await self._restore(sid, record, restored, self._finished_seq)
        except SessionEnded:
            pass
        except MicroturnError as exc:
            # Fatal for this socket, not for the session: its record and log stay, so a later
            # session.resume (when a worker has room again) restores it.
            logger.warning("could not restore session %s: %s", sid, exc)
            self._s.pool.unbind(sid, self)
            self.life.end_session()
            self._error(exc, fatal=True)
        except RedisError as exc:
            logger.warning("session store error while restoring %s: %r", sid, exc)
            self.life.end_session()
            self._error(
                WorkerUnavailable("the session store is unavailable", retry_after_ms=1000), fatal=True
            )
        except Exception:
            logger.exception("restore of session %s crashed", sid)
            self.life.end_session()
            self._error(InternalError("internal gateway error"), fatal=True)

    def on_link_lost(self, link: Link) -> None:
        self._fail_pending(WorkerUnavailable(f"link to {link.url} broke"))
        if self._closed_future is not None and not self._closed_future.done():
            self._closed_future.set_result(None)  # _close ends the session itself
        self._move(link, "the link to its worker broke")

    def _move(self, link: Link, why: str) -> None:
        """Restore the session on another worker with its undurable tail (a crash or a drain)."""
        if self.life.phase is not Phase.ACTIVE or self.sid is None or self._record is None:
            return
        logger.warning(
            "session %s leaves worker %s (%s); restoring with %d undurable chunk(s)",
            self.sid,
            link.url,
            why,
            len(self._undurable),
        )
        self._s.pool.unbind(self.sid, self)  # the old worker's late frames are not ours any more
        self.life.move(Phase.RESTORING)
        self._restore_task = asyncio.create_task(
            self._restore_after_loss(self.sid, self._record), name=f"restore {self.sid}"
        )
