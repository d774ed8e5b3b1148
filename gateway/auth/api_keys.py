"""API keys and browser tokens in Redis (docs/design.md section 7 "Per API key"): SHA-256 digests only.

Why digests: a dump of Redis (or a replica, or a backup) must not hand out working credentials. A
key is 256 random bits, so an unsalted SHA-256 is as good as a password hash here and lets a
gateway find the key's record with one HGETALL on `mt:apikey:<sha256>`. That lookup is also why an
answer never reveals whether a key exists: a wrong key and a revoked key take the very same path
(hash, one HGETALL that comes back empty) and get the very same error.

Keys (all under the deployment's prefix, see shared/store/schema.py):
- `mt:apikeys` HASH name -> digest: the index `microturn keys list|revoke` walks. Names are unique
  (HSETNX), so two `keys create --name x` cannot both succeed.
- `mt:apikey:<digest>` HASH: the key's name and limits. Revoking deletes it (and the index entry);
  the next open with that key is refused, sessions already open run on.
- `mt:clienttoken:<digest>` HASH: a browser token's key and limits, with a TTL (its start window).
  `claim_client_token` binds it to the one session it may open (see gateway/auth/client_tokens.py).
- `mt:keyusage:<digest>:<YYYYMMDD>` STRING: tokens spent per UTC day, grown by batched INCRBY.

Limits (`KeyLimits`, shared/protocol/key_limits.py) use 0 for "no limit", so a record is a flat hash
of numbers.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from redis.asyncio import Redis

from shared.protocol.key_limits import KeyLimits
from shared.store.schema import KeySchema
from shared.store.values import now_ms, sha256_hex, text, text_map

logger = logging.getLogger(__name__)

API_KEY_PREFIX: Final = "mt_"
CLIENT_TOKEN_PREFIX: Final = "mtb_"
SECRET_BYTES: Final = 32
# A day's usage counter outlives its day by this much, so a late settle never recreates it forever.
USAGE_TTL_S: Final = 2 * 86400
_NAME_FIELD: Final = "name"
_CREATED_FIELD: Final = "created_ms"

__all__ = [
    "API_KEY_PREFIX",
    "CLIENT_TOKEN_PREFIX",
    "ApiKey",
    "KeyExists",
    "KeyStore",
    "ms_until_next_day",
    "new_secret",
    "usage_day",
]


class KeyExists(ValueError):
    """`keys create` with a name that is already taken."""


def new_secret(prefix: str) -> str:
    """A new credential: a readable prefix (what kind it is) and 256 random URL-safe bits.

    URL-safe base64 only uses RFC 7230 token characters, so a browser token can travel inside a
    WebSocket subprotocol name.
    """
    return prefix + secrets.token_urlsafe(SECRET_BYTES)


def usage_day(now_s: float | None = None) -> str:
    """The UTC day a token is charged to, `YYYYMMDD`."""
    moment = datetime.datetime.fromtimestamp(time.time() if now_s is None else now_s, datetime.UTC)
    return moment.strftime("%Y%m%d")


def ms_until_next_day(now_s: float | None = None) -> int:
    """How long until a spent daily budget renews (the `retry_after_ms` of `rate_limited`)."""
    now = time.time() if now_s is None else now_s
    moment = datetime.datetime.fromtimestamp(now, datetime.UTC)
    midnight = (moment + datetime.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((midnight.timestamp() - now) * 1000))


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: str
    limits: KeyLimits
    created_ms: int


class KeyStore:
    """Create, list, revoke and look up API keys, and settle their daily token usage."""

    def __init__(self, redis: Redis, schema: KeySchema) -> None:
        self.redis = redis
        self.schema = schema

    async def create(self, name: str, limits: KeyLimits) -> tuple[str, ApiKey]:
        """A new key: returns the secret (shown once, never stored) and its record."""
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"invalid key name {name!r}: non-empty, no whitespace")
        secret = new_secret(API_KEY_PREFIX)
        key = ApiKey(name, sha256_hex(secret), limits, now_ms())
        # The name is claimed first: a lost race leaves nothing behind, a won one is then filled in.
        if not await self.redis.hsetnx(self.schema.api_keys(), name, key.digest):
            raise KeyExists(f"a key named {name!r} already exists")
        fields = {
            _NAME_FIELD: name,
            _CREATED_FIELD: str(key.created_ms),
            **limits.to_fields(KeyLimits.names(key=True)),
        }
        await self.redis.hset(self.schema.api_key(key.digest), mapping=fields)  # type: ignore[arg-type]
        return secret, key

    async def _record(self, key_digest: str) -> ApiKey | None:
        raw = text_map(await self.redis.hgetall(self.schema.api_key(key_digest)))
        if not raw:
            return None
        try:
            return ApiKey(raw[_NAME_FIELD], key_digest, KeyLimits.from_fields(raw), int(raw[_CREATED_FIELD]))
        except (KeyError, ValueError):
            logger.warning("API key record %s is malformed; refusing it", key_digest[:12])
            return None

    async def by_secret(self, secret: str) -> ApiKey | None:
        """The key a client presented, or None (wrong, revoked: one path, one answer)."""
        return await self._record(sha256_hex(secret))

    async def by_digest(self, key_digest: str) -> ApiKey | None:
        return await self._record(key_digest)

    async def list(self) -> list[ApiKey]:
        index = text_map(await self.redis.hgetall(self.schema.api_keys()))
        keys = []
        for name in sorted(index):
            key = await self._record(index[name])
            if key is not None:
                keys.append(key)
        return keys

    async def revoke(self, name: str) -> bool:
        """Delete the key's record and index entry; False if no key has that name."""
        key_digest = await self.redis.hget(self.schema.api_keys(), name)
        if key_digest is None:
            return False
        key_text = text(key_digest)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.schema.api_key(key_text))
            pipe.hdel(self.schema.api_keys(), name)
            await pipe.execute()
        return True

    async def usage(self, key_digest: str, day: str | None = None) -> int:
        raw = await self.redis.get(self.schema.key_usage(key_digest, day or usage_day()))
        return int(raw) if raw is not None else 0

    async def settle_usage(self, spent: Mapping[str, int], day: str | None = None) -> dict[str, int]:
        """Add each key's unsettled tokens (INCRBY, 0 allowed) in one round trip; returns the totals.

        INCRBY 0 is how a gateway learns what the other gateways spent, so this runs for every key
        with a live session here, not only for keys that spent something.
        """
        if not spent:
            return {}
        when = day or usage_day()
        digests = list(spent)
        async with self.redis.pipeline(transaction=False) as pipe:
            for key_digest in digests:
                counter = self.schema.key_usage(key_digest, when)
                pipe.incrby(counter, spent[key_digest])
                pipe.expire(counter, USAGE_TTL_S)
            replies = await pipe.execute()
        return {key_digest: int(replies[2 * i]) for i, key_digest in enumerate(digests)}
