"""A session's token log in Redis, read and appended as whole records (format: shared/redis_schema.py).

The worker's batched writer (worker/server/token_log.py) appends in pipelines of its own; these are
the one-off reads a restoring worker makes and the single append tools and tests use.
"""

from __future__ import annotations

from redis.asyncio import Redis

from shared.redis_schema import NO_SEQ, KeySchema, LogState, decode_log, encode_log_record
from shared.registry import ttl_to_ms


async def append_log(
    redis: Redis, schema: KeySchema, sid: str, tokens: list[int], ttl_s: float, *, seq: int = NO_SEQ
) -> int:
    """Append one turn's record to the log and refresh its TTL; returns the log's length in tokens.

    (The length costs a read of the whole log: this helper is for tools and tests; the worker's
    batched writer, worker/server/token_log.py, never reads.)
    """
    key = schema.log(sid)
    data = encode_log_record(seq, tokens)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.append(key, data)
        pipe.pexpire(key, ttl_to_ms(ttl_s))
        await pipe.execute()
    return len(await read_log(redis, schema, sid))


async def read_log_bytes(redis: Redis, schema: KeySchema, sid: str) -> bytes:
    """The log's raw bytes (records, shared/redis_schema.py); empty when absent or expired."""
    data = await redis.get(schema.log(sid))
    if data is None:
        return b""
    if isinstance(data, str):
        raise TypeError("the token log is binary: use a Redis client with decode_responses=False")
    return bytes(data)


async def read_log_state(redis: Redis, schema: KeySchema, sid: str) -> LogState:
    """The session's whole token history and the seq of the last turn the log holds."""
    return decode_log(await read_log_bytes(redis, schema, sid))


async def read_log(redis: Redis, schema: KeySchema, sid: str) -> list[int]:
    """The session's whole token history; empty when nothing was logged or the log expired."""
    return (await read_log_state(redis, schema, sid)).tokens
