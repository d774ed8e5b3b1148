"""A session's token log in Redis, read as whole records (format: shared/store/schema.py).

The only writer is the worker's batched one (worker/server/token_log.py); these are the one-off
reads a restoring worker makes.
"""

from __future__ import annotations

from redis.asyncio import Redis

from shared.store.schema import KeySchema, LogState, decode_log


async def read_log_bytes(redis: Redis, schema: KeySchema, sid: str) -> bytes:
    """The log's raw bytes (records, shared/store/schema.py); empty when absent or expired."""
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
