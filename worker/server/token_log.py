"""Appends each finished turn's tokens to the session's log in Redis, batched, off the reply path.

The log (`mt:log:<sid>`, little-endian uint32) is what a session is rebuilt from on another worker.
Appends are queued when a `done` has gone out and flushed together every few milliseconds in one
pipeline, so a chunk's round trip never waits on Redis. Order per session is the order of `append`.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as redis

from shared.redis_schema import KeySchema, encode_tokens

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.02

# Deletes a session record that names this worker (or none is left); says whether the log may go.
# One key, so it runs on Redis Cluster; the log key lives in another slot and is deleted after.
DELETE_IF_OWNED = """
local owner = redis.call('HGET', KEYS[1], 'worker')
if owner == false or owner == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


class TokenLogWriter:
    def __init__(self, client: redis.Redis, schema: KeySchema, *, grace_s: float, worker_id: str) -> None:
        self.client = client
        self.schema = schema
        self.grace_s = grace_s
        self.worker_id = worker_id
        self._delete_if_owned = client.register_script(DELETE_IF_OWNED)
        # Held while a flush or a delete talks to Redis: a delete never lands before an append
        # already on its way, which would re-create a closed session's log.
        self._redis_turn = asyncio.Lock()
        self._pending: dict[str, tuple[list[int], float]] = {}
        self._wakeup = asyncio.Event()
        self.flushes = 0
        self.failures = 0

    def append(self, sid: str, tokens: list[int] | tuple[int, ...], idle_timeout_s: float) -> None:
        if not tokens:
            return
        queued, _ttl = self._pending.get(sid, ([], 0.0))
        queued.extend(tokens)
        self._pending[sid] = (queued, idle_timeout_s)
        self._wakeup.set()

    async def forget(self, sid: str) -> None:
        """The session ended here: drop its queued appends and, if it is still ours, its keys.

        A session this worker lost track of (its link broke) may live on another worker by now,
        restored under the same id: its record names that worker, and then nothing is deleted.
        """
        self._pending.pop(sid, None)
        try:
            async with self._redis_turn:
                owned = await self._delete_if_owned(keys=[self.schema.session(sid)], args=[self.worker_id])
                if owned:
                    await self.client.delete(self.schema.log(sid))
        except redis.RedisError:
            logger.warning("could not delete the Redis keys of session %s", sid, exc_info=True)

    async def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        pipe = self.client.pipeline(transaction=False)
        for sid, (tokens, idle_timeout_s) in batch.items():
            key = self.schema.log(sid)
            pipe.append(key, encode_tokens(tokens))
            pipe.pexpire(key, int((idle_timeout_s + self.grace_s) * 1000))
        try:
            async with self._redis_turn:
                await pipe.execute()
            self.flushes += 1
        except redis.RedisError:
            # Put them back in front of anything queued since, so the log keeps its order.
            self.failures += 1
            logger.warning("token log flush failed; retrying", exc_info=True)
            for sid, (tokens, ttl) in batch.items():
                later, _ = self._pending.get(sid, ([], ttl))
                self._pending[sid] = (tokens + later, ttl)

    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(FLUSH_INTERVAL_S)
            await self.flush()
