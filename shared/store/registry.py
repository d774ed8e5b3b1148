"""Worker registry and session records in Redis (docs/design.md section 5).

Worker side: a worker registers its hash and load score, then heartbeats them. The hash's TTL (a
few heartbeat intervals) *is* the liveness signal: a worker that dies simply stops refreshing it,
and placement (shared/store/lua/place.lua) drops it from the ZSET the next time it walks past it.

Gateway side: the session hash pins a session to a worker and holds the SHA-256 of its resume token
(never the token: a leaked Redis dump must not let anyone resume a session); the token log holds the
session's tokens so another worker can rebuild the KV after a worker loss.

Every write that must land together goes through one MULTI pipeline: a key must never exist
without its TTL, or a crash between the two commands would leave a record that never expires.
Registry keys share one hash tag, so their MULTI is valid on Redis Cluster; the two session keys
live in different slots, so commands spanning both use a plain (non-transactional) pipeline.

Clients must be created with `decode_responses=False` (the default): the token log is binary.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.typing import EncodableT, FieldT

from shared.protocol.key_limits import AuthLimits, KeyLimits
from shared.store.prefix_label import MAX_PUBLISHED_PREFIXES, PREFIX_SEPARATOR
from shared.store.schema import (
    SESSION_AUTH_KEY,
    SESSION_AUTH_LIMIT_PREFIX,
    SESSION_AUTH_USED,
    SESSION_CONFIG,
    SESSION_CREATED_MS,
    SESSION_MODEL,
    SESSION_TOKEN_SHA256,
    SESSION_WORKER,
    STATE_DRAINING,
    STATE_READY,
    WORKER_HEARTBEAT_MS,
    WORKER_KV_TOKENS_FREE,
    WORKER_KV_TOKENS_TOTAL,
    WORKER_MAX_SESSIONS,
    WORKER_MODEL,
    WORKER_PREFIXES,
    WORKER_SESSIONS,
    WORKER_STATE,
    WORKER_URL,
    KeySchema,
    lua_script,
)
from shared.store.values import now_ms, sha256_hex, text, text_map

logger = logging.getLogger(__name__)

WORKER_STATES: Final = frozenset({STATE_READY, STATE_DRAINING})
RESUME_TOKEN_BYTES: Final = 32  # 256 bits of entropy: unguessable, and short enough for a URL or header


def load_score(sessions: int, max_sessions: int) -> float:
    """The ZSET score of a worker: the fraction of its session slots in use.

    A fraction rather than a raw count, so workers of different sizes (GPU memory, `max_sessions`)
    compare fairly: 4 of 8 is as loaded as 40 of 80. KV occupancy is deliberately left out: the
    worker answers KV pressure itself by dropping idle sessions' KV (docs/design.md section 7), and a score
    that one more session does not move would stop the placement charge from spreading concurrent
    opens. shared/store/lua/place.lua computes the same value when it charges a pick.
    """
    if max_sessions < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    return sessions / max_sessions


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker publishes about itself at every heartbeat (the full truth, not a delta)."""

    worker_id: str
    url: str
    model: str
    max_sessions: int
    sessions: int = 0
    kv_tokens_free: int = 0
    kv_tokens_total: int = 0
    state: str = STATE_READY
    # The names of the prefixes whose KV it holds, most recently opened first (placement prefers
    # such a worker for a session that opens with one: shared/store/prefix_label.py).
    prefixes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.worker_id or not self.url:
            raise ValueError("worker_id and url must be non-empty")
        if self.state not in WORKER_STATES:
            raise ValueError(f"state must be one of {sorted(WORKER_STATES)}, got {self.state!r}")
        if self.max_sessions < 1 or self.sessions < 0:
            raise ValueError("need max_sessions >= 1 and sessions >= 0")

    @property
    def load(self) -> float:
        return load_score(self.sessions, self.max_sessions)


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """The session hash, every field of it: which worker holds the session, what proves a resume is
    legitimate, and (auth on) the limits it was opened under. Only this module reads or writes it."""

    worker: str
    token_sha256: str
    model: str
    created_ms: int
    config: dict[str, Any] = field(default_factory=dict)
    auth: AuthLimits | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a new session goes: the worker's id (for the session hash) and its link URL."""

    worker_id: str
    url: str


def ttl_to_ms(ttl_s: float) -> int:
    # PEXPIRE with 0 or a negative value deletes the key at once: refuse it instead of losing data.
    ms = round(ttl_s * 1000)
    if ms < 1:
        raise ValueError(f"ttl_s must be at least 1 ms, got {ttl_s}")
    return ms


# --- worker side -------------------------------------------------------------------------------


def _worker_mapping(info: WorkerInfo) -> dict[FieldT, EncodableT]:
    return {
        WORKER_URL: info.url,
        WORKER_STATE: info.state,
        WORKER_SESSIONS: info.sessions,
        WORKER_MAX_SESSIONS: info.max_sessions,
        WORKER_KV_TOKENS_FREE: info.kv_tokens_free,
        WORKER_KV_TOKENS_TOTAL: info.kv_tokens_total,
        WORKER_MODEL: info.model,
        WORKER_PREFIXES: PREFIX_SEPARATOR.join(info.prefixes[:MAX_PUBLISHED_PREFIXES]),
        WORKER_HEARTBEAT_MS: now_ms(),
    }


async def _publish_worker(
    redis: Redis, schema: KeySchema, info: WorkerInfo, ttl_s: float, *, fresh: bool
) -> bool:
    """Write the worker's hash and score; True when its hash existed before this write."""
    key = schema.worker(info.worker_id)
    ttl_ms = ttl_to_ms(ttl_s)
    # One MULTI (all keys in the `{prefix}` slot): placement never sees the hash without its TTL or a
    # score that disagrees with the hash it was computed from.
    async with redis.pipeline(transaction=True) as pipe:
        pipe.exists(key)
        if fresh:
            pipe.delete(key)  # a restarted worker must not inherit fields of its previous life
            pipe.delete(schema.suspect(info.worker_id))  # nor a gateway's suspicion of the old one
        pipe.hset(key, mapping=_worker_mapping(info))
        pipe.pexpire(key, ttl_ms)
        pipe.zadd(schema.workers(), {info.worker_id: info.load})
        results = await pipe.execute()
    return bool(results[0])


async def register_worker(redis: Redis, schema: KeySchema, info: WorkerInfo, ttl_s: float) -> None:
    """Publish a (re)starting worker: a fresh hash with TTL `ttl_s`, and its load score."""
    await _publish_worker(redis, schema, info, ttl_s, fresh=True)
    logger.info("registered worker %s at %s (max_sessions=%d)", info.worker_id, info.url, info.max_sessions)


async def heartbeat(redis: Redis, schema: KeySchema, info: WorkerInfo, ttl_s: float) -> bool:
    """Refresh the worker's hash, TTL and load score from its own true state.

    Returns False when the hash was gone (it expired, or Redis lost its data): the worker must then
    re-write what it holds (its sessions' records and logs), since nothing else will.

    Call it every `ttl_s / 3` or so: the TTL must outlive a couple of missed beats. A heartbeat after
    the hash expired (a stalled loop, a Redis failover) simply brings the worker back. The worker is
    the only writer of its hash's truth: the session count it sends overwrites placement's charges,
    and `info.state` must stay `draining` once the worker has called `mark_draining`.
    """
    return await _publish_worker(redis, schema, info, ttl_s, fresh=False)


async def mark_draining(redis: Redis, schema: KeySchema, worker_id: str) -> bool:
    """Stop new placements on a worker at once, without waiting for its next heartbeat.

    Returns False when the worker's hash no longer exists (nothing to drain; nothing is created).
    """
    script = redis.register_script(lua_script("mark_draining"))
    done = await script(keys=[schema.worker(worker_id)], args=[WORKER_STATE, STATE_DRAINING])
    if done:
        logger.info("worker %s marked draining", worker_id)
    return bool(done)


async def deregister(redis: Redis, schema: KeySchema, worker_id: str) -> None:
    """Remove a worker that is shutting down cleanly, so no gateway waits for its TTL to lapse."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(schema.workers(), worker_id)
        pipe.delete(schema.worker(worker_id))
        await pipe.execute()
    logger.info("deregistered worker %s", worker_id)


async def read_worker(redis: Redis, schema: KeySchema, worker_id: str) -> WorkerInfo | None:
    """The worker's hash as published, or None when it has expired: the liveness check at use time."""
    return _parse_worker(schema, worker_id, await redis.hgetall(schema.worker(worker_id)))


async def read_workers(redis: Redis, schema: KeySchema) -> list[WorkerInfo]:
    """Every registered worker whose hash is alive, as published (one round trip for the hashes)."""
    ids = [text(i) for i in await redis.zrange(schema.workers(), 0, -1) if isinstance(i, bytes | str)]
    if not ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.hgetall(schema.worker(worker_id))
        hashes = await pipe.execute()
    infos = (_parse_worker(schema, worker_id, raw) for worker_id, raw in zip(ids, hashes, strict=True))
    return [info for info in infos if info is not None]


def _parse_worker(
    schema: KeySchema, worker_id: str, hash_fields: Mapping[bytes | str, bytes | str]
) -> WorkerInfo | None:
    raw = text_map(hash_fields)
    if not raw:
        return None
    try:
        return WorkerInfo(
            worker_id=worker_id,
            url=raw[WORKER_URL],
            model=raw.get(WORKER_MODEL, ""),
            max_sessions=int(raw[WORKER_MAX_SESSIONS]),
            sessions=int(raw.get(WORKER_SESSIONS, "0")),
            kv_tokens_free=int(raw.get(WORKER_KV_TOKENS_FREE, "0")),
            kv_tokens_total=int(raw.get(WORKER_KV_TOKENS_TOTAL, "0")),
            state=raw.get(WORKER_STATE, STATE_DRAINING),
            prefixes=tuple(raw.get(WORKER_PREFIXES, "").split()),
        )
    except (KeyError, ValueError):
        # Treated as dead rather than raised: a malformed hash cannot be routed to either way.
        logger.warning("worker hash %s is malformed: %r", schema.worker(worker_id), raw)
        return None


# --- sessions ----------------------------------------------------------------------------------


def session_mapping(record: SessionRecord) -> dict[FieldT, EncodableT]:
    mapping: dict[FieldT, EncodableT] = {
        SESSION_WORKER: record.worker,
        SESSION_TOKEN_SHA256: record.token_sha256,
        SESSION_MODEL: record.model,
        SESSION_CREATED_MS: record.created_ms,
        SESSION_CONFIG: json.dumps(record.config, separators=(",", ":"), sort_keys=True),
    }
    if record.auth is not None:
        mapping[SESSION_AUTH_KEY] = record.auth.key_sha256
        granted = KeyLimits.names(granted=True)
        mapping.update(record.auth.to_fields(granted, prefix=SESSION_AUTH_LIMIT_PREFIX))
    return mapping


def _auth_limits(raw: Mapping[str, str]) -> AuthLimits | None:
    if SESSION_AUTH_KEY not in raw:
        return None
    return AuthLimits.from_record(raw[SESSION_AUTH_KEY], raw, SESSION_AUTH_LIMIT_PREFIX)


async def write_session(
    redis: Redis, schema: KeySchema, sid: str, record: SessionRecord, ttl_s: float
) -> None:
    """Create or overwrite (e.g. after re-placement) the session hash, with its TTL in the same MULTI."""
    key = schema.session(sid)
    mapping = session_mapping(record)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping=mapping)
        pipe.pexpire(key, ttl_to_ms(ttl_s))
        await pipe.execute()


async def read_session(redis: Redis, schema: KeySchema, sid: str) -> SessionRecord | None:
    """The session hash, or None when it has expired, was deleted, or is unreadable."""
    key = schema.session(sid)
    raw = text_map(await redis.hgetall(key))
    if not raw:
        return None
    try:
        config = json.loads(raw.get(SESSION_CONFIG) or "{}")
        if not isinstance(config, dict):
            raise ValueError("config is not a JSON object")
        return SessionRecord(
            worker=raw[SESSION_WORKER],
            token_sha256=raw[SESSION_TOKEN_SHA256],
            model=raw.get(SESSION_MODEL, ""),
            created_ms=int(raw[SESSION_CREATED_MS]),
            config=config,
            auth=_auth_limits(raw),
        )
    except (KeyError, ValueError):
        # Reported as "not found" so the client starts over, instead of retrying into the same error.
        logger.warning("session hash %s is malformed; treating it as missing", key)
        return None


async def touch_sessions(redis: Redis, schema: KeySchema, sids: Iterable[str], ttl_s: float) -> list[str]:
    """Refresh the TTL of many active sessions (hash and log) in one round trip.

    Returns the sids whose session hash was already gone, so the worker can end them. Not a MULTI:
    session keys live in different cluster slots, and each PEXPIRE stands on its own anyway.
    """
    ids = list(sids)
    if not ids:
        return []
    ttl_ms = ttl_to_ms(ttl_s)
    async with redis.pipeline(transaction=False) as pipe:
        for sid in ids:
            pipe.pexpire(schema.session(sid), ttl_ms)
            pipe.pexpire(schema.log(sid), ttl_ms)  # 0 when no turn has been logged yet: fine
        results = await pipe.execute()
    missing = [sid for sid, alive in zip(ids, results[0::2], strict=True) if not alive]
    if missing:
        logger.info("%d of %d touched sessions had already expired", len(missing), len(ids))
    return missing


async def delete_session(redis: Redis, schema: KeySchema, sid: str) -> bool:
    """Remove both session keys; True if the session hash existed."""
    async with redis.pipeline(transaction=False) as pipe:  # two slots on a cluster: no MULTI
        pipe.delete(schema.session(sid))
        pipe.delete(schema.log(sid))
        removed_hash, _ = await pipe.execute()
    return bool(removed_hash)


class SessionUsage:
    """The session hash's spent-tokens counter, the one field the gateways add to after open.

    It lives in the session hash so it expires with the session; it is not part of `SessionRecord`
    (a worker re-writing the record after Redis lost its data does not know it: the session's budget
    then counts again from what the gateways spend from there on).
    """

    def __init__(self, redis: Redis, schema: KeySchema) -> None:
        self._redis = redis
        self._schema = schema
        self._add = redis.register_script(lua_script("session_add_used"))

    async def read(self, sid: str) -> int:
        raw = await self._redis.hget(self._schema.session(sid), SESSION_AUTH_USED)
        return int(raw) if raw is not None else 0

    async def add(self, sid: str, used: int, pipe: Pipeline | None = None) -> None:
        """Add `used` tokens (queued on `pipe` when given); a gone session is left gone."""
        await self._add(keys=[self._schema.session(sid)], args=[SESSION_AUTH_USED, used], client=pipe)


# --- resume tokens -----------------------------------------------------------------------------


def new_resume_token() -> str:
    """A fresh secret the client presents to resume; only its SHA-256 is ever stored."""
    return secrets.token_urlsafe(RESUME_TOKEN_BYTES)


def verify_token(token: str, stored_sha256: str) -> bool:
    """Constant-time check of a presented token against the stored digest (no timing oracle)."""
    # Bytes on both sides: compare_digest refuses non-ASCII str, and the stored value came off the wire.
    return hmac.compare_digest(sha256_hex(token).encode(), stored_sha256.encode())
