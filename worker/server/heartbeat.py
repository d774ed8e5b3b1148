"""Registration in Redis and the heartbeat that keeps it (and active sessions' keys) alive."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as redis

from shared.redis_schema import KeySchema
from shared.registry import WorkerInfo, heartbeat, touch_sessions
from worker.engine import Engine
from worker.server.directory import SessionDirectory

logger = logging.getLogger(__name__)

# A worker missing this many heartbeats in a row is dead to placement.
HEARTBEATS_PER_TTL = 3


def worker_info(base: WorkerInfo, engine: Engine, *, draining: bool) -> WorkerInfo:
    stats = engine.stats()
    return WorkerInfo(
        worker_id=base.worker_id,
        url=base.url,
        model=base.model,
        max_sessions=base.max_sessions,
        sessions=stats.sessions,
        kv_tokens_free=stats.kv_tokens_free,
        kv_tokens_total=stats.kv_tokens_total,
        state="draining" if draining else "ready",
    )


async def beat_once(
    client: redis.Redis,
    schema: KeySchema,
    base: WorkerInfo,
    engine: Engine,
    directory: SessionDirectory,
    *,
    period_s: float,
    grace_s: float,
    draining: bool,
) -> None:
    info = await asyncio.to_thread(worker_info, base, engine, draining=draining)
    await heartbeat(client, schema, info, period_s * HEARTBEATS_PER_TTL)
    touched = directory.take_touched()
    # Sessions share a TTL per idle timeout: one batched refresh for each distinct timeout.
    by_timeout: dict[float, list[str]] = {}
    for sid, idle in touched.items():
        by_timeout.setdefault(idle, []).append(sid)
    for idle, sids in by_timeout.items():
        await touch_sessions(client, schema, sids, idle + grace_s)


async def heartbeat_loop(
    client: redis.Redis,
    schema: KeySchema,
    base: WorkerInfo,
    engine: Engine,
    directory: SessionDirectory,
    *,
    period_s: float,
    grace_s: float,
    draining: asyncio.Event,
) -> None:
    while True:
        try:
            await beat_once(
                client,
                schema,
                base,
                engine,
                directory,
                period_s=period_s,
                grace_s=grace_s,
                draining=draining.is_set(),
            )
        except redis.RedisError:
            logger.warning("heartbeat failed; retrying", exc_info=True)
        await asyncio.sleep(period_s)
