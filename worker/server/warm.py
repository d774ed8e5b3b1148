"""Warm copies: the receiving end of a make-before-break drain (docs/failover.md, "Drain").

A draining worker that hands a session here first sends `warm(sid, config)` over a link it dials
itself (worker/server/switchover.py). This worker reads the session's token log, rebuilds its window
exactly as a restore would (worker/server/restore.py, no tail yet), and opens a copy whose history
is prefilled in the engine's background class (`Engine.warm_async`: after every client row, a
small share a step), so its own sessions do not wait for it. The draining worker keeps serving the
session meanwhile, so the copy then re-reads the log and catches up on the turns logged while it
was built (`extend`; up to `CATCH_UP_ROUNDS`, until it is within `CATCH_UP_TOKENS`), and answers
`warmed`. When the old worker switches, the gateway's `restore` lands here and takes the copy over
(`Engine.open_session(adopt=True)`): only the turns answered since its last read are prefilled,
then the chunks held in the gateway's tail run.

A copy is a session in the COPY phase (worker/server/lifecycle.py): it answers no chunk, writes no
log and deletes no key. When the draining worker sent its KV pages first
(worker/server/kv_receiver.py) the copy already holds the KV up to the copy's point and answers
`warmed` at once (the switch's restore prefills the turns logged after that point); otherwise (a
fallback, counted by the draining worker) it is rebuilt from the log first, as above. It ends when
it is adopted, when the engine discards it (a restore it does not match), when the worker that
asked for it closes it on the same link (`withdraw`: it keeps the session), or `WARM_GRACE_S` after
that link closed without a restore taking it over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Final, Protocol

import redis.asyncio as redis

from shared.errors import InvalidMessage, MicroturnError, WorkerUnavailable
from shared.protocol.link import LinkWarm, LinkWarmed, link_error_from
from shared.protocol.messages import OpenConfig
from shared.settings import WorkerSettings
from shared.store.schema import KeySchema
from worker.engine import Engine, SessionRules, TurnResult
from worker.server.metrics import WorkerMetrics
from worker.server.restore import RestorePlan, plan_restore
from worker.server.sessions import LinkPeer, WorkerSession, WorkerSessions
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
    sessions: WorkerSessions
    metrics: WorkerMetrics
    draining: bool


class WarmCopies:
    def __init__(self, service: WarmHost) -> None:
        self.service = service

    def request(self, link: LinkPeer, frame: LinkWarm) -> None:
        service, sid = self.service, frame.sid
        # A copy whose KV came over already (kv_receiver.py) waits for this request; any other
        # session or copy of that id here is a refusal.
        imported = service.sessions.copy(sid)
        if imported is not None and (not imported.kv_imported or imported.asked_by is not None):
            imported = None
        if service.draining or (imported is None and service.sessions.entry(sid) is not None):
            refusal: MicroturnError = (
                WorkerUnavailable("worker is draining")
                if service.draining
                else InvalidMessage(f"session {sid} is already here")
            )
            link.send(link_error_from(sid, refusal, fatal=True))
            return
        if imported is not None:
            imported.asked_by = link
            copy = imported
            logger.info("warming the copy of session %s its worker sent: catching up from the log", sid)
        else:
            copy = service.sessions.add_copy(sid, link)
            logger.info("warming a copy of session %s for its worker's drain", sid)
        service.loop.create_task(self._warm(copy, frame))

    def adopted(self, sid: str) -> None:
        """A restore of `sid` took over the copy here (sessions.py `adopt`)."""
        self.service.metrics.warm_adopted += 1
        logger.info("session %s: the restore takes over its warm copy", sid)

    def link_gone(self, link: LinkPeer) -> None:
        for copy in self.service.sessions.copies():
            if copy.asked_by is link:
                self.service.loop.call_later(WARM_GRACE_S, self.discard, copy)

    def withdraw(self, link: LinkPeer, sid: str) -> bool:
        """The worker that asked on `link` for the copy of `sid` keeps the session (a rebalance's move
        that did not switch, rebalance.py): the copy ends now, not `WARM_GRACE_S` after the link
        closes, so a later copy of that session here is not refused as already here. False: `link`
        asked for no copy of `sid`, which is left as it is."""
        copy = self.service.sessions.copy(sid)
        if copy is None or copy.asked_by is not link:
            return False
        self._end(copy)
        logger.info("discarded the warm copy of session %s: its worker keeps the session", sid)
        return True

    def forgotten(self, sid: str) -> None:
        """The engine ended the copy on its own (its idle timeout): nothing else to do. (A discard
        drops the copy before it closes its engine session, `_end`; the service ignores that close.)"""
        self.service.sessions.drop_copy(sid)

    async def _warm(self, copy: WorkerSession, frame: LinkWarm) -> None:
        service, sid, link = self.service, frame.sid, copy.asked_by
        assert link is not None
        started = time.monotonic()
        try:
            # Resolved once for every round: the rules a restore plans with, and the copy's config.
            rules = service.engine.session_rules(frame.config)
            idle = rules.config.idle_timeout_s or service.settings.idle_timeout_s
            copy_config = replace(rules.config, idle_timeout_s=idle)
            plan = await self._plan(sid, rules)
            # A copy whose KV came over (`length`: its tokens with KV) answers at once: it is behind
            # only by the turns logged during its transfer, which the switch's restore prefills
            # with the held chunks. Built here first, they would wait in the background share
            # behind this worker's own clients, which under load leave it next to nothing: the
            # copy would miss the drain's deadline and its session go break-before-make.
            length = copy.length
            result: TurnResult | None = None
            if not copy.kv_imported:  # rebuilt from the log, in the background share
                if service.sessions.copy(sid) is not copy:
                    return  # adopted, discarded or withdrawn while the log was read: build nothing
                result = await self._build(sid, copy_config, plan, extend=False)
                length = result.length
            # A rebuilt copy took long: the old worker streamed the session on meanwhile. Catch up
            # on what it logged while the copy was built, so the switch prefills only the last
            # round's turns.
            for _ in range(0 if copy.kv_imported else CATCH_UP_ROUNDS):
                if result is None or service.sessions.copy(sid) is not copy or result.finish == "cancelled":
                    return  # adopted or discarded while it warmed
                latest = await self._plan(sid, rules)
                if len(latest.history) - result.length <= CATCH_UP_TOKENS:
                    break
                if service.sessions.copy(sid) is not copy:
                    return
                plan = latest
                result = await self._build(sid, copy_config, plan, extend=True)
                length = result.length
        except (redis.RedisError, ValueError, MicroturnError) as exc:
            logger.warning("could not warm a copy of session %s: %s", sid, exc)
            self._end(copy)  # the engine's copy goes too, quietly
            error = exc if isinstance(exc, MicroturnError) else WorkerUnavailable(f"no copy: {exc}")
            link.send(link_error_from(sid, error, fatal=True))
            return
        if service.sessions.copy(sid) is not copy or (result is not None and result.finish == "cancelled"):
            return  # adopted or discarded while it warmed
        service.metrics.warm_copies += 1
        if copy.kv_imported:
            service.metrics.warm_from_pages += 1
        else:
            service.metrics.warm_rebuilds += 1
        logger.info(
            "warm copy of session %s ready: %d tokens, log to seq %s, %s, in %.0f ms",
            sid,
            length,
            plan.durable_seq,
            "its KV copied from its worker" if copy.kv_imported else "rebuilt from the log",
            (time.monotonic() - started) * 1000,
        )
        link.send(LinkWarmed(sid, length, plan.durable_seq))

    async def _plan(self, sid: str, rules: SessionRules) -> RestorePlan:
        """The session's window as its log has it now, as a restore would rebuild it (no tail)."""
        service = self.service
        log = await read_log_bytes(service.redis, service.schema, sid)
        return plan_restore(sid, log, (), None, rules=rules)

    async def _build(self, sid: str, config: OpenConfig, plan: RestorePlan, *, extend: bool) -> TurnResult:
        """The engine's copy built (or extended) to `plan`. Called only while the copy is current, in
        the same event-loop turn as that check: a discard or withdrawal after it queues its engine
        close behind this build, so no engine session outlives its copy's entry."""
        future = self.service.engine.warm_async(
            sid,
            config=config,
            history=plan.history,
            accepted_seq=plan.finished_seq,
            text_tail=plan.text_tail,
            extend=extend,
        )
        return await asyncio.wrap_future(future)

    def discard(self, copy: WorkerSession) -> None:
        """End `copy` here (engine session included) unless a restore took it over meanwhile."""
        if self._end(copy):  # else adopted meanwhile, or asked for again
            logger.info("discarded the warm copy of session %s: no restore took it over", copy.sid)

    def _end(self, copy: WorkerSession) -> bool:
        """`copy` ends, its entry first, then its engine session (whose close the service ignores);
        False: it is no longer this sid's copy here, and nothing is done."""
        if not self.service.sessions.drop_copy(copy.sid, copy):
            return False
        self.service.engine.close_session_async(copy.sid, WARM_DISCARDED)
        return True
