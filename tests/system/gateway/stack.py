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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.processes import Proc, http_get, start, stop

__all__ = ["Proc", "Stack", "http_get", "running_stack", "start", "stop"]

logger = logging.getLogger(__name__)

# The suites that do not test auth run their gateways without it; a later `--auth on` in a test's
# own flags wins (argparse keeps the last value).
AUTH_OFF = ["--auth", "off"]


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

    def launch_gateway(self, name: str) -> Proc:
        """A gateway of the stack's, ready; the caller keeps it in `gateways`."""
        return start(name, "gateway", [*self.common(), *AUTH_OFF, *self.gateway_flags], self.log_dir)

    def start_gateway(self, index: int | None = None) -> Proc:
        proc = self.launch_gateway(f"gateway-{len(self.gateways) if index is None else index}")
        if index is None:
            self.gateways.append(proc)
        else:
            self.gateways[index] = proc
        return proc

    def start_extra_gateway(
        self, name: str, flags: list[str], prefix: str | None = None, *, tls: bool = False
    ) -> Proc:
        """A gateway with its own flags (e.g. tight limits; `tls`: they give it a certificate),
        stopped with the stack."""
        common = ["--redis-url", self.redis_url, "--key-prefix", prefix or self.prefix, *AUTH_OFF]
        proc = start(name, "gateway", [*common, *flags], self.log_dir, tls=tls)
        self.extra.append(proc)
        return proc

    def realtime_url(self, proc: Proc | int) -> str:
        gateway = self.gateways[proc] if isinstance(proc, int) else proc
        return f"ws://127.0.0.1:{gateway.port}/v1/realtime"

    def worker_ids(self) -> list[str]:
        return sorted(self.workers)

    def close(self) -> None:
        """The gateways, then the workers, each group stopped at once: a stop is mostly a process's
        own drain and interpreter teardown (about a second for a worker), so a group takes the time
        of its slowest member, not the sum. Gateways go first, so no worker's drain hands a session
        to a gateway that is about to stop."""
        for group in ([*self.extra, *self.gateways], list(self.workers.values())):
            with ThreadPoolExecutor(max_workers=max(len(group), 1)) as pool:
                for proc, stopping in [(proc, pool.submit(stop, proc)) for proc in group]:
                    if (exc := stopping.exception()) is not None:
                        logger.error("stopping %s failed", proc.name, exc_info=exc)


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
        # Every process boots at once, each waited for on its own /readyz: a boot is mostly one
        # core's worth of imports (and a model's load), so the stack is up in about the time of its
        # slowest process, not the sum of all of them.
        with ThreadPoolExecutor(max_workers=max(workers + gateways, 1)) as pool:
            booting = [pool.submit(stack.start_worker, f"w{i}") for i in range(workers)]
            gateway_boots = [pool.submit(stack.launch_gateway, f"gateway-{i}") for i in range(gateways)]
            failures = [exc for boot in [*booting, *gateway_boots] if (exc := boot.exception()) is not None]
        # In index order; those that came up are kept even when another failed, so `close` stops them.
        stack.gateways += [boot.result() for boot in gateway_boots if boot.exception() is None]
        if failures:
            raise failures[0]
        yield stack
    finally:
        stack.close()
