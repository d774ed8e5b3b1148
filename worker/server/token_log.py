"""The worker's side of a session's token log in Redis: the batched writer and the reads.

The log (`mt:log:{<sid>}`, one record per turn: shared/store/log_format.py) is what a session is rebuilt
from on another worker. Its one writer is `TokenLogWriter`: it appends each finished turn, batched,
off the reply path. The reads (`read_log_bytes` and the decoded views) are the one-off reads of a
worker that restores a session or warms a copy of it; they see what the writer confirmed.

Appends are queued when a `done` has gone out and flushed together every
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
- A window cut is logged with the turn it preceded (a `CUT` directive before its record), so a
  restore rebuilds the window the session had.
- Compaction keeps a log (and its mirror) bounded however long the session runs: once the mirror
  holds more than 2 x `keep_records` records since its last snapshot, a flush writes the log
  compacted to a snapshot plus the last `keep_records` records (shared/store/log_compaction.py),
  then its new records, in one script that SETs it only while the session's record names this
  worker. Its cost (bounded by the window and `keep_records`, not by the session's age) comes once
  per `keep_records` turns; every other flush of the session is one APPEND.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Final

import redis.asyncio as redis
from redis.typing import EncodableT

from shared.settings import WorkerSettings
from shared.store.connection import OutageLog
from shared.store.log_compaction import compact_log, records_since_snapshot
from shared.store.log_format import (
    DIRECTIVE_CUT,
    DIRECTIVE_REWIND,
    NO_SEQ,
    Cut,
    LogState,
    decode_log,
    encode_directive,
    encode_log_record,
)
from shared.store.schema import KeySchema, lua_code, lua_script
from worker.tokenizer.incremental import TextTail

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S: Final = 0.02
# After a failed flush the next try waits this, doubling up to the cap: an outage is not a hot loop.
RETRY_BASE_S: Final = 0.05
RETRY_MAX_S: Final = 1.0
# Records a compacted log keeps whole after its snapshot, unless the worker's `log_keep_records`
# says otherwise (shared/settings.py says why this many).
KEEP_RECORDS: Final = WorkerSettings.log_keep_records
# How many of the confirmed log's last bytes an append checks (log_append.lua), at least: the whole
# of the last confirmed append when it is longer. Its records name their seqs, so a log that lost a
# record and gained another of the same length is told apart from the one this worker wrote.
CONFIRMED_TAIL_BYTES: Final = 64
_APPEND_SCRIPT: Final = lua_code(lua_script("log_append"))


@dataclass(frozen=True, slots=True)
class _Turn:
    """One finished turn as the reply path hands it over; encoded only by the flush task."""

    seq: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    tail: TextTail
    cut: Cut | None
    # A rewind's record, not a turn's: the history becomes its first `rewind` tokens (`seq` is the
    # last turn's before it; it adds no tokens).
    rewind: int | None = None

    def record(self) -> bytes:
        inputs, tail = self.inputs, self.tail
        if self.rewind is not None:
            directive = encode_directive(DIRECTIVE_REWIND, Cut(self.rewind, 0))
        else:
            directive = b"" if self.cut is None else encode_directive(DIRECTIVE_CUT, self.cut)
        return directive + encode_log_record(
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
    def last_seq(self) -> int | None:
        """The last turn's seq (None: only tokens of no turn, a system prompt, are queued)."""
        seqs = [turn.seq for turn in self.turns if turn.seq != NO_SEQ]
        return seqs[-1] if seqs else None


class TokenLogWriter:
    def __init__(
        self,
        client: redis.Redis,
        schema: KeySchema,
        *,
        grace_s: float,
        worker_id: str,
        keep_records: int = KEEP_RECORDS,
    ) -> None:
        self.client = client
        self.keep_records = keep_records
        self.schema = schema
        self.grace_s = grace_s
        self.worker_id = worker_id
        self._delete_if_owned = client.register_script(lua_script("delete_session_if_owned"))
        self._compact = client.register_script(lua_script("log_compact"))
        self._rewrite = client.register_script(lua_script("log_rewrite"))
        # Held while a flush, a rewrite or a delete talks to Redis: a delete never lands before an
        # append already on its way (which would re-create a closed session's log), and a rewrite
        # never interleaves with an append.
        self._redis_turn = asyncio.Lock()
        # Held for a whole flush, from taking the queued turns to confirming them: a flush that
        # finds nothing queued because another one took the turns waits for that one to confirm
        # them, so `flush() is True` always means every turn queued before the call is durable (a
        # switch reads `durable_seq` right after it). Never taken under `_redis_turn`.
        self._flushing = asyncio.Lock()
        # sid -> its turns not yet flushed. Kept as turns, not bytes: encoding a record is the flush
        # task's work, so the reply path only appends to a list.
        self._pending: dict[str, _Queued] = {}
        self._mirror: dict[str, bytearray] = {}
        self._records: dict[str, int] = {}  # sid -> records its mirror holds past its last snapshot
        self._durable: dict[str, int] = {}
        self._last_append: dict[str, int] = {}  # sid -> bytes of its last confirmed append
        # sid -> the seq of the last turn appended (queued or flushed): what a rewind's record names.
        self._last_seq: dict[str, int] = {}
        # Sessions whose log in Redis came back shorter than written (a failover lost writes): the
        # heartbeat re-writes them from the mirror (shared/store/held.py).
        self.damaged: set[str] = set()
        self._wakeup = asyncio.Event()
        self._outage = OutageLog("token log flush", logger)
        self.flushes = 0
        self.failures = 0
        self.compactions = 0

    def start(self, sid: str, log: bytes, durable_seq: int | None) -> None:
        """A session opened or restored here: `log` is what Redis holds for it (its records)."""
        self._mirror[sid] = bytearray(log)
        self._records[sid] = records_since_snapshot(log)
        if durable_seq is not None:
            self._durable[sid] = durable_seq
            self._last_seq[sid] = durable_seq

    def append(
        self,
        sid: str,
        seq: int,
        inputs: tuple[int, ...],
        outputs: tuple[int, ...],
        idle_timeout_s: float,
        *,
        tail: TextTail,
        cut: Cut | None = None,
    ) -> None:
        """Queue turn `seq`'s committed input and output tokens, the session's text tail after its
        input and the window cut made before it (None: none). A turn that added nothing is still
        recorded: its seq is what tells a restoring worker that the turn was done. Nothing is copied
        or encoded here (the reply path): the flush task builds the record."""
        if seq != NO_SEQ:
            self._last_seq[sid] = seq
        self._queue(sid, _Turn(seq, inputs, outputs, tail, cut), idle_timeout_s)

    def append_rewind(self, sid: str, length: int, tail: TextTail, idle_timeout_s: float) -> None:
        """Queue a rewind of the session to its first `length` tokens, holding `tail` back, after
        every turn appended so far (the turns it cancelled included); `flush` makes it durable."""
        turn = _Turn(self._last_seq.get(sid, NO_SEQ), (), (), tail, None, rewind=length)
        self._queue(sid, turn, idle_timeout_s)

    def _queue(self, sid: str, turn: _Turn, idle_timeout_s: float) -> None:
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
        self._records.pop(sid, None)
        self._durable.pop(sid, None)
        self._last_append.pop(sid, None)
        self._last_seq.pop(sid, None)

    async def flush(self) -> bool:
        """Write every queued append; False when Redis refused (they stay queued, in order).
        True means every append queued before the call is durable, even one that a concurrent
        flush had taken: flushes run one at a time."""
        async with self._flushing:
            return await self._flush_queued()

    async def _flush_queued(self) -> bool:
        if not self._pending:
            return True
        batch, self._pending = self._pending, {}
        records = {sid: b"".join(turn.record() for turn in queued.turns) for sid, queued in batch.items()}
        compacted = {
            sid: log for sid, queued in batch.items() if (log := self._compacted(sid, len(queued.turns)))
        }
        pipe = self.client.pipeline(transaction=False)
        appends: dict[str, int] = {}  # sid -> the index of its append's reply
        for sid, queued in batch.items():
            if sid in compacted:
                continue
            mirror = self._mirror.get(sid, b"")
            appends[sid] = len(pipe)
            # Appended only onto the log this worker confirmed (log_append.lua): a retried flush
            # whose first try landed, or a failover that lost acknowledged writes, is refused and
            # re-written whole below, never appended twice or after a gap. The append that creates
            # the key gives it its TTL; after that the heartbeat refreshes it with the session's
            # record (`touch_sessions`), so a chunk costs Redis one command (docs/scaling.md). EVAL,
            # not EVALSHA: a cluster pipeline cannot load a script on a node that lacks it.
            pipe.eval(
                _APPEND_SCRIPT,
                1,
                self.schema.log(sid),
                len(mirror),
                bytes(mirror[-max(CONFIRMED_TAIL_BYTES, self._last_append.get(sid, 0)) :]),
                records[sid],
                self._ttl_ms(queued),
            )
        confirmed: set[str] = set()
        try:
            async with self._redis_turn:
                if appends:
                    replies = await pipe.execute()
                    for sid, index in appends.items():
                        appended, length = (int(value) for value in replies[index])
                        if appended:
                            self._confirm(sid, batch[sid], records[sid], length, None)
                            confirmed.add(sid)
                        elif await self._rewrite_whole(sid, batch[sid], records[sid], length):
                            confirmed.add(sid)
                # Not in the pipeline: a script there would not be loaded on a cluster node that
                # lacks it. A compaction comes once per `keep_records` turns of a session.
                for sid, log in compacted.items():
                    keys = [self.schema.session(sid), self.schema.log(sid)]
                    args: list[EncodableT] = [self.worker_id, self._ttl_ms(batch[sid]), log, records[sid]]
                    done, length = await self._compact(keys=keys, args=args)
                    self._confirm(sid, batch[sid], records[sid], int(length), log if int(done) else None)
                    confirmed.add(sid)
        except redis.RedisError as exc:
            # Put them back in front of anything queued since, so the log keeps its order. A record
            # that did land before the failure is written twice; the reader skips the duplicate.
            self.failures += 1
            self._outage.failed(exc)
            for sid, queued in batch.items():
                if sid in confirmed or sid not in self._mirror:
                    continue  # written, or the session ended meanwhile: its log must not come back
                later = self._pending.get(sid)
                if later is not None:
                    queued.turns.extend(later.turns)
                    queued.ttl_s = later.ttl_s
                self._pending[sid] = queued
            return False
        self._outage.succeeded()
        self.flushes += 1
        return True

    async def _rewrite_whole(self, sid: str, queued: _Queued, records: bytes, found: int) -> bool:
        """The log in Redis is not what this worker confirmed (`found` bytes): write it whole, the
        mirror and `records`, and confirm them; False when the session is another worker's now (its
        records are then not logged here: its log is that worker's)."""
        mirror = self._mirror.get(sid)
        if mirror is None:  # the session ended meanwhile: its log must not come back
            return True
        whole = bytes(mirror) + records
        keys = [self.schema.session(sid), self.schema.log(sid)]
        written, length = await self._rewrite(keys=keys, args=[self.worker_id, self._ttl_ms(queued), whole])
        if not int(written):
            logger.warning(
                "the token log of session %s is another worker's now: %d turn(s) not logged here",
                sid,
                len(queued.turns),
            )
            return False
        logger.warning(
            "the token log of session %s held %d bytes, not the %d confirmed: re-written whole",
            sid,
            found,
            len(mirror),
        )
        self._confirm(sid, queued, records, int(length), None)
        self.damaged.add(sid)  # the heartbeat re-writes its record too, should the failover have lost it
        return True

    def _ttl_ms(self, queued: _Queued) -> int:
        return int((queued.ttl_s + self.grace_s) * 1000)

    def _compacted(self, sid: str, new_records: int) -> bytes | None:
        """The session's mirror compacted, when this flush would take it past 2 x `keep_records`
        records since its snapshot; None otherwise (most flushes: then nothing is read)."""
        mirror, count = self._mirror.get(sid), self._records.get(sid, 0)
        keep = self.keep_records
        if not mirror or count <= keep or count + new_records <= 2 * keep:
            return None
        try:
            return compact_log(bytes(mirror), keep)
        except ValueError as exc:  # not expected: the mirror holds what this worker wrote or read
            logger.error("the token log of session %s cannot be compacted: %s", sid, exc)
            self._records[sid] = 0  # appended to as before; tried again after 2 x `keep_records` more
            return None

    def _confirm(
        self, sid: str, queued: _Queued, records: bytes, length: int, compacted: bytes | None
    ) -> None:
        """Redis holds the session's new records (after `compacted`, when it took the compacted
        log) and answered the log's `length`: the mirror follows."""
        mirror = self._mirror.get(sid)
        if mirror is None:  # the session ended while its append was on its way
            return
        if compacted is not None:
            mirror[:] = compacted
            self._records[sid] = self.keep_records
            self.compactions += 1
        mirror.extend(records)
        self._last_append[sid] = len(records)
        self._records[sid] = self._records.get(sid, 0) + len(queued.turns)
        if queued.last_seq is not None:
            self._durable[sid] = queued.last_seq
        # APPEND answers the log's new length: shorter than the mirror means Redis lost writes it
        # had acknowledged (longer is a retried append, which readers skip).
        if length < len(mirror):
            self.damaged.add(sid)

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


async def read_log_bytes(client: redis.Redis, schema: KeySchema, sid: str) -> bytes:
    """The log's raw bytes (records, shared/store/log_format.py); empty when absent or expired."""
    data = await client.get(schema.log(sid))
    if data is None:
        return b""
    if isinstance(data, str):
        raise TypeError("the token log is binary: use a Redis client with decode_responses=False")
    return bytes(data)


async def read_log_state(client: redis.Redis, schema: KeySchema, sid: str) -> LogState:
    """The session's whole token history and the seq of the last turn the log holds."""
    return decode_log(await read_log_bytes(client, schema, sid))


async def read_log(client: redis.Redis, schema: KeySchema, sid: str) -> list[int]:
    """The session's whole token history; empty when nothing was logged or the log expired."""
    return (await read_log_state(client, schema, sid)).tokens
