"""Registration in Redis and the heartbeat that keeps it (and active sessions' keys) alive.

Redis holds nothing the workers cannot rebuild (docs/failover.md): when a heartbeat finds the
worker's own registry hash gone (Redis restarted empty, or the hash expired while the loop
stalled), the same beat has re-created it, and the worker then re-writes the record and the whole
token log of every session it holds, so resumes and restores work again within a beat. An outage
logs one line when it starts and one when it ends, not a traceback per beat.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

import redis.asyncio as redis

from shared.store.connection import OutageLog
from shared.store.models import ModelCard, write_model
from shared.store.registry import WorkerInfo, heartbeat, rewrite_sessions, touch_sessions
from shared.store.schema import KeySchema
from worker.engine import Engine
from worker.server.handover import held_sessions
from worker.server.service import WorkerService

logger = logging.getLogger(__name__)

# A worker missing this many heartbeats in a row is dead to placement.
HEARTBEATS_PER_TTL = 3


def worker_info(base: WorkerInfo, engine: Engine, *, draining: bool) -> WorkerInfo:
    """`base` (identity and limits, fixed at start) with the engine's current load."""
    stats = engine.stats()
    return replace(
        base,
        sessions=stats.sessions,
        kv_tokens_free=stats.kv_tokens_free,
        kv_tokens_total=stats.kv_tokens_total,
        state="draining" if draining else "ready",
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
    async with service.token_log.redis_turn:
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

    async def once(self, *, draining: bool) -> None:
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
        touched = self.service.directory.take_touched()
        # Sessions share a TTL per idle timeout: one batched refresh for each distinct timeout.
        by_timeout: dict[float, list[str]] = {}
        for sid, idle in touched.items():
            by_timeout.setdefault(idle, []).append(sid)
        for idle, sids in by_timeout.items():
            await touch_sessions(self.client, self.schema, sids, idle + self.grace_s)


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
    while True:
        try:
            await beat.once(draining=draining.is_set())
        except redis.RedisError as exc:
            outage.failed(exc)
        else:
            outage.succeeded()
        await asyncio.sleep(period_s)
