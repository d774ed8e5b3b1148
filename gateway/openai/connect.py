"""Setting up an accepted OpenAI-dialect socket: its model, limits and translator.

Why here and not in the dialect: this is the only step that awaits (Redis, for the served models
and the model's card); the dialect itself stays Sans-I/O. The SDK names the model in the URL
(`/v1/realtime?model=smollm2-135m`): it must be one a live worker serves, else the client gets an
`error` naming the served ones and the socket closes before any session exists. With no `model`
and exactly one model served, that one is used.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from redis.exceptions import RedisError
from starlette.websockets import WebSocket

from gateway.auth.api_keys import ms_until_next_day
from gateway.auth.session_auth import Principal
from gateway.openai import server_events as ev
from gateway.openai.admission import DialectLimits
from gateway.openai.dialect import OpenAIDialect
from gateway.openai.errors import SERVER_ERROR, RealtimeProblem
from gateway.services import GatewayServices
from shared.protocol.close_codes import CLOSE_POLICY_VIOLATION, CLOSE_TRY_AGAIN_LATER
from shared.settings import EngineSettings
from shared.store.models import ModelCard, read_model, served_models

logger = logging.getLogger(__name__)


def refusal_dialect(services: GatewayServices, model: str | None) -> OpenAIDialect:
    """A translator for the errors sent before a session exists (a refused credential)."""
    return OpenAIDialect(ModelCard(model or "unknown"), _limits(services, None), services.limits)


def _limits(services: GatewayServices, principal: Principal | None) -> DialectLimits:
    rate_limits = []
    if principal is not None:
        if principal.key.limits.max_tokens_per_day:
            budget = principal.key.limits.max_tokens_per_day
            rate_limits.append(ev.RateLimit("tokens", budget, budget, ms_until_next_day() / 1000))
        granted = principal.granted
        if granted.max_tokens:
            rate_limits.append(
                ev.RateLimit("tokens", granted.max_tokens, granted.max_tokens, granted.max_session_s)
            )
    return DialectLimits(
        max_output_tokens=EngineSettings.max_output_tokens,
        max_frame_bytes=services.settings.max_frame_bytes,
        rate_limits=tuple(rate_limits),
    )


async def _send_refusal(ws: WebSocket, problem: RealtimeProblem, code: int) -> None:
    try:
        await ws.send_text(ev.frame(ev.error(problem)))
        await ws.close(code)
    except Exception:  # the client may already be gone
        logger.debug("client left before its refusal was sent")


def _secret_session(principal: Principal | None) -> dict[str, Any]:
    """The session settings a client secret was minted with (gateway/openai/client_secrets.py)."""
    raw = None if principal is None or principal.token is None else principal.token.session
    if not raw:
        return {}
    try:
        kept = json.loads(raw)
    except ValueError:
        logger.warning("a client secret's session settings are unreadable; ignored")
        return {}
    return kept if isinstance(kept, dict) else {}


async def openai_dialect(
    ws: WebSocket, services: GatewayServices, principal: Principal | None
) -> OpenAIDialect | None:
    """The socket's translator; None after refusing the socket (the caller then just returns)."""
    secret = _secret_session(principal)
    wanted = ws.query_params.get("model") or secret.get("model") or None
    if secret.get("model") and wanted != secret["model"]:
        problem = RealtimeProblem(
            f"this client secret is for model {secret['model']!r}, not {wanted!r}",
            code="model_mismatch",
            param="model",
        )
        await _send_refusal(ws, problem, CLOSE_POLICY_VIOLATION)
        return None
    try:
        served = await served_models(services.redis, services.schema)
        name = wanted if wanted is not None else (served[0] if len(served) == 1 else None)
        card = (
            None
            if name is None or name not in served
            else await read_model(services.redis, services.schema, name)
        )
    except (RedisError, OSError) as exc:
        logger.warning("model registry unavailable at handshake: %r", exc)
        problem = RealtimeProblem(
            "the model registry is unavailable; try again", code="worker_unavailable", kind=SERVER_ERROR
        )
        await _send_refusal(ws, problem, CLOSE_TRY_AGAIN_LATER)
        return None
    if name is None or name not in served:
        what = "no model named (?model=)" if wanted is None else f"model {wanted[:128]!r} is not served here"
        problem = RealtimeProblem(f"{what}; served: {served}", code="model_not_found", param="model")
        await _send_refusal(ws, problem, CLOSE_POLICY_VIOLATION)
        return None
    echoed = secret.get("echoed")
    return OpenAIDialect(
        card if card is not None else ModelCard(name),
        _limits(services, principal),
        services.limits,  # the rate and queue are the session's own rule, attached by the shell
        services.metrics,
        instructions=secret.get("instructions") or None,
        max_output_tokens=_max_tokens(secret.get("max_output_tokens")),
        echoed=echoed if isinstance(echoed, dict) else None,
    )


def _max_tokens(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None  # "inf" / absent
