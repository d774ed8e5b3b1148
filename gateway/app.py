"""The gateway's Starlette app: routes and lifespan (DESIGN sections 1 and 3).

Why so thin: the gateway is stateless by design (any replica can serve any session), so the app
only owns what is shared by all sockets of this process: one Redis client, one pool of worker
links, the metrics. Each `/v1/realtime` socket gets its own `ClientSession`.

Routes: `/v1/realtime` (the client protocol), `/healthz` (the process runs), `/readyz` (Redis
answers PING: without it no session can be opened or resumed), `/metrics` (Prometheus text) and
`/` (the demo page).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from gateway.client_session import ClientSession
from gateway.handshake import negotiate
from gateway.links import LinkPool
from gateway.metrics import GatewayMetrics
from gateway.services import GatewayServices
from shared.redis_client import resilient_redis
from shared.settings import GatewaySettings

logger = logging.getLogger(__name__)

# Policy violation: the close before accept turns into an HTTP 403 for the handshake.
_REFUSE_HANDSHAKE = 1008
_READY_TIMEOUT_S = 2.0


def _services(holder: Starlette | Request | WebSocket) -> GatewayServices:
    app = holder if isinstance(holder, Starlette) else holder.app
    services: GatewayServices = app.state.services
    return services


async def realtime(ws: WebSocket) -> None:
    services = _services(ws)
    negotiated = negotiate(ws.scope.get("subprotocols", []))
    if negotiated is None:
        logger.info("refusing a client offering only %s", ws.scope.get("subprotocols"))
        await ws.close(_REFUSE_HANDSHAKE)
        return
    await ws.accept(subprotocol=negotiated.subprotocol)
    services.metrics.sockets_open += 1
    try:
        await ClientSession(ws, negotiated.encoding, services).run()
    finally:
        services.metrics.sockets_open -= 1


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
    services.metrics.sessions_active = services.pool.sessions
    return PlainTextResponse(services.metrics.render(), media_type="text/plain; version=0.0.4")


async def index(request: Request) -> Response:
    page = resources.files("gateway").joinpath("static", "index.html").read_text(encoding="utf-8")
    return HTMLResponse(page)


def _redacted(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def create_app(settings: GatewaySettings) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        redis = resilient_redis(settings.redis_url)  # recovers on first use after a Redis restart
        gateway_metrics = GatewayMetrics()
        pool = LinkPool(
            gateway_metrics,
            link_secret=settings.link_secret,
            connect_timeout_s=settings.link_connect_timeout_s,
        )
        app.state.services = GatewayServices(settings, redis, pool, gateway_metrics)
        logger.info("gateway up (redis %s, prefix %r)", _redacted(settings.redis_url), settings.key_prefix)
        try:
            yield
        finally:
            await pool.close()
            await redis.aclose()
            logger.info("gateway stopped")

    return Starlette(
        routes=[
            WebSocketRoute("/v1/realtime", realtime),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", metrics),
            Route("/", index),
        ],
        lifespan=lifespan,
    )
