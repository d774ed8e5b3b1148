"""The worker's Starlette app: `/v1/link` (worker/server/link.py), health, readiness, metrics; the
registry lifecycle in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Final

import redis.asyncio as redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute

from shared.protocol.kv_copy import KV_COPY_PATH
from shared.protocol.link import LINK_PATH
from shared.settings import WorkerSettings
from shared.store.connection import resilient_redis
from shared.store.models import write_model
from shared.store.registry import WorkerInfo, deregister, mark_draining, register_worker
from shared.store.schema import KeySchema
from worker.engine import Engine
from worker.server.handover import migrate_all
from worker.server.heartbeat import HEARTBEATS_PER_TTL, heartbeat_loop, model_card, worker_info
from worker.server.kv_receiver import KVCopyAcceptor
from worker.server.link import LinkAcceptor
from worker.server.rebalance import rebalance_loop
from worker.server.service import WorkerService
from worker.server.switchover import SwitchReport, switch_over

logger = logging.getLogger(__name__)

# The end of a drain's deadline kept for the classic handover of the sessions whose warm copies
# were not ready (worker/server/handover.py): a flush and a frame per session, well under a second.
CLASSIC_HANDOVER_RESERVE_S: Final = 2.0
CLASSIC_HANDOVER_SHARE: Final = 0.3
# How long the drain waits for the heartbeat to end once cancelled: a beat is a few Redis round
# trips; one stuck in a command must not take the drain's reserve for the handover.
HEARTBEAT_STOP_S: Final = 1.0


class WorkerRuntime:
    """What the app's routes share: the engine, the service once started, and the registry identity."""

    def __init__(self, settings: WorkerSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.worker_id = settings.worker_id or f"worker-{uuid.uuid4().hex[:12]}"
        self.url = settings.advertise_url or f"ws://{settings.host}:{settings.port}"
        self.schema = KeySchema(settings.key_prefix)
        self.identity = WorkerInfo(
            worker_id=self.worker_id,
            url=self.url,
            model=engine.model_config.name,
            max_sessions=settings.max_sessions,
        )
        self.service: WorkerService | None = None
        self.redis: redis.Redis | None = None
        self.draining = asyncio.Event()
        self.registered = False
        self.last_switch: SwitchReport | None = None
        self.heartbeat: asyncio.Task[None] | None = None
        self.rebalancer: asyncio.Task[None] | None = None  # with `--rebalance-gap` (rebalance.py)

    async def drain(self) -> None:
        """SIGTERM: leave placement, hand every session to another worker (make before break where
        the deadline allows, docs/failover.md), leave the registry."""
        if self.draining.is_set() or self.service is None or self.redis is None:
            return
        self.draining.set()
        logger.info("draining worker %s", self.worker_id)
        await mark_draining(self.redis, self.schema, self.worker_id)
        self.service.draining = True  # no new session from here on
        if self.rebalancer is not None:
            # The loop ends at `draining`, a round in progress early (never cancelled: a switch cut
            # short would strand its session); its other sessions are READY again for the drain.
            await asyncio.gather(self.rebalancer, return_exceptions=True)
        # Make before break within most of the deadline; what is left goes break-before-make.
        timeout = self.settings.drain_timeout_s
        budget = timeout - min(CLASSIC_HANDOVER_RESERVE_S, timeout * CLASSIC_HANDOVER_SHARE)
        if self.settings.drain_handover != "log":
            self.last_switch = await switch_over(
                self.service,
                self.redis,
                self.schema,
                worker_id=self.worker_id,
                model=self.engine.model_config.name,
                budget_s=budget,
                copy_pages=self.settings.drain_handover == "warm",
            )
        await migrate_all(self.service, self.last_switch.targets if self.last_switch else None)
        await self.service.sessions.flush()
        # The heartbeat stops first: a beat on its way would otherwise write the worker back into
        # the registry after it left (its hash expires, its score stays until a placement sweeps it).
        if self.heartbeat is not None:
            self.heartbeat.cancel()
            _done, running = await asyncio.wait([self.heartbeat], timeout=HEARTBEAT_STOP_S)
            if running:  # a beat stuck in a Redis call: the drain's deadline is not its to spend
                logger.warning(
                    "the heartbeat did not stop within %.0f s; leaving the registry anyway", HEARTBEAT_STOP_S
                )
        await deregister(self.redis, self.schema, self.worker_id)
        self.registered = False

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        client = resilient_redis(self.settings.redis_url, self.settings.redis_mode)
        self.redis = client
        self.service = WorkerService(
            self.engine,
            self.settings,
            client,
            self.schema,
            asyncio.get_running_loop(),
            worker_id=self.worker_id,
        )
        period = self.settings.heartbeat_s
        info = await asyncio.to_thread(worker_info, self.identity, self.engine, draining=False)
        await write_model(client, self.schema, model_card(self.engine))  # before placement can pick it
        await register_worker(client, self.schema, info, period * HEARTBEATS_PER_TTL)
        self.registered = True
        logger.info("worker %s registered at %s", self.worker_id, self.url)
        self.heartbeat = asyncio.create_task(
            heartbeat_loop(
                client,
                self.schema,
                self.identity,
                self.service,
                period_s=period,
                grace_s=self.settings.session_grace_s,
                draining=self.draining,
            )
        )
        tasks = [asyncio.create_task(self.service.sessions.log_writer.run()), self.heartbeat]
        if self.settings.rebalance_gap:
            self.rebalancer = asyncio.create_task(
                rebalance_loop(
                    self.service,
                    client,
                    self.schema,
                    self.identity,
                    gap=self.settings.rebalance_gap,
                    period_s=self.settings.rebalance_period_s,
                    draining=self.draining,
                )
            )
            tasks.append(self.rebalancer)
        try:
            yield
        finally:
            await self.drain()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.aclose()

    @property
    def link_secret(self) -> str:
        return self.settings.link_secret

    @property
    def copy_service(self) -> WorkerService | None:
        """Where a draining worker's KV copies go (worker/server/kv_receiver.py)."""
        return self.service

    async def healthz(self, _request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(self, _request: Request) -> Response:
        ready = self.registered and not self.draining.is_set()
        return PlainTextResponse("ready" if ready else "not ready", status_code=200 if ready else 503)

    async def metrics(self, _request: Request) -> Response:
        stats = await asyncio.to_thread(self.engine.stats)
        assert self.service is not None
        return PlainTextResponse(self.service.metrics.render(stats), media_type="text/plain; version=0.0.4")

    async def stats(self, _request: Request) -> Response:
        stats = await asyncio.to_thread(self.engine.stats)
        body = {"worker_id": self.worker_id, "url": self.url, **dataclasses.asdict(stats)}
        return JSONResponse(json.loads(json.dumps(body)))


def create_worker_app(runtime: WorkerRuntime) -> Starlette:
    return Starlette(
        routes=[
            WebSocketRoute(LINK_PATH, LinkAcceptor(runtime).accept),
            WebSocketRoute(KV_COPY_PATH, KVCopyAcceptor(runtime).accept),
            Route("/healthz", runtime.healthz),
            Route("/readyz", runtime.readyz),
            Route("/metrics", runtime.metrics),
            Route("/v1/stats", runtime.stats),
        ],
        lifespan=runtime.lifespan,
    )
