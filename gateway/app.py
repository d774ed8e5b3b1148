"""The gateway's Starlette app: routes and lifespan (docs/design.md sections 1 and 3).

Why so thin: the gateway is stateless by design (any replica can serve any session), so the app
only owns what is shared by all sockets of this process: one Redis client, one pool of worker
links, the metrics. Each `/v1/realtime` socket gets its own `ClientSession`.

Routes: `/v1/realtime` (the client protocol: native or OpenAI Realtime, chosen at the handshake by
gateway/handshake.py), `POST /v1/client_tokens` (browser tokens, with auth on),
`POST /v1/realtime/client_secrets` (the same tokens as OpenAI's ephemeral client secrets),
`/healthz` (the process runs), `/readyz` (Redis answers PING: without it no session can be opened
or resumed), `/metrics` (Prometheus text) and `/` (the demo page).

With auth on (the default) a socket is accepted, then its credential checked before anything else:
a bad one gets a fatal `unauthorized` and close code 4011, before any session state exists. The
close comes after the accept, not as an HTTP 401, because a browser only ever sees close codes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from gateway.auth.credentials import bearer_credential
from gateway.auth.session_auth import UNAUTHORIZED_MESSAGE, Principal
from gateway.dialect import Dialect, NativeDialect
from gateway.handshake import negotiate
from gateway.links import LinkPool
from gateway.metric_families import Metric
from gateway.metrics import GatewayMetrics
from gateway.openai.client_secrets import client_secrets
from gateway.openai.connect import openai_dialect, refusal_dialect
from gateway.services import GatewayServices
from gateway.session.client_session import ClientSession
from shared.errors import ErrorCode, MicroturnError, Unauthorized, WorkerUnavailable
from shared.protocol.close_codes import CLOSE_POLICY_VIOLATION, close_code_for, error_message_from
from shared.settings import GatewaySettings, is_loopback_host
from shared.store.connection import redacted_url, resilient_redis

logger = logging.getLogger(__name__)

# Policy violation: the close before accept turns into an HTTP 403 for the handshake.
_REFUSE_HANDSHAKE = CLOSE_POLICY_VIOLATION
_READY_TIMEOUT_S = 2.0


def _services(holder: Starlette | Request | WebSocket) -> GatewayServices:
    app = holder if isinstance(holder, Starlette) else holder.app
    services: GatewayServices = app.state.services
    return services


async def _refuse(ws: WebSocket, dialect: Dialect, exc: MicroturnError) -> None:
    """A fatal error as the socket's only message, then its close code."""
    with contextlib.suppress(Exception):  # the client may already be gone
        for frame in dialect.encode(error_message_from(exc, fatal=True)):
            if isinstance(frame, str):
                await ws.send_text(frame)
            else:
                await ws.send_bytes(frame)
        await ws.close(close_code_for(exc.code))


async def _authenticate(ws: WebSocket, services: GatewayServices, dialect: Dialect) -> Principal | None:
    """The socket's principal; None after refusing it (the caller then just returns)."""
    assert services.authenticator is not None
    credential = bearer_credential(ws.headers, ws.scope.get("subprotocols", []))
    try:
        principal = await services.authenticator.authenticate(credential)
    except (RedisError, OSError) as exc:
        logger.warning("key store error at handshake: %r", exc)
        await _refuse(ws, dialect, WorkerUnavailable("the key store is unavailable", retry_after_ms=1000))
        return None
    if principal is None:
        services.metrics.count(Metric.ERRORS, label=ErrorCode.UNAUTHORIZED)
        await _refuse(ws, dialect, Unauthorized(UNAUTHORIZED_MESSAGE))
    return principal


async def realtime(ws: WebSocket) -> None:
    services = _services(ws)
    negotiated = negotiate(ws.scope.get("subprotocols", []))
    if negotiated is None:
        logger.info("refusing a client offering only unknown subprotocols")  # never log a bearer one
        await ws.close(_REFUSE_HANDSHAKE)
        return
    await ws.accept(subprotocol=negotiated.subprotocol)
    dialect: Dialect
    if negotiated.dialect == "openai":
        dialect = refusal_dialect(services, ws.query_params.get("model"))
    else:
        dialect = NativeDialect(negotiated.encoding, services.settings.max_frame_bytes, services.metrics)
    principal = None
    if services.authenticator is not None:
        principal = await _authenticate(ws, services, dialect)
        if principal is None:
            return
    if negotiated.dialect == "openai":
        chosen = await openai_dialect(ws, services, principal)
        if chosen is None:
            return
        dialect = chosen
    services.metrics.count(Metric.SOCKETS_OPEN)
    try:
        await ClientSession(ws, dialect, services, principal).run()  # its greeting first
    finally:
        services.metrics.count(Metric.SOCKETS_OPEN, -1)


async def client_tokens(request: Request) -> Response:
    services = _services(request)
    if services.authenticator is None:
        body = {
            "error": {"code": "invalid_message", "message": "auth is off on this gateway: no token needed"}
        }
        return JSONResponse(body, status_code=404)
    return await services.authenticator.mint(request)


async def healthz(request: Request) -> Response:
    return PlainTextResponse("ok\n")


async def readyz(request: Request) -> Response:
    services = _services(request)
    try:
        await services.redis.ping()
    except (RedisError, OSError) as exc:
        return PlainTextResponse(f"redis unavailable: {exc}\n", status_code=503)
    return PlainTextResponse("ready\n")


async def metrics(request: Request) -> Response:
    services = _services(request)
    services.metrics.set(Metric.SESSIONS_ACTIVE, services.pool.sessions)
    return PlainTextResponse(services.metrics.render(), media_type="text/plain; version=0.0.4")


async def index(request: Request) -> Response:
    page = resources.files("gateway").joinpath("static", "index.html").read_text(encoding="utf-8")
    return HTMLResponse(page)


def _warn_if_open(settings: GatewaySettings) -> None:
    if not settings.auth_required and not is_loopback_host(settings.host):
        logger.warning(
            "!!! AUTH IS OFF on %s: anyone who reaches port %d can open sessions without a key. "
            "Use --auth on (the default) on any address other than loopback. !!!",
            settings.host,
            settings.port,
        )


def create_app(settings: GatewaySettings) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        redis = resilient_redis(
            settings.redis_url, settings.redis_mode
        )  # recovers on first use after a Redis restart
        gateway_metrics = GatewayMetrics()
        pool = LinkPool(
            gateway_metrics,
            link_secret=settings.link_secret,
            connect_timeout_s=settings.link_connect_timeout_s,
        )
        services = GatewayServices(settings, redis, pool, gateway_metrics)
        app.state.services = services
        if services.auth is not None:
            services.auth.ledger.start()
        _warn_if_open(settings)
        logger.info(
            "gateway up (redis %s, prefix %r, auth %s)",
            redacted_url(settings.redis_url),
            settings.key_prefix,
            settings.auth,
        )
        try:
            yield
        finally:
            if services.auth is not None:
                await services.auth.ledger.stop()
            await pool.close()
            await redis.aclose()
            logger.info("gateway stopped")

    return Starlette(
        routes=[
            WebSocketRoute("/v1/realtime", realtime),
            Route("/v1/client_tokens", client_tokens, methods=["POST"]),
            Route("/v1/realtime/client_secrets", client_secrets, methods=["POST"]),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", metrics),
            Route("/", index),
        ],
        lifespan=lifespan,
    )
