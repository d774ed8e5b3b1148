"""Session placement: one atomic Lua script picks and charges a worker (docs/design.md section 5).

Why a script and not read-then-write from Python: between a gateway reading the ZSET and charging
its pick, other gateways would read the same "least loaded" worker and all pile onto it. Inside the
script the read, the dead-member cleanup and the charge are one atomic step, so N concurrent opens
spread over the workers exactly as if they had been made one after another.

The script (shared/store/lua/place.lua) declares only the workers ZSET in KEYS and derives the worker hash
keys from a prefix in ARGV; every one of them carries the same `{prefix}` hash tag, so the script is
single-slot and runs on Redis Cluster. The trade-off is spelled out at the top of the script.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Final

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from shared.errors import CapacityExhausted
from shared.store.registry import Placement
from shared.store.schema import KeySchema, lua_script
from shared.store.values import now_ms, text

logger = logging.getLogger(__name__)

# A worker's free slots show up at its next heartbeat, so about one heartbeat interval is the
# soonest a retry could succeed.
DEFAULT_RETRY_AFTER_MS: Final = 1000
# How long a worker stays suspect after a gateway lost its link to it: longer than a worker hash's
# TTL (3 heartbeats of 1 s by default), so a dead worker is skipped until its hash has expired; a
# live one that was only cut off comes back after it (or at once when it registers afresh).
SUSPECT_TTL_S: Final = 5.0

__all__ = [
    "DEFAULT_RETRY_AFTER_MS",
    "SUSPECT_TTL_S",
    "Placement",
    "load_place_script",
    "mark_suspect",
    "place_script_source",
    "place_session",
]


def place_script_source() -> str:
    """The script's text (shared/store/lua/place.lua, shipped as package data)."""
    return lua_script("place")


def load_place_script(redis: Redis) -> AsyncScript:
    """Bind the placement script to a client. Cheap (a SHA-1 of the text): the script runs by EVALSHA
    and is loaded into the server on the first NOSCRIPT, e.g. after a restart or failover."""
    return redis.register_script(place_script_source())


async def place_session(
    redis: Redis,
    schema: KeySchema,
    *,
    retry_after_ms: int = DEFAULT_RETRY_AFTER_MS,
    max_heartbeat_age_ms: int = 0,
    exclude: Collection[str] = (),
    model: str | None = None,
    prefix: str | None = None,
) -> Placement:
    """Pick the least-loaded live `ready` worker with a free session slot and charge one slot to it.

    `max_heartbeat_age_ms` > 0 also skips workers whose last heartbeat is older than that (by this
    host's clock), for deployments whose hash TTL is long; 0 leaves liveness to the TTL alone, which
    needs no clock agreement between hosts. Raises `CapacityExhausted` with `retry_after_ms` when no
    worker has room; the caller writes the session hash once the worker has accepted the session.
    Workers with a suspect key, and those in `exclude` (the caller's own suspects), are skipped;
    with `model`, so is every worker serving another model (None: any model). With `prefix` (the
    name of the session's prefix, shared/store/prefix_label.py), a worker with room that holds it is
    preferred to a less loaded one that does not.
    """
    script = load_place_script(redis)
    age_ms = max(0, max_heartbeat_age_ms)
    result = await script(
        keys=[schema.workers()],
        args=[
            schema.worker_prefix(),
            now_ms(),
            age_ms,
            schema.suspect_prefix(),
            model or "",
            prefix or "",
            *exclude,
        ],
    )
    if result is None:
        logger.info("no worker with room under prefix %r (model %r)", schema.prefix, model)
        serving = f" serving {model!r}" if model else ""
        raise CapacityExhausted(f"no worker{serving} has a free session slot", retry_after_ms=retry_after_ms)
    if not all(isinstance(v, bytes | str) for v in result):
        raise TypeError(f"unexpected reply from place.lua: {result!r}")
    worker_id, url = (text(v) for v in result)
    logger.debug("placed a session on worker %s (%s)", worker_id, url)
    return Placement(worker_id=worker_id, url=url)


async def mark_suspect(redis: Redis, schema: KeySchema, worker_id: str, ttl_s: float = SUSPECT_TTL_S) -> None:
    """Tell every gateway's placement to skip `worker_id` for `ttl_s` (a gateway lost its link)."""
    await redis.set(schema.suspect(worker_id), b"1", px=max(1, round(ttl_s * 1000)))
    logger.info("worker %s marked suspect for %.1f s", worker_id, ttl_s)
