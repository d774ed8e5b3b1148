"""Client authentication: the credential on the handshake, and `POST /v1/client_tokens`.

Where a credential comes from (docs/design.md section 3 "Authentication"):
- `Authorization: Bearer <key>` on the WebSocket handshake (servers, the Python client);
- a subprotocol `microturn.bearer.<token>` next to the encoding's (browsers cannot set headers), or
  OpenAI's `openai-insecure-api-key.<secret>` (what OpenAI's browser SDK offers, gateway/openai/).
  It is never echoed back: the handshake answer names only the encoding's subprotocol (or none),
  so the secret is not reflected into responses, logs or proxies that record them.

Either place takes an API key (`mt_...`) or a browser token (`mtb_...`). Every failure (no
credential, unknown, revoked, expired, a token whose key was revoked) is one `unauthorized` with one
message, and a wrong key takes the same path as a right one (hash, one lookup by digest), so an
answer never says whether a key exists.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Final

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.auth.api_keys import API_KEY_PREFIX, CLIENT_TOKEN_PREFIX, KeyStore
from gateway.auth.client_tokens import ClientTokenStore
from gateway.auth.session_auth import UNAUTHORIZED_MESSAGE, Principal
from gateway.handshake import CREDENTIAL_PREFIXES
from shared.errors import ErrorCode, InvalidMessage
from shared.protocol.codec import parse_json
from shared.protocol.fields import FieldReader
from shared.protocol.key_limits import KeyLimits
from shared.store.values import sha256_hex

logger = logging.getLogger(__name__)

MAX_BODY_BYTES: Final = 4096
# Looked up when a browser token is unknown, so a wrong token costs the same two lookups as a right one.
_NO_KEY_DIGEST: Final = sha256_hex("")


def bearer_credential(headers: Mapping[str, str], offered: Iterable[str]) -> str | None:
    """The credential a client presented: the Authorization header first, then the subprotocol."""
    header = headers.get("authorization", "")
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    for offer in offered:
        name = offer.strip()
        for prefix in CREDENTIAL_PREFIXES:
            if name.startswith(prefix) and len(name) > len(prefix):
                return name[len(prefix) :]
    return None


class Authenticator:
    def __init__(self, keys: KeyStore, tokens: ClientTokenStore, client_token_ttl_s: float) -> None:
        self.keys = keys
        self.tokens = tokens
        self.client_token_ttl_s = client_token_ttl_s

    async def authenticate(self, credential: str | None) -> Principal | None:
        """Who presented `credential`, or None. Raises RedisError when the store cannot answer."""
        if not credential:
            return None
        if credential.startswith(CLIENT_TOKEN_PREFIX):
            token = await self.tokens.by_secret(credential)
            key = await self.keys.by_digest(token.key_digest if token is not None else _NO_KEY_DIGEST)
            if token is None or key is None:
                return None
            return Principal(key, token)
        key = await self.keys.by_secret(credential)
        return None if key is None else Principal(key)

    async def mint(self, request: Request) -> Response:
        """`POST /v1/client_tokens`: an API key in, a one-session browser token out."""
        credential = bearer_credential(request.headers, ())
        try:
            key = None
            if credential is not None and credential.startswith(API_KEY_PREFIX):
                key = await self.keys.by_secret(credential)
            else:
                await self.keys.by_digest(_NO_KEY_DIGEST)  # the same work for every refusal
            if key is None:
                return _error(401, ErrorCode.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
            try:
                limits = await _token_limits(request)
            except InvalidMessage as exc:
                return _error(400, ErrorCode.INVALID_MESSAGE, exc.message)
            secret, token = await self.tokens.mint(key, limits.capped_by(key.limits), self.client_token_ttl_s)
        except (RedisError, OSError) as exc:
            logger.warning("client token store error: %r", exc)
            return _error(503, ErrorCode.WORKER_UNAVAILABLE, "the key store is unavailable")
        body: dict[str, object] = {"token": secret, "expires_at": token.expires_at_ms // 1000}
        granted = {name: getattr(token.limits, name) for name in KeyLimits.names(granted=True)}
        body["limits"] = {name: value for name, value in granted.items() if value}
        logger.info("browser token minted for key %s", key.name)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})


async def _token_limits(request: Request) -> KeyLimits:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise InvalidMessage(f"body of {len(raw)} bytes exceeds {MAX_BODY_BYTES}")
    if not raw.strip():
        return KeyLimits()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidMessage("the body must be UTF-8 JSON") from None
    r = FieldReader(parse_json(text), "client_tokens body")
    max_session_s = r.opt_number("max_session_s", 0.0, lo_open=True)
    max_tokens = r.opt_integer("max_tokens", 1)
    r.done()
    return KeyLimits(max_session_s=max_session_s or 0.0, max_tokens=max_tokens or 0)


def _error(status: int, code: ErrorCode, message: str) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"code": code.value, "message": message}}, status, headers=headers)
