"""Where sessions live, in Redis: placement, the session record, resume checks (docs/design.md section 5).

Why apart from the socket handler: this is all the Redis I/O of the gateway, and it only ever runs
at open, resume, restore and close; keeping it here makes "no Redis call per chunk" visible at a
glance (client_session.py's chunk path never touches this object) and gives each flow one call.
Every function raises typed `MicroturnError`s (or `RedisError` when the store itself fails).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Final

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.errors import CapacityExhausted, InvalidMessage, SessionNotFound, Unauthorized
from shared.protocol.codec import config_from_map, config_to_map
from shared.protocol.key_limits import AuthLimits
from shared.protocol.messages import OpenConfig
from shared.store.placement import Placement, mark_suspect, place_session
from shared.store.prefix_label import prefix_label
from shared.store.registry import (
    SessionRecord,
    delete_session,
    read_session,
    read_worker,
    verify_token,
    write_session,
)
from shared.store.schema import STATE_READY, KeySchema
from shared.store.values import now_ms, sha256_hex

logger = logging.getLogger(__name__)

# How long an open waits for workers to (re-)register when the registry is empty, and how often it
# looks: a couple of worker heartbeats (1 s by default).
EMPTY_REGISTRY_WAIT_S: Final = 3.0
EMPTY_REGISTRY_POLL_S: Final = 0.1


@dataclass(frozen=True, slots=True)
class Placed:
    """A session's record as written, and the link URL of the worker it names."""

    record: SessionRecord
    url: str


class SessionStore:
    def __init__(
        self, redis: Redis, schema: KeySchema, grace_s: float, default_idle_timeout_s: float
    ) -> None:
        self.redis = redis
        self.schema = schema
        self.grace_s = grace_s
        # The same default the workers apply (CommonSettings.idle_timeout_s).
        self.default_idle_timeout_s = default_idle_timeout_s
        # The workers this gateway suspects (LinkPool.suspects): placement skips them.
        self.suspects: Callable[[], Collection[str]] = tuple

    async def mark_suspect(self, worker_id: str) -> bool:
        """Publish the suspicion for every gateway; False when Redis could not take it."""
        try:
            await mark_suspect(self.redis, self.schema, worker_id)
        except RedisError as exc:  # this gateway still skips it; the others wait for its hash TTL
            logger.warning("could not publish worker %s as suspect: %s", worker_id, exc)
            return False
        return True

    def ttl_s(self, config: OpenConfig) -> float:
        """TTL of the session keys: idle timeout + grace."""
        idle = self.default_idle_timeout_s if config.idle_timeout_s is None else config.idle_timeout_s
        return idle + self.grace_s

    async def _place(self, model: str | None = None, prefix: str | None = None) -> tuple[str, str, str]:
        placement = await self._pick(model, prefix)
        info = await read_worker(self.redis, self.schema, placement.worker_id)
        return placement.worker_id, placement.url, info.model if info is not None else ""

    async def _pick(self, model: str | None = None, prefix: str | None = None) -> Placement:
        """Placement, waiting out an empty registry: right after Redis lost its data no worker is
        registered until their next heartbeat re-creates their entries (docs/failover.md)."""
        deadline = time.monotonic() + EMPTY_REGISTRY_WAIT_S
        while True:
            try:
                return await place_session(
                    self.redis, self.schema, exclude=self.suspects(), model=model, prefix=prefix
                )
            except CapacityExhausted:
                if time.monotonic() >= deadline:
                    raise
                if await self.redis.zcard(self.schema.workers()):
                    # Workers are registered, so they were full, unless the first of them
                    # registered between the placement and this count (a heartbeat re-filling the
                    # registry): one more placement decides, and its refusal stands.
                    return await place_session(
                        self.redis, self.schema, exclude=self.suspects(), model=model, prefix=prefix
                    )
            await asyncio.sleep(EMPTY_REGISTRY_POLL_S)

    async def place_new(self, sid: str, token: str, config: OpenConfig, auth: AuthLimits | None) -> Placed:
        """Pick a worker for a new session and write its record (before the worker hears of it: a
        worker heartbeat that finds no record for one of its sessions ends it)."""
        # A worker that holds the open's prefix is preferred: the session then maps its KV.
        prefix = None if config.keep_prefix_text is None else prefix_label(config.keep_prefix_text)
        worker_id, url, model = await self._place(config.model, prefix)
        record = SessionRecord(
            worker=worker_id,
            token_sha256=sha256_hex(token),
            model=model,
            created_ms=now_ms(),
            config=config_to_map(config),
            auth=auth,
        )
        await write_session(self.redis, self.schema, sid, record, self.ttl_s(config))
        return Placed(record, url)

    async def move(
        self, sid: str, record: SessionRecord, config: OpenConfig, target: str | None = None
    ) -> Placed:
        """Pick a worker to restore a session on, and point its record there: `target` when it is
        live, ready and not suspect (a draining worker warmed the session's copy there and charged
        it its slot), else wherever placement says."""
        chosen = await self._target(target, config.model) if target else None
        worker_id, url, model = chosen or await self._place(config.model)
        moved = replace(record, worker=worker_id, model=model or record.model)
        await write_session(self.redis, self.schema, sid, moved, self.ttl_s(config))
        return Placed(moved, url)

    async def _target(self, worker_id: str, model: str | None) -> tuple[str, str, str] | None:
        info = await read_worker(self.redis, self.schema, worker_id)
        if info is None or info.state != STATE_READY or worker_id in self.suspects():
            return None
        if model and info.model != model:
            return None
        return worker_id, info.url, info.model

    async def lookup(self, sid: str, token: str) -> tuple[SessionRecord, OpenConfig]:
        """The record and config of a session a client wants to resume, once its token checks out."""
        record = await read_session(self.redis, self.schema, sid)
        if record is None:
            raise SessionNotFound(f"no session {sid[:64]!r} (it expired, was closed, or never existed)")
        if not verify_token(token, record.token_sha256):  # constant-time
            raise Unauthorized("wrong resume token")
        try:
            return record, config_from_map(record.config)
        except InvalidMessage as exc:
            logger.error("session %s has an unreadable config: %s", sid, exc.message)
            raise SessionNotFound(f"session {sid!r} cannot be resumed") from exc

    async def worker_url(self, worker_id: str) -> str | None:
        """The link URL of a live worker; None when its registry hash has expired."""
        info = await read_worker(self.redis, self.schema, worker_id)
        return None if info is None else info.url

    async def delete(self, sid: str) -> None:
        await delete_session(self.redis, self.schema, sid)
