"""`microturn worker`: load the model, serve the link, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from shared.settings import WorkerSettings, parse_settings
from worker.engine import Engine
from worker.server.app import WorkerRuntime, create_worker_app

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """The first SIGTERM/SIGINT drains (every session is told why it ends) before uvicorn stops.

    A second signal stops at once.
    """

    def __init__(
        self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]], timeout_s: float
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit(sig, frame)))

    async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        try:
            await asyncio.wait_for(self._drain(), self._timeout_s)
        except Exception:
            logger.exception("draining failed; stopping anyway")
            super().handle_exit(sig, frame)  # uvicorn re-raises the signal: the exit status shows it
            return
        # A completed drain is a clean stop: exit 0 rather than re-raise the signal.
        self.should_exit = True


def load_engine(settings: WorkerSettings) -> Engine:
    return Engine.load(
        settings.model,
        device=settings.device,
        dtype=settings.dtype,
        kv_tokens=settings.kv_tokens or None,
        page_size=settings.page_size,
        attention=settings.attention,
        kv_memory_fraction=settings.kv_memory_fraction,
        max_batch_tokens=settings.max_batch_tokens,
        max_sessions=settings.max_sessions,
        max_chunk_tokens=settings.max_chunk_tokens,
        max_queued_tokens=settings.max_queued_tokens,
        max_queued_outputs=settings.max_queued_outputs,
        max_output_tokens_limit=settings.max_output_tokens,
        no_session=settings.no_session,
    )


def main(argv: list[str]) -> int:
    settings = parse_settings(WorkerSettings, argv, "microturn worker")
    engine = load_engine(settings)
    runtime = WorkerRuntime(settings, engine)
    config = uvicorn.Config(
        create_worker_app(runtime), host=settings.host, port=settings.port, log_level="info", lifespan="on"
    )
    try:
        DrainingServer(config, runtime.drain, settings.drain_timeout_s).run()
    finally:
        engine.shutdown()
    return 0
