"""`microturn worker`: load the model, serve the link, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import NoReturn

import uvicorn

from shared.listener import ListenRefused, bind_listener
from shared.settings import EXIT_REFUSED, SHUTDOWN_GRACE_S, WorkerSettings
from worker.engine import START_REFUSALS, Engine, EngineConfig
from worker.server.app import WorkerRuntime, create_worker_app

logger = logging.getLogger(__name__)

# What a clean stop may take after the connections are cut: the lifespan's shutdown (a last token
# log flush, deregistering) and joining the engine thread after its current step.
STOP_AFTER_GRACE_S = 10.0
# A worker still alive this long after its drain's deadline (a stuck thread, a hung close) prints
# every thread's stack to its log and exits 1: a deploy never waits on it forever, and the log
# says where it stuck. With the default 10 s drain that is 25 s after SIGTERM, inside compose's
# 30 s stop_grace_period; a longer --drain-timeout-s needs a longer grace period there too.
EXIT_WATCHDOG_S = SHUTDOWN_GRACE_S + STOP_AFTER_GRACE_S


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
        faulthandler.dump_traceback_later(self._timeout_s + EXIT_WATCHDOG_S, exit=True)
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


def serve(settings: WorkerSettings) -> int:
    """Load the engine and serve until stopped (`microturn worker` parses the settings first, to
    choose the OpenMP spin before this module's imports load torch: worker/openmp.py)."""
    try:
        listener = bind_listener(settings.host, settings.port)
    except ListenRefused as refused:
        logger.error("the worker does not start: %s", refused)
        return EXIT_REFUSED
    try:
        engine = Engine.from_config(EngineConfig.from_settings(settings))
    except START_REFUSALS as refused:
        # Said once, with no traceback; the traceback stays at debug level, for a refusal that is a bug.
        logger.error("the worker does not start: %s", refused)
        logger.debug("the refusal's traceback", exc_info=True)
        listener.close()
        return EXIT_REFUSED
    # Structured output's compiler, built before the worker serves: built beside the first sessions,
    # its imports held the GIL for ~0.7 s and their first chunks waited 100-300 ms (docs/benchmarks.md,
    # "A fresh worker's first second").
    prepared = engine.grammars.prepare()
    if prepared is not None and (failed := prepared.exception()) is not None:
        logger.warning("the grammar compiler not built at start (%s): the first grammar builds it", failed)
    runtime = WorkerRuntime(settings, engine)
    config = uvicorn.Config(
        create_worker_app(runtime),
        host=settings.host,
        port=settings.port,
        log_level="info",
        lifespan="on",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    try:
        DrainingServer(config, runtime.drain, settings.drain_timeout_s).run(sockets=[listener])
    finally:
        engine.shutdown()
    exit_stopped()


def exit_stopped() -> NoReturn:
    """Exit 0 now that the worker has stopped cleanly: its sessions drained, the server closed, the
    engine's thread joined. What the interpreter's own teardown would do next (unload torch's modules
    one by one, join the grammar thread) releases nothing the OS does not, and costs about a second
    (a tiny worker's stop: 0.8-1.0 s, against 0.2-0.25 s with this; 0.7 s less CPU) that whoever
    waits on the exit (`microturn up`, a rolling restart, Kubernetes' grace period) waits for. Only
    the log handlers and the standard streams are flushed first. A failed drain never gets here:
    uvicorn re-raises the signal as it returns (DrainingServer), so its status still shows it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
