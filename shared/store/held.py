"""The sessions a worker holds, written back to Redis when Redis lost them (whole or in part).

Why the worker: it holds each session's record and confirmed log in memory (the log's mirror), so
it is the one place that can re-write what Redis lost. Two losses:
- all of Redis (a restart with no persistence): the worker's own registry entry is gone too, and it
  re-writes every session it holds (`rewrite_sessions`);
- part of it (a Redis Cluster master failover, whose asynchronous replication drops the writes the
  dead master acknowledged last): only the sessions on that shard lost anything. `find_damaged`
  compares what Redis holds with what the worker knows it wrote, and `repair_sessions` re-writes
  those, one atomic script per session (its keys share a slot), never over a record that names
  another worker. The record's fields are written by its one owner's mapping (registry.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.typing import EncodableT

from shared.store.registry import SessionRecord, session_mapping, ttl_to_ms
from shared.store.schema import KeySchema, lua_script

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HeldSession:
    """What a worker re-writes for a session it holds after Redis lost it."""

    sid: str
    record: SessionRecord
    log: bytes
    ttl_s: float


async def rewrite_sessions(redis: Redis, schema: KeySchema, held: Iterable[HeldSession]) -> int:
    """Re-create the record and the whole log of each session, with their TTLs, in one round trip.

    Not a MULTI: on a cluster the sessions live in different slots. Each key is written with its TTL
    in the same command (SET PX) or right behind it in the same pipeline (HSET, PEXPIRE).
    """
    items = list(held)
    if not items:
        return 0
    async with redis.pipeline(transaction=False) as pipe:
        for item in items:
            ttl_ms = ttl_to_ms(item.ttl_s)
            key = schema.session(item.sid)
            pipe.hset(key, mapping=session_mapping(item.record))
            pipe.pexpire(key, ttl_ms)
            if item.log:
                pipe.set(schema.log(item.sid), item.log, px=ttl_ms)
        await pipe.execute()
    return len(items)


async def find_damaged(redis: Redis, schema: KeySchema, log_lengths: Mapping[str, int]) -> list[str]:
    """The sessions whose record is gone or whose log is shorter than the worker wrote it.

    A longer log is not damage: a flush retried after a partial failure appends a record twice, and
    readers skip the repeat (shared/store/log_format.py `decode_log`).
    """
    sids = list(log_lengths)
    if not sids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for sid in sids:
            pipe.exists(schema.session(sid))
            pipe.strlen(schema.log(sid))
        results = await pipe.execute()
    return [
        sid
        for sid, exists, length in zip(sids, results[0::2], results[1::2], strict=True)
        if not exists or int(length) < log_lengths[sid]
    ]


async def repair_sessions(
    redis: Redis, schema: KeySchema, worker_id: str, held: Iterable[HeldSession]
) -> int:
    """Re-write each session's record and whole log unless its record names another worker; the
    number re-written."""
    script = redis.register_script(lua_script("session_repair"))
    repaired = 0
    for item in held:
        args: list[EncodableT] = [worker_id, ttl_to_ms(item.ttl_s), item.log]
        for name, value in session_mapping(item.record).items():
            args += [name, value]
        if await script(keys=[schema.session(item.sid), schema.log(item.sid)], args=args):
            repaired += 1
        else:
            logger.info("session %s moved to another worker: not re-written", item.sid)
    return repaired
