"""Browser tokens (`POST /v1/client_tokens`): short-lived, one session each, limits at most the key's.

Why a token and not the key in the page: a browser can be read by its user, so it gets a credential
that can start one session within minutes and is worth nothing after. The token is stored like a
key, as `mt:clienttoken:<sha256>` (a HASH with a TTL: the start window). Its life:

1. minted: fields `key` (the API key's digest), its granted limits by name (`max_session_s`,
   `max_tokens`: `KeyLimits`, 0 meaning "as much as the key allows"), `expires_at_ms`;
2. claimed by the first `session.open` that presents it (`claim`, one Lua step: only one session can
   win, however many gateways race), which records the session id and stretches the TTL to cover
   that session, so the same token can *resume* its own session (a reconnecting page) but never
   open a second one. An open that fails after the claim (no worker had room) gives it back
   (`unclaim`): a token is spent by a session, not by an attempt;
3. gone with its TTL.

The session's limits (duration, token budget) are not enforced here but by the gateway that holds
the socket (gateway/session_guard.py), from the limits this record carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from redis.asyncio import Redis

from gateway.auth.api_keys import CLIENT_TOKEN_PREFIX, ApiKey, new_secret
from shared.protocol.key_limits import KeyLimits
from shared.store.schema import KeySchema, lua_script
from shared.store.values import now_ms, sha256_hex, text_map

__all__ = ["ClientToken", "ClientTokenStore"]

_KEY: Final = "key"
_SID: Final = "sid"
_EXPIRES_AT_MS: Final = "expires_at_ms"
_SESSION: Final = "session"


@dataclass(frozen=True, slots=True)
class ClientToken:
    digest: str
    key_digest: str
    limits: KeyLimits  # the granted ones (shared/protocol/key_limits.py), capped by the key's
    expires_at_ms: int
    # The session it opened; None until claimed.
    sid: str | None
    # A client secret's session settings (OpenAI dialect, gateway/openai/client_secrets.py), as JSON.
    session: str | None = None


class ClientTokenStore:
    def __init__(self, redis: Redis, schema: KeySchema) -> None:
        self.redis = redis
        self.schema = schema
        self._claim = redis.register_script(lua_script("claim_token"))
        self._unclaim = redis.register_script(lua_script("unclaim_token"))

    async def mint(
        self, key: ApiKey, limits: KeyLimits, ttl_s: float, session: str | None = None
    ) -> tuple[str, ClientToken]:
        """A new token for `key` (its limits already capped); the secret is returned once."""
        secret = new_secret(CLIENT_TOKEN_PREFIX)
        ttl_ms = max(1, int(ttl_s * 1000))
        token = ClientToken(sha256_hex(secret), key.digest, limits, now_ms() + ttl_ms, None, session)
        fields = {
            _KEY: key.digest,
            **limits.to_fields(KeyLimits.names(granted=True)),
            _EXPIRES_AT_MS: str(token.expires_at_ms),
        }
        if session is not None:
            fields[_SESSION] = session
        name = self.schema.client_token(token.digest)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(name, mapping=fields)  # type: ignore[arg-type]
            pipe.pexpire(name, ttl_ms)
            await pipe.execute()
        return secret, token

    async def by_secret(self, secret: str) -> ClientToken | None:
        token_digest = sha256_hex(secret)
        raw = text_map(await self.redis.hgetall(self.schema.client_token(token_digest)))
        if not raw:
            return None
        try:
            limits = KeyLimits.from_fields(raw)
            return ClientToken(
                token_digest, raw[_KEY], limits, int(raw[_EXPIRES_AT_MS]), raw.get(_SID), raw.get(_SESSION)
            )
        except (KeyError, ValueError):
            return None

    async def claim(self, token: ClientToken, sid: str, hold_s: float) -> bool:
        """Bind the token to `sid` for `hold_s`; False if another session has it or it expired."""
        hold_ms = max(1, int(hold_s * 1000))
        won = await self._claim(keys=[self.schema.client_token(token.digest)], args=[sid, hold_ms])
        return int(won) == 1

    async def unclaim(self, token: ClientToken, sid: str) -> None:
        """Undo `claim` for a session that never opened, so the token can still start one."""
        await self._unclaim(keys=[self.schema.client_token(token.digest)], args=[sid, token.expires_at_ms])
