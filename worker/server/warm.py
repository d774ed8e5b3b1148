"""Warm copies: the receiving end of a make-before-break drain (docs/failover.md, "Drain").

A draining worker that hands a session here first sends `warm(sid, config)` over a link it dials
itself (worker/server/handover.py). This worker reads the session's token log, rebuilds its window
exactly as a restore would (worker/server/restore.py, no tail yet), and opens a copy whose history
is prefilled in the engine's background class (`Engine.warm_async`: after every client row, a
small share a step), so its own sessions do not wait for it. The draining worker keeps serving the
session meanwhile, so the copy then re-reads the log and catches up on the turns logged while it
was built (`extend`; up to `CATCH_UP_ROUNDS`, until it is within `CATCH_UP_TOKENS`), and answers
`warmed`. When the old worker switches, the gateway's `restore` lands here and takes the copy over
(`Engine.open_session(adopt=True)`): only the turns answered since its last read are prefilled,
then the chunks held in the gateway's tail run.

A copy is not a live session: it is in no directory, answers no chunk, writes no log and deletes no
key. It ends when it is adopted, when the engine discards it (a restore it does not match), or
`WARM_GRACE_S` after the link that asked for it closed without a restore taking it over.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Final, Protocol

import redis.asyncio as redis

from shared.errors import InvalidMessage, MicroturnError, WorkerUnavailable
from shared.protocol.link import LinkWarm, LinkWarmed, link_error_from
from shared.protocol.messages import OpenConfig
from shared.settings import WorkerSettings
from shared.store.schema import KeySchema
from worker.engine import Engine, TurnResult
from worker.engine.memory.window import resolve_prefix, session_limit
from worker.server.bindings import LinkPeer, SessionDirectory
from worker.server.metrics import WorkerMetrics
from worker.server.restore import RestorePlan, plan_restore
from worker.server.token_log import read_log_bytes

logger = logging.getLogger(__name__)

# How long a copy waits for its restore once the draining worker's link closed: the gateway's
# restore follows the old worker's `migrate` by a round trip to Redis and back.
WARM_GRACE_S: Final = 10.0
# A built copy re-reads the log and catches up while it is more than this many tokens behind (about
# one warm piece: what the switch then prefills is one short step), at most this many rounds.
CATCH_UP_TOKENS: Final = 64
CATCH_UP_ROUNDS: Final = 3
# The reason a discarded copy's engine session ends with: the service ignores it (no log, no keys).
WARM_DISCARDED: Final = "warm_discarded"


class WarmHost(Protocol):
    """What warming needs of the worker's service (worker/server/service.py)."""

    engine: Engine
    redis: redis.Redis
    schema: KeySchema
    settings: WorkerSettings
    loop: asyncio.AbstractEventLoop
    directory: SessionDirectory
    metrics: WorkerMetrics
    draining: bool


class WarmCopies:
    def __init__(self, service: WarmHost) -> None:
        self.service = service
        self.copies: dict[str, LinkPeer] = {}  # sid -> the link of the worker that asked for it

    def request(self, link: LinkPeer, frame: LinkWarm) -> None:
        service = self.service
        if service.draining or service.directory.get(frame.sid) is not None or frame.sid in self.copies:
            refusal: MicroturnError = (
                WorkerUnavailable("worker is draining")
                if service.draining
                else InvalidMessage(f"session {frame.sid} is already here")
            )
            link.send(link_error_from(frame.sid, refusal, fatal=True))
            return
        self.copies[frame.sid] = link
        logger.info("warming a copy of session %s for its worker's drain", frame.sid)
        service.loop.create_task(self._warm(link, frame))

    def adopt(self, sid: str) -> bool:
        """A restore of `sid` arrived: True when a copy is here for it to take over."""
        if self.copies.pop(sid, None) is None:
            return False
        self.service.metrics.warm_adopted += 1
        logger.info("session %s: the restore takes over its warm copy", sid)
        return True

    def owns(self, sid: str) -> bool:
        """Whether the engine session `sid` is a copy (not a live session of this worker)."""
        return sid in self.copies and self.service.directory.get(sid) is None

    def link_gone(self, link: LinkPeer) -> None:
        for sid, asked in list(self.copies.items()):
            if asked is link:
                self.service.loop.call_later(WARM_GRACE_S, self._discard, sid, link)

    def forgotten(self, sid: str) -> None:
        """The engine ended the copy (its idle timeout): nothing else to do."""
        self.copies.pop(sid, None)

    async def _warm(self, link: LinkPeer, frame: LinkWarm) -> None:
        service, sid = self.service, frame.sid
        try:
            # Resolved once for every round: the config a restore plans with, and the copy's own.
            config, _prefix = resolve_prefix(frame.config, service.engine.text)
            limit = session_limit(config, service.engine.context_limit)
            idle = config.idle_timeout_s or service.settings.idle_timeout_s
            copy_config = replace(config, idle_timeout_s=idle)
            plan = await self._plan(sid, config, limit)
            result = await self._build(sid, copy_config, plan, extend=False)
            # The old worker streams the session on meanwhile: catch up on what it logged while
            # this copy was built, so the switch itself prefills only the last round's turns.
            for _ in range(CATCH_UP_ROUNDS):
                if self.copies.get(sid) is not link or result.finish == "cancelled":
                    return  # adopted or discarded while it warmed
                latest = await self._plan(sid, config, limit)
                if len(latest.history) - result.length <= CATCH_UP_TOKENS:
                    break
                plan = latest
                result = await self._build(sid, copy_config, plan, extend=True)
        except (redis.RedisError, ValueError, MicroturnError) as exc:
            logger.warning("could not warm a copy of session %s: %s", sid, exc)
            if self.copies.get(sid) is link:
                del self.copies[sid]
            error = exc if isinstance(exc, MicroturnError) else WorkerUnavailable(f"no copy: {exc}")
            link.send(link_error_from(sid, error, fatal=True))
            return
        if self.copies.get(sid) is not link or result.finish == "cancelled":
            return  # adopted or discarded while it warmed
        service.metrics.warm_copies += 1
        logger.info(
            "warm copy of session %s ready: %d tokens, log to seq %s", sid, result.length, plan.durable_seq
        )
        link.send(LinkWarmed(sid, result.length, plan.durable_seq))

    async def _plan(self, sid: str, config: OpenConfig, limit: int) -> RestorePlan:
        """The session's window as its log has it now, as a restore would rebuild it (no tail)."""
        service = self.service
        log = await read_log_bytes(service.redis, service.schema, sid)
        return plan_restore(sid, log, (), None, text=service.engine.text, config=config, limit=limit)

    async def _build(self, sid: str, config: OpenConfig, plan: RestorePlan, *, extend: bool) -> TurnResult:
        future = self.service.engine.warm_async(
            sid,
            config=config,
            history=plan.history,
            accepted_seq=plan.finished_seq,
            text_tail=plan.text_tail,
            extend=extend,
        )
        return await asyncio.wrap_future(future)

    def _discard(self, sid: str, link: LinkPeer) -> None:
        if self.copies.get(sid) is not link:
            return  # adopted meanwhile, or asked for again
        del self.copies[sid]
        logger.info("discarding the warm copy of session %s: no restore took it over", sid)
        self.service.engine.close_session_async(sid, WARM_DISCARDED)
