"""`POST /v1/realtime/client_secrets`: OpenAI's ephemeral client secrets, as microturn browser tokens.

Why the same tokens: a client secret is what `POST /v1/client_tokens` already mints (docs/auth.md):
it starts one session within its window, under its key's limits, and is refused like any other
credential when wrong, revoked or expired. Only the shapes differ: the body is OpenAI's
(`expires_after`, `session`) and so is the answer (`value`, `expires_at`, `session`), so
`client.realtime.client_secrets.create(...)` works unchanged; a browser then offers the value as
the subprotocol `openai-insecure-api-key.<value>`.

The `session` given is validated as `session.update` validates it, kept with the token and echoed
back; a socket that authenticates with the secret starts from it (its `instructions` and
`max_output_tokens`; a `model` it names must be the socket's).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Final

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.auth.api_keys import API_KEY_PREFIX
from gateway.auth.credentials import MAX_BODY_BYTES, bearer_credential
from gateway.auth.session_auth import UNAUTHORIZED_MESSAGE
from gateway.openai.client_events import parse
from gateway.openai.errors import INVALID_REQUEST, SERVER_ERROR, BadEvent
from gateway.openai.ids import session_id
from gateway.openai.server_events import SessionView
from gateway.openai.session_config import SessionUpdate
from gateway.services import GatewayServices
from shared.protocol.key_limits import KeyLimits
from shared.settings import EngineSettings

logger = logging.getLogger(__name__)

MIN_EXPIRES_S: Final = 10
MAX_EXPIRES_S: Final = 7200  # OpenAI's bounds for `expires_after.seconds`
_NO_KEY: Final = "mt_" + "0" * 43  # looked up for every refusal: a wrong key costs what a right one does


class _BadBody(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _error(status: int, kind: str, code: str, message: str, param: str | None = None) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = {"error": {"message": message, "type": kind, "code": code, "param": param}}
    return JSONResponse(body, status, headers=headers)


def _read_body(raw: bytes, default_ttl_s: float) -> tuple[float, SessionUpdate | None]:
    if len(raw) > MAX_BODY_BYTES:
        raise _BadBody(f"body of {len(raw)} bytes exceeds {MAX_BODY_BYTES}")
    if not raw.strip():
        return default_ttl_s, None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _BadBody("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise _BadBody("the body must be a JSON object")
    unknown = set(body) - {"expires_after", "session"}
    if unknown:
        raise _BadBody(f"unknown field {sorted(unknown)[0][:64]!r}", sorted(unknown)[0][:64])
    ttl_s = default_ttl_s
    expires = body.get("expires_after")
    if expires is not None:
        if not isinstance(expires, dict) or expires.get("anchor", "created_at") != "created_at":
            raise _BadBody('expires_after must be {"anchor": "created_at", "seconds": N}', "expires_after")
        seconds = expires.get("seconds", default_ttl_s)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise _BadBody("expires_after.seconds must be a number", "expires_after.seconds")
        if not MIN_EXPIRES_S <= seconds <= MAX_EXPIRES_S:
            raise _BadBody(
                f"expires_after.seconds must be from {MIN_EXPIRES_S} to {MAX_EXPIRES_S}",
                "expires_after.seconds",
            )
        ttl_s = float(seconds)
    session = body.get("session")
    if session is None:
        return ttl_s, None
    try:
        update = parse(
            json.dumps({"type": "session.update", "session": session}),
            max_output_tokens=EngineSettings.max_output_tokens,
        )
    except BadEvent as exc:
        raise _BadBody(exc.message, exc.param) from None
    assert isinstance(update, SessionUpdate)
    return ttl_s, update


def _kept(update: SessionUpdate) -> dict[str, Any]:
    """What a socket opened with the secret starts from (gateway/openai/connect.py reads it)."""
    kept: dict[str, Any] = {
        "model": update.model,
        "instructions": update.instructions,
        "echoed": dict(update.echoed),
    }
    if "max_output_tokens" in update.given:
        kept["max_output_tokens"] = (
            update.max_output_tokens if update.max_output_tokens is not None else "inf"
        )
    return kept


def _session(update: SessionUpdate | None) -> dict[str, Any]:
    view = SessionView(
        session_id(),
        (update.model if update is not None else None) or "",
        (update.instructions if update is not None else None) or "",
        update.max_output_tokens if update is not None else None,
        update.echoed if update is not None else {},
    )
    return view.as_dict(identified=True)


async def client_secrets(request: Request) -> Response:
    services: GatewayServices = request.app.state.services
    authenticator = services.authenticator
    if authenticator is None:
        return _error(404, INVALID_REQUEST, "auth_off", "auth is off on this gateway: no secret needed")
    credential = bearer_credential(request.headers, ())
    try:
        known = credential is not None and credential.startswith(API_KEY_PREFIX)
        key = await authenticator.keys.by_secret(credential if known and credential else _NO_KEY)
        if not known or key is None:
            return _error(401, INVALID_REQUEST, "invalid_api_key", UNAUTHORIZED_MESSAGE)
        try:
            ttl_s, update = _read_body(await request.body(), authenticator.client_token_ttl_s)
        except _BadBody as exc:
            return _error(400, INVALID_REQUEST, "invalid_value", exc.message, exc.param)
        session = None if update is None else json.dumps(_kept(update))
        secret, token = await authenticator.tokens.mint(
            key, KeyLimits().capped_by(key.limits), ttl_s, session
        )
    except (RedisError, OSError) as exc:
        logger.warning("client secret store error: %r", exc)
        return _error(503, SERVER_ERROR, "worker_unavailable", "the key store is unavailable")
    logger.info("client secret minted for key %s (%.0f s)", key.name, ttl_s)
    body = {"value": secret, "expires_at": token.expires_at_ms // 1000, "session": _session(update)}
    return JSONResponse(body, headers={"Cache-Control": "no-store"})
