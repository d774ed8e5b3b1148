"""Dead workers are not chosen (issue 9, item 2): placement honours suspects, on a real server.

A gateway that loses its link to a worker excludes it itself at once and sets a short-lived suspect
key that every gateway's placement (shared/store/lua/place.lua) honours; a worker that registers afresh
clears it. The end-to-end effect (a restore lands elsewhere on the first try) is in
test_fault_worker.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from gateway.links import LinkPool
from gateway.metric_families import Metric
from gateway.metrics import GatewayMetrics
from shared.errors import CapacityExhausted
from shared.store.placement import mark_suspect, place_session
from shared.store.registry import WorkerInfo, register_worker
from shared.store.schema import KeySchema
from tests.conftest import open_servers
from tests.shared.redis_servers import SERVER_KINDS

TTL_S = 30.0


@pytest.fixture(scope="module", params=SERVER_KINDS)
def server_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with open_servers(tmp_path_factory) as servers:
        yield servers.redis(request.param)


def test_suspect_workers_are_skipped_until_they_register_again(server_url: str) -> None:
    schema = KeySchema(f"t{uuid.uuid4().hex[:10]}")

    async def body() -> None:
        redis = Redis.from_url(server_url)
        try:
            for wid in ("a", "b"):
                await register_worker(redis, schema, WorkerInfo(wid, f"ws://{wid}:1", "tiny", 100), TTL_S)
            # Equal load: the first pick is "a".
            assert (await place_session(redis, schema)).worker_id == "a"
            await mark_suspect(redis, schema, "a")  # another gateway lost its link to "a"
            picks = {(await place_session(redis, schema)).worker_id for _ in range(4)}
            assert picks == {"b"}
            # This gateway's own suspicion excludes "b" too: nobody is left.
            with pytest.raises(CapacityExhausted):
                await place_session(redis, schema, exclude=["b"])
            # "a" restarted: a fresh registration clears the suspicion.
            await register_worker(redis, schema, WorkerInfo("a", "ws://a:1", "tiny", 100), TTL_S)
            assert (await place_session(redis, schema, exclude=["b"])).worker_id == "a"
        finally:
            await redis.aclose()

    asyncio.run(body())


def test_a_broken_link_makes_its_worker_suspect_here_and_tells_the_others() -> None:
    async def body() -> None:
        pool = LinkPool(GatewayMetrics())
        told: list[str] = []
        pool.on_suspect = told.append
        link = pool.link("ws://127.0.0.1:9", "w9")
        pool.link_lost(link)
        pool.link_lost(link)  # one notice per suspicion, not per lost link
        assert pool.suspects() == ["w9"] and told == ["w9"]
        assert pool.metrics.value(Metric.WORKERS_SUSPECTED) == 1
        pool.trust("w9")  # a link to it opened again
        assert pool.suspects() == []
        await pool.close()

    asyncio.run(body())
