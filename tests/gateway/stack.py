"""The whole system as real processes on loopback: Redis/Valkey, workers, gateways.

Why processes and not in-process apps: the properties under test (a gateway killed with SIGKILL
loses no session, two gateways share nothing but Redis, a worker link breaks for real) only exist
across process boundaries. Every process gets a free port, a log file, and is waited for on its
`/readyz`; `Stack.close` stops every one of them (SIGTERM, then SIGKILL), so nothing leaks even
when a test fails half way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from tests.shared.redis_servers import free_port

logger = logging.getLogger(__name__)

REPO: Final = Path(__file__).resolve().parents[2]
_READY_TIMEOUT_S: Final = 60.0
_STOP_TIMEOUT_S: Final = 10.0
_PORT_ATTEMPTS: Final = 3


@dataclass
class Proc:
    name: str
    port: int
    args: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Four servers and the tests share a couple of cores: one torch thread per worker avoids
    # oversubscription (and is how the engine runs best on a small CPU anyway).
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _wait_ready(proc: Proc, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            return False
        with contextlib.suppress(OSError):
            if http_get(proc.http + "/readyz", timeout=1.0)[0] == 200:
                return True
        time.sleep(0.1)
    return False


def stop(proc: Proc, sig: int = signal.SIGTERM) -> None:
    if proc.popen.poll() is None:
        proc.popen.send_signal(sig)
        try:
            proc.popen.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(timeout=_STOP_TIMEOUT_S)


def start(name: str, command: str, flags: list[str], log_dir: Path) -> Proc:
    """Start `python -m shared.cli <command> --host 127.0.0.1 --port <free> <flags>`, wait for /readyz."""
    for attempt in range(_PORT_ATTEMPTS):
        port = free_port()
        args = [sys.executable, "-m", "shared.cli", command, "--host", "127.0.0.1", "--port", str(port)]
        args += flags
        log_path = log_dir / f"{name}-{port}.log"
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=_env())
        proc = Proc(name, port, args, log_path, popen)
        try:
            if _wait_ready(proc, _READY_TIMEOUT_S):
                logger.info("%s up on port %d", name, port)
                return proc
        except BaseException:
            stop(proc, signal.SIGKILL)
            raise
        logger.warning("%s failed on port %d (attempt %d):\n%s", name, port, attempt + 1, proc.log_tail())
        stop(proc, signal.SIGKILL)
    raise RuntimeError(f"{name} did not become ready; logs in {log_dir}")


@dataclass
class Stack:
    """Two workers and two gateways (more on demand) around one Redis URL and key prefix."""

    redis_url: str
    prefix: str
    log_dir: Path
    worker_flags: list[str] = field(default_factory=list)
    gateway_flags: list[str] = field(default_factory=list)
    workers: dict[str, Proc] = field(default_factory=dict)
    gateways: list[Proc] = field(default_factory=list)
    extra: list[Proc] = field(default_factory=list)

    def common(self) -> list[str]:
        return ["--redis-url", self.redis_url, "--key-prefix", self.prefix]

    def start_worker(self, worker_id: str) -> Proc:
        flags = [*self.common(), "--model", "tiny", "--worker-id", worker_id, *self.worker_flags]
        proc = start(f"worker-{worker_id}", "worker", flags, self.log_dir)
        self.workers[worker_id] = proc
        return proc

    def start_gateway(self, index: int | None = None) -> Proc:
        name = f"gateway-{len(self.gateways) if index is None else index}"
        proc = start(name, "gateway", [*self.common(), *self.gateway_flags], self.log_dir)
        if index is None:
            self.gateways.append(proc)
        else:
            self.gateways[index] = proc
        return proc

    def start_extra_gateway(self, name: str, flags: list[str], prefix: str | None = None) -> Proc:
        """A gateway with its own flags (e.g. tight limits), stopped with the stack."""
        common = ["--redis-url", self.redis_url, "--key-prefix", prefix or self.prefix]
        proc = start(name, "gateway", [*common, *flags], self.log_dir)
        self.extra.append(proc)
        return proc

    def realtime_url(self, proc: Proc | int) -> str:
        gateway = self.gateways[proc] if isinstance(proc, int) else proc
        return f"ws://127.0.0.1:{gateway.port}/v1/realtime"

    def worker_ids(self) -> list[str]:
        return sorted(self.workers)

    def close(self) -> None:
        for proc in [*self.extra, *self.gateways, *self.workers.values()]:
            try:
                stop(proc)
            except Exception:
                logger.exception("stopping %s failed", proc.name)


@contextlib.contextmanager
def running_stack(
    redis_url: str,
    prefix: str,
    log_dir: Path,
    *,
    workers: int = 2,
    gateways: int = 2,
    worker_flags: list[str] | None = None,
    gateway_flags: list[str] | None = None,
) -> Iterator[Stack]:
    stack = Stack(redis_url, prefix, log_dir, worker_flags or [], gateway_flags or [])
    try:
        for i in range(workers):
            stack.start_worker(f"w{i}")
        for _ in range(gateways):
            stack.start_gateway()
        yield stack
    finally:
        stack.close()
