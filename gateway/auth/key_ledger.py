"""Per-key session slots and token usage in Redis, settled in batches off the hot path.

Concurrent sessions per key, exact across gateways: a ZSET per key (`mt:keysessions:<digest>`) of
session ids scored by a lease expiry on the *Redis server's* clock (gateways' clocks never
disagree about it). `admit` is one Lua step that drops lapsed members and adds the session only
while ZCARD < max, so N gateways racing for the last slot admit exactly one. The gateway holding a
session's socket renews the leases of all its sessions in one pipeline every `REFRESH_S` (never per
chunk) and removes the member when the socket ends, whatever ended it (close, expiry, a fatal error,
the client going away). What dies without saying so:
- a gateway: its leases are not renewed and lapse within `LEASE_S`; the next admit drops them;
- a worker: the gateway still holds the socket; the session is restored (and keeps its slot) or
  its socket ends with an error (and releases it).

Token usage: `charge` adds tokens (in + out, from `done` frames) to a local count; every `REFRESH_S`
one INCRBY per key with live sessions here moves it into the day's counter and brings back the
total all gateways have spent, which is what the per-chunk budget check compares against (a dict
read). A budgeted session's own count is also persisted (HINCRBY on its session hash), so a resume
through another socket or gateway continues from it. A gateway killed outright loses at most one
interval of counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from typing import Final

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.auth.api_keys import KeyStore
from shared.store.registry import SessionUsage
from shared.store.schema import KeySchema, lua_script

logger = logging.getLogger(__name__)

LEASE_S: Final = 5.0
REFRESH_S: Final = 1.0
# The session-hash field holding a budgeted session's tokens spent so far.


def _merge(into: dict[str, int], counts: dict[str, int]) -> None:
    for name, count in counts.items():
        into[name] = into.get(name, 0) + count


class KeyLedger:
    """One per gateway: the slots its sockets hold and the tokens they spent, kept in Redis."""

    def __init__(self, redis: Redis, schema: KeySchema, keys: KeyStore) -> None:
        self.redis = redis
        self.schema = schema
        self.keys = keys
        self._admit = redis.register_script(lua_script("now_ms", "key_admit"))
        self._renew = redis.register_script(lua_script("now_ms", "key_renew"))
        self._usage = SessionUsage(redis, schema)
        # digest -> sid -> sockets of this gateway holding that session's slot (a take-over on the
        # same gateway briefly has two; the member goes only when the last one lets go).
        self._held: dict[str, dict[str, int]] = defaultdict(dict)
        self._pending: dict[str, int] = defaultdict(int)  # digest -> tokens not yet settled
        self._totals: dict[str, int] = {}  # digest -> day total as of the last settle
        self._session_pending: dict[str, int] = defaultdict(int)  # sid -> tokens not yet persisted
        self._task: asyncio.Task[None] | None = None

    # ---- slots -----------------------------------------------------------------------------------

    async def admit(self, key_digest: str, sid: str, max_sessions: int) -> bool:
        admitted = await self._admit(
            keys=[self.schema.key_sessions(key_digest)], args=[sid, max_sessions, int(LEASE_S * 1000)]
        )
        if int(admitted) != 1:
            return False
        holders = self._held[key_digest]
        holders[sid] = holders.get(sid, 0) + 1
        return True

    async def release(self, key_digest: str, sid: str) -> None:
        holders = self._held.get(key_digest, {})
        count = holders.get(sid, 0) - 1
        if count > 0:
            holders[sid] = count
            return
        holders.pop(sid, None)
        if not holders:
            self._held.pop(key_digest, None)
        await self._flush_session(sid)
        # Best effort: a member that could not be removed lapses with its lease anyway.
        with contextlib.suppress(RedisError, OSError):
            await self.redis.zrem(self.schema.key_sessions(key_digest), sid)

    # ---- usage -----------------------------------------------------------------------------------

    async def load_usage(self, key_digest: str) -> int:
        """The key's spend today (Redis plus what this gateway has not settled yet); at open/resume."""
        self._totals[key_digest] = await self.keys.usage(key_digest)
        return self.spent(key_digest)

    def spent(self, key_digest: str) -> int:
        """The key's spend today as this gateway knows it: a dict read, for the per-chunk check."""
        return self._totals.get(key_digest, 0) + self._pending.get(key_digest, 0)

    def charge(self, key_digest: str, sid: str | None, tokens: int) -> None:
        """Count tokens a session spent (sid only for sessions with a token budget of their own)."""
        if tokens <= 0:
            return
        self._pending[key_digest] += tokens
        if sid is not None:
            self._session_pending[sid] += tokens

    async def session_used(self, sid: str) -> int:
        return await self._usage.read(sid) + self._session_pending.get(sid, 0)

    async def _flush_session(self, sid: str) -> None:
        used = self._session_pending.pop(sid, 0)
        if used:
            with contextlib.suppress(RedisError, OSError):
                await self._usage.add(sid, used)

    # ---- the periodic batch ------------------------------------------------------------------------

    async def tick(self) -> None:
        """Renew every held lease, persist budgeted sessions' counts, settle usage: two round trips.

        Counts are taken out of the pending maps *before* they are sent (and put back if sending
        fails), so a charge or a release that runs while a round trip is in flight is neither lost
        nor sent twice.
        """
        held = {d: list(sids) for d, sids in self._held.items() if sids}
        sessions, self._session_pending = self._session_pending, defaultdict(int)
        lease_ms = int(LEASE_S * 1000)
        if held or sessions:
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for key_digest, sids in held.items():
                        zset = self.schema.key_sessions(key_digest)
                        await self._renew(keys=[zset], args=[lease_ms, *sids], client=pipe)
                    for sid, used in sessions.items():
                        await self._usage.add(sid, used, pipe)
                    await pipe.execute()
            except BaseException:
                _merge(self._session_pending, sessions)
                raise
        pending, self._pending = self._pending, defaultdict(int)
        spent = {d: pending.get(d, 0) for d in {*self._held, *pending}}
        try:
            totals = await self.keys.settle_usage(spent)
        except BaseException:
            _merge(self._pending, pending)
            raise
        self._totals.update(totals)
        for key_digest in [d for d in self._totals if d not in self._held and d not in self._pending]:
            del self._totals[key_digest]

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.tick()
            except (RedisError, OSError) as exc:
                # Leases lapse after LEASE_S without a renew; counts stay pending for the next tick.
                logger.warning("key ledger tick failed: %r", exc)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="key-ledger")

    async def stop(self) -> None:
        """Stop the batch, settle what is pending and let go of every slot still held."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):
            await self.tick()
            for key_digest, sids in list(self._held.items()):
                await self.redis.zrem(self.schema.key_sessions(key_digest), *sids)
        self._held.clear()
