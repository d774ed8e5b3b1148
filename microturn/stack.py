"""`microturn up`: the whole stack on one machine, as separate processes under one supervisor.

Why separate processes and not one process with three event loops: this is the topology of a real
deployment (docs/design.md section 1) shrunk onto one host, so what a developer runs locally behaves like
production: the gateway reaches the worker over its real link, placement goes through a real
Redis-protocol server, and a crash in one piece is visible as exactly that.

What the supervisor guarantees:

- Start order Valkey (unless a Redis URL is given) -> worker -> gateway, each waited for (PING,
  then `/readyz`) before the next starts, so the gateway never places a session on nothing.
- Every child runs in its own process group. A terminal's Ctrl-C reaches only this supervisor,
  which then stops the children in reverse order (gateway, worker, Valkey last): the worker drains
  and deregisters while Redis is still there, instead of every process dying at once. On Linux the
  children also get SIGTERM if the supervisor itself dies (PR_SET_PDEATHSIG), so even a SIGKILL of
  `up` leaves no orphan behind.
- Stopping is SIGTERM, a bounded wait, then SIGKILL. If any child dies on its own, the rest are
  stopped the same way and `up` exits non-zero.
- Auth: on loopback (the default host) the gateway runs with `--auth off`, so the demo page works
  with no key; on any other host it stays on unless `--auth off` is asked for (the gateway then
  logs a loud warning).
"""

from __future__ import annotations

import functools
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Final

from microturn.processes import (
    Child,
    StackError,
    free_port,
    http_ready,
    redis_answers,
    spawn,
    valkey_binary,
)
from shared.settings import UpSettings, copy_fields, is_loopback_host, parse_settings
from shared.store.connection import redacted_url

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.1
_PORT_ATTEMPTS: Final = 3
_VALKEY_START_TIMEOUT_S: Final = 10.0
# The worker drains (every session is told why it ends) within its own drain timeout (10 s by default)
# before it exits: give it room for that plus the engine's shutdown.
_WORKER_STOP_TIMEOUT_S: Final = 30.0
_GATEWAY_STOP_TIMEOUT_S: Final = 15.0
_VALKEY_STOP_TIMEOUT_S: Final = 10.0


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived while the stack was starting."""


@dataclass(frozen=True)
class StackOptions(UpSettings):
    """`microturn up`'s settings plus what benchmarks add when they run a stack of their own."""

    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    # Where the children's stdout and stderr go; None shares this process's (the `up` default).
    log_path: Path | None = None


def resolve_device(device: str | None) -> str:
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- the stack ----------------------------------------------------------------------------------


class Stack:
    """Starts, watches and stops the children. `request_stop` is safe to call from a signal handler."""

    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.children: list[Child] = []
        self.redis_url = options.redis_url or ""
        self._stop = threading.Event()
        self.stop_signal: int | None = None
        self._output: IO[bytes] | None = None

    def _spawn(self, name: str, argv: Sequence[str], stop_timeout_s: float) -> Child:
        if self._output is None and self.options.log_path is not None:
            self._output = self.options.log_path.open("ab")
        child = spawn(name, argv, stop_timeout_s, self._output)
        self.children.append(child)
        return child

    def request_stop(self, signum: int) -> None:
        self.stop_signal = signum
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _sleep(self) -> None:
        if self._stop.wait(_POLL_S):
            raise StopRequested

    def _check_alive(self) -> None:
        for child in self.children:
            if not child.alive:
                raise StackError(f"{child.name} exited with status {child.proc.returncode}")

    def _wait_until(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            self._check_alive()
            if time.monotonic() > deadline:
                raise StackError(f"{what} not ready after {timeout_s:.0f} s")
            self._sleep()

    # -- the pieces --

    def start_valkey(self) -> str:
        binary = valkey_binary()
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            port = free_port()
            data_dir = tempfile.mkdtemp(prefix="microturn-valkey-")
            argv = [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes"]
            argv += ["--save", "", "--appendonly", "no", "--dir", data_dir, "--loglevel", "warning"]
            child = self._spawn("valkey", argv, _VALKEY_STOP_TIMEOUT_S)
            child.cleanup.append(functools.partial(shutil.rmtree, data_dir, ignore_errors=True))
            deadline = time.monotonic() + _VALKEY_START_TIMEOUT_S
            while child.alive and time.monotonic() < deadline and not redis_answers("127.0.0.1", port):
                self._sleep()
            if child.alive and redis_answers("127.0.0.1", port):
                logger.info("embedded valkey on 127.0.0.1:%d", port)
                return f"redis://127.0.0.1:{port}/0"
            # Most likely the port was taken between probing and binding: try another one.
            logger.warning("valkey did not come up on port %d (attempt %d)", port, attempt)
            self.children.remove(child)
            child.stop()
        raise StackError(f"valkey did not start after {_PORT_ATTEMPTS} attempts")

    def start_worker(self, device: str) -> None:
        options = self.options
        port = options.worker_port
        argv = [
            sys.executable,
            "-m",
            "microturn",
            "worker",
            "--model",
            options.model,
            "--device",
            device,
        ]
        argv += ["--host", "127.0.0.1", "--port", str(port), *self.redis_args]
        argv += ["--advertise-url", f"ws://127.0.0.1:{port}"]
        if options.kv_tokens:
            argv += ["--kv-tokens", str(options.kv_tokens)]
        argv += ["--cpu-single-thread-max-tokens", str(options.cpu_single_thread_max_tokens)]
        argv += options.worker_args
        self._spawn("worker", argv, _WORKER_STOP_TIMEOUT_S)
        logger.info("loading %s on %s (ready once the weights are loaded)", options.model, device)
        ready_url = f"http://127.0.0.1:{port}/readyz"
        self._wait_until("worker", lambda: http_ready(ready_url), options.ready_timeout_s)
        logger.info("worker ready on 127.0.0.1:%d", port)

    def start_gateway(self) -> None:
        options = self.options
        argv = [sys.executable, "-m", "microturn", "gateway", "--host", options.host]
        argv += ["--port", str(options.port), *self.redis_args, "--auth", self.auth]
        if options.tls_cert_file:
            argv += ["--tls-cert-file", options.tls_cert_file, "--tls-key-file", options.tls_key_file]
        argv += options.gateway_args
        self._spawn("gateway", argv, _GATEWAY_STOP_TIMEOUT_S)
        url = f"{self.local_url}/readyz"
        self._wait_until("gateway", lambda: http_ready(url), options.ready_timeout_s)
        logger.info("gateway ready on %s:%d", options.host, options.port)

    @property
    def redis_args(self) -> list[str]:
        """The flags naming the stack's Redis, for every child (an embedded Valkey is standalone)."""
        mode = self.options.redis_mode if self.options.redis_url else "standalone"
        return ["--redis-url", self.redis_url, "--redis-mode", mode]

    @property
    def auth(self) -> str:
        """The gateway's auth mode: what was asked, else off only where nothing else can connect."""
        if self.options.auth is not None:
            return self.options.auth
        return "off" if is_loopback_host(self.options.host) else "on"

    @property
    def local_url(self) -> str:
        """Where a browser on this machine opens the demo page."""
        host = self.options.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        scheme = "https" if self.options.tls_cert_file else "http"
        return f"{scheme}://{host}:{self.options.port}"

    # -- lifecycle --

    def start(self) -> None:
        """Everything, in order; raises `StackError` or `StopRequested` (the caller then calls `stop`)."""
        if self.redis_url:
            logger.info("using Redis at %s", redacted_url(self.redis_url))
        else:
            self.redis_url = self.start_valkey()
        device = resolve_device(self.options.device)
        self._check_alive()
        self.start_worker(device)
        self.start_gateway()

    def supervise(self) -> None:
        """Block until a stop is requested (returns) or a child dies (raises `StackError`)."""
        while not self.stopping:
            self._check_alive()
            self._stop.wait(0.25)

    def stop(self) -> bool:
        """Stop every child, the last started first (Valkey last). True if all stopped cleanly."""
        clean = True
        for child in reversed(self.children):
            was_alive = child.alive
            status = child.stop()
            if was_alive and status not in (0, -signal.SIGTERM):
                logger.warning("%s exited with status %d while stopping", child.name, status)
                clean = False
        self.children.clear()
        if self._output is not None:
            self._output.close()
            self._output = None
        return clean


def run(options: StackOptions, announce: Callable[[str], None] | None = None) -> int:
    """Start the stack, call `announce(url)` once it serves, run until a signal or a crash.

    Exit status: 0 after SIGINT/SIGTERM and a clean stop; 1 if a child failed or died.
    """
    stack = Stack(options)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stack.stopping:
            logger.warning("second signal: still stopping; children that hang are killed after their timeout")
            return
        logger.info("%s received: stopping", signal.Signals(signum).name)
        stack.request_stop(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed = False
    try:
        try:
            stack.start()
            if announce is not None:
                announce(stack.local_url + "/")
            stack.supervise()
        except StopRequested:
            pass
        except StackError as exc:
            logger.error("%s: stopping the stack", exc)
            failed = True
    finally:
        clean = stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not clean:
        logger.warning("some processes did not stop cleanly")
    logger.info("stopped")
    return 1 if failed else 0


def main(argv: Sequence[str], announce: Callable[[str], None] | None = None) -> int:
    settings = parse_settings(
        UpSettings,
        argv,
        "microturn up",
        description="Run the whole stack on this machine: embedded Valkey, one worker, one gateway.",
    )
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(copy_fields(StackOptions, settings), announce)
