"""Registration in Redis and the heartbeat that keeps it (and active sessions' keys) alive.

Redis holds nothing the workers cannot rebuild (docs/failover.md): when a heartbeat finds the
worker's own registry hash gone (Redis restarted empty, or the hash expired while the loop
stalled), the same beat has re-created it, and the worker then re-writes the record and the whole
token log of every session it holds, so resumes and restores work again within a beat. When only
part of Redis lost writes (a Redis Cluster master failover: its replica never got the last ones),
the beat finds the sessions concerned (a record gone at the TTL refresh, a log that an append or a
periodic scan finds shorter than written) and re-writes those (shared/store/held.py). An outage
logs one line when it starts and one when it ends, not a traceback per beat.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, replace

import redis.asyncio as redis

from shared.store.connection import OutageLog
from shared.store.held import find_damaged, repair_sessions, rewrite_sessions
from shared.store.models import ModelCard, write_model
from shared.store.registry import WorkerInfo, heartbeat, touch_sessions
from shared.store.schema import KeySchema
from worker.engine import Engine
from worker.server.handover import held_sessions
from worker.server.service import WorkerService

logger = logging.getLogger(__name__)

# A worker missing this many heartbeats in a row is dead to placement.
HEARTBEATS_PER_TTL = 3
# Every this many beats, every held session's keys are checked (active ones are at every beat, by
# their TTL refresh and their appends): two commands per held session per scan.
SCAN_EVERY_BEATS = 10


def worker_info(base: WorkerInfo, engine: Engine, *, draining: bool) -> WorkerInfo:
    """`base` (identity and limits, fixed at start) with the engine's current load."""
    stats = engine.stats()
    return replace(
        base,
        sessions=stats.sessions,
        kv_tokens_free=stats.kv_tokens_free,
        kv_tokens_total=stats.kv_tokens_total,
        state="draining" if draining else "ready",
        prefixes=stats.memory.prefix.held_prefixes if stats.memory.prefix is not None else (),
    )


def model_card(engine: Engine) -> ModelCard:
    """What gateways need of this worker's model to render conversations (shared/store/models.py)."""
    tokenizer = engine.tokenizer
    template = None if tokenizer is None else tokenizer.chat_template
    return ModelCard(
        name=engine.model_config.name,
        chat_template="" if template is None else template.source,
        bos_token="" if template is None else template.bos_token,
        eos_token="" if template is None else template.eos_token,
        eos_token_ids=() if tokenizer is None else tokenizer.eos_token_ids,
    )


async def rewrite_held(client: redis.Redis, schema: KeySchema, service: WorkerService) -> int:
    """Re-write every held session's record and log (no flush interleaves: same lock)."""
    async with service.sessions.log_writer.redis_turn:
        return await rewrite_sessions(client, schema, held_sessions(service))


@dataclass(frozen=True)
class Beat:
    """One worker's heartbeat: what it writes every `period_s`, and what it refreshes."""

    client: redis.Redis
    schema: KeySchema
    base: WorkerInfo
    service: WorkerService
    period_s: float
    grace_s: float

    async def once(self, *, draining: bool, scan: bool = False) -> None:
        """One beat; `scan`: also compare every held session's keys with what this worker wrote."""
        info = await asyncio.to_thread(worker_info, self.base, self.service.engine, draining=draining)
        existed = await heartbeat(self.client, self.schema, info, self.period_s * HEARTBEATS_PER_TTL)
        if not existed:
            await write_model(self.client, self.schema, model_card(self.service.engine))
            count = await rewrite_held(self.client, self.schema, self.service)
            logger.warning(
                "worker %s: its registry entry was gone; re-registered and re-wrote %d session(s)",
                self.base.worker_id,
                count,
            )
        touched = self.service.sessions.take_touched()
        # Sessions share a TTL per idle timeout: one batched refresh for each distinct timeout.
        by_timeout: dict[float, list[str]] = {}
        for sid, idle in touched.items():
            by_timeout.setdefault(idle, []).append(sid)
        token_log = self.service.sessions.log_writer
        for idle, sids in by_timeout.items():
            token_log.damaged.update(
                await touch_sessions(self.client, self.schema, sids, idle + self.grace_s)
            )
        if scan:  # idle sessions too: the last writes of one that went quiet may be the lost ones
            lengths = {sid: len(log) for sid, log in token_log.held_logs().items()}
            token_log.damaged.update(await find_damaged(self.client, self.schema, lengths))
        if existed and token_log.damaged:
            await self.repair()

    async def repair(self) -> None:
        """Re-write the held sessions Redis lost part of (a failover on their shard)."""
        token_log = self.service.sessions.log_writer
        async with token_log.redis_turn:  # no flush interleaves: the mirror is what Redis must hold
            damaged, token_log.damaged = token_log.damaged, set()
            held = [h for h in held_sessions(self.service) if h.sid in damaged]
            try:
                count = await repair_sessions(self.client, self.schema, self.base.worker_id, held)
            except redis.RedisError:
                token_log.damaged |= damaged  # the next beat tries again
                raise
        logger.warning("worker %s: re-wrote %d session(s) Redis lost writes of", self.base.worker_id, count)


async def heartbeat_loop(
    client: redis.Redis,
    schema: KeySchema,
    base: WorkerInfo,
    service: WorkerService,
    *,
    period_s: float,
    grace_s: float,
    draining: asyncio.Event,
) -> None:
    outage = OutageLog("heartbeat", logger)
    beat = Beat(client, schema, base, service, period_s, grace_s)
    task = asyncio.current_task()
    for count in itertools.count():
        try:
            await beat.once(draining=draining.is_set(), scan=count % SCAN_EVERY_BEATS == 0)
        except redis.RedisError as exc:
            outage.failed(exc)
        else:
            outage.succeeded()
        # A cancel that reached a Redis command can come out as that command's timeout (redis-py's
        # own `asyncio.timeout`, racing it), caught above: the beat would go on, and a drain waiting
        # for it to end (app.py) would wait out its deadline. A cancel asked for ends the loop here.
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        await asyncio.sleep(period_s)
