"""Appends each finished turn to the session's log in Redis, batched, off the reply path.

The log (`mt:log:{<sid>}`, one record per turn: shared/store/schema.py) is what a session is rebuilt
from on another worker. Appends are queued when a `done` has gone out and flushed together every
few milliseconds in one pipeline, so a chunk's round trip never waits on Redis. Order per session
is the order of `append`.

Invariants (docs/failover.md):
- `durable_seq(sid)` is the last seq whose record a flush has confirmed in Redis; the worker reports
  it to the gateway on the frames it sends anyway, and the gateway drops its copy of the turns up
  to it.
- `_mirror[sid]` is a byte-exact copy of what Redis holds for the session's log (what was read at
  restore, plus every confirmed flush). Redis is a cache of what the workers hold: when it loses its
  data, the heartbeat re-writes each log from this copy (`held_logs`), records (text tails
  included) as they were, so a restore from the re-written log is as exact as from the original.
  It costs 4 bytes per token plus each turn's text tail, next to KV that costs kilobytes per token.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Final

import redis.asyncio as redis

from shared.store.connection import OutageLog
from shared.store.schema import KeySchema, encode_log_record, lua_script
from worker.tokenizer.incremental import TextTail

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S: Final = 0.02
# After a failed flush the next try waits this, doubling up to the cap: an outage is not a hot loop.
RETRY_BASE_S: Final = 0.05
RETRY_MAX_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class _Turn:
    """One finished turn as the reply path hands it over; encoded only by the flush task."""

    seq: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    tail: TextTail

    def record(self) -> bytes:
        inputs, tail = self.inputs, self.tail
        return encode_log_record(
            self.seq,
            inputs + self.outputs,
            inputs=len(inputs),
            tail_text=tail.text,
            tail_context=tail.context,
        )


@dataclass(slots=True)
class _Queued:
    """A session's turns not yet flushed, oldest first, and what its log key's TTL must be."""

    turns: list[_Turn]
    ttl_s: float

    @property
    def last_seq(self) -> int:
        return self.turns[-1].seq


class TokenLogWriter:
    def __init__(self, client: redis.Redis, schema: KeySchema, *, grace_s: float, worker_id: str) -> None:
        self.client = client
        self.schema = schema
        self.grace_s = grace_s
        self.worker_id = worker_id
        self._delete_if_owned = client.register_script(lua_script("delete_session_if_owned"))
        # Held while a flush, a rewrite or a delete talks to Redis: a delete never lands before an
        # append already on its way (which would re-create a closed session's log), and a rewrite
        # never interleaves with an append.
        self._redis_turn = asyncio.Lock()
        # sid -> its turns not yet flushed. Kept as turns, not bytes: encoding a record is the flush
        # task's work, so the reply path only appends to a list.
        self._pending: dict[str, _Queued] = {}
        self._mirror: dict[str, bytearray] = {}
        self._durable: dict[str, int] = {}
        # Sessions whose log in Redis came back shorter than written (a failover lost writes): the
        # heartbeat re-writes them from the mirror (shared/store/held.py).
        self.damaged: set[str] = set()
        self._wakeup = asyncio.Event()
        self._outage = OutageLog("token log flush", logger)
        self.flushes = 0
        self.failures = 0

    def start(self, sid: str, log: bytes, durable_seq: int | None) -> None:
        """A session opened or restored here: `log` is what Redis holds for it (its records)."""
        self._mirror[sid] = bytearray(log)
        if durable_seq is not None:
            self._durable[sid] = durable_seq

    def append(
        self,
        sid: str,
        seq: int,
        inputs: tuple[int, ...],
        outputs: tuple[int, ...],
        idle_timeout_s: float,
        *,
        tail: TextTail,
    ) -> None:
        """Queue turn `seq`'s committed input and output tokens and the session's text tail after
        its input. A turn that added nothing is still recorded: its seq is what tells a restoring
        worker that the turn was done. Nothing is copied or encoded here (the reply path): the flush
        task builds the record."""
        turn = _Turn(seq, inputs, outputs, tail)
        queued = self._pending.get(sid)
        if queued is None:
            self._pending[sid] = _Queued([turn], idle_timeout_s)
        else:
            queued.turns.append(turn)
            queued.ttl_s = idle_timeout_s
        self._wakeup.set()

    def durable_seq(self, sid: str) -> int | None:
        """The last seq of `sid` whose turn Redis is known to hold (None: none yet)."""
        return self._durable.get(sid)

    def unflushed(self) -> int:
        return len(self._pending)

    def held_logs(self) -> dict[str, bytes]:
        """Each session's log as Redis should hold it (confirmed flushes only)."""
        return {sid: bytes(data) for sid, data in self._mirror.items()}

    @property
    def redis_turn(self) -> asyncio.Lock:
        """Taken by a rewrite of the held sessions, so no flush interleaves with it."""
        return self._redis_turn

    async def forget(self, sid: str) -> None:
        """The session ended here: drop its queued appends and, if it is still ours, its keys.

        A session this worker lost track of (its link broke) may live on another worker by now,
        restored under the same id: its record names that worker, and then nothing is deleted.
        """
        self.drop(sid)
        try:
            async with self._redis_turn:
                owned = await self._delete_if_owned(keys=[self.schema.session(sid)], args=[self.worker_id])
                if owned:
                    await self.client.delete(self.schema.log(sid))
        except redis.RedisError as exc:
            logger.warning("could not delete the Redis keys of session %s: %s", sid, exc)

    def drop(self, sid: str) -> None:
        """Forget the session here without touching Redis (it was handed to another worker)."""
        self._pending.pop(sid, None)
        self._mirror.pop(sid, None)
        self._durable.pop(sid, None)

    async def flush(self) -> bool:
        """Write every queued append; False when Redis refused (they stay queued, in order)."""
        if not self._pending:
            return True
        batch, self._pending = self._pending, {}
        records = {sid: b"".join(turn.record() for turn in queued.turns) for sid, queued in batch.items()}
        pipe = self.client.pipeline(transaction=False)
        appends: dict[str, int] = {}  # sid -> the index of its APPEND's reply
        for sid, queued in batch.items():
            key = self.schema.log(sid)
            appends[sid] = len(pipe)
            pipe.append(key, records[sid])
            # The append that creates the key gives it its TTL; after that the heartbeat refreshes
            # it with the session's record (`touch_sessions`, every session active since the last
            # beat), so a chunk costs Redis one command, not two (docs/scaling.md).
            if not self._mirror.get(sid):
                pipe.pexpire(key, int((queued.ttl_s + self.grace_s) * 1000))
        try:
            async with self._redis_turn:
                replies = await pipe.execute()
        except redis.RedisError as exc:
            # Put them back in front of anything queued since, so the log keeps its order. A record
            # that did land before the failure is written twice; the reader skips the duplicate.
            self.failures += 1
            self._outage.failed(exc)
            for sid, queued in batch.items():
                if sid not in self._mirror:
                    continue  # the session ended meanwhile: its log must not come back
                later = self._pending.get(sid)
                if later is not None:
                    queued.turns.extend(later.turns)
                    queued.ttl_s = later.ttl_s
                self._pending[sid] = queued
            return False
        self._outage.succeeded()
        self.flushes += 1
        for sid, queued in batch.items():
            mirror = self._mirror.get(sid)
            if mirror is not None:  # None: the session ended while its append was on its way
                mirror.extend(records[sid])
                self._durable[sid] = queued.last_seq
                # APPEND answers the log's new length: shorter than the mirror means Redis lost
                # writes it had acknowledged (longer is a retried append, which readers skip).
                if int(replies[appends[sid]]) < len(mirror):
                    self.damaged.add(sid)
        return True

    async def run(self) -> None:
        delay = RETRY_BASE_S
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(FLUSH_INTERVAL_S)
            if await self.flush():
                delay = RETRY_BASE_S
                continue
            self._wakeup.set()  # retry what is queued even if no new turn comes
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
