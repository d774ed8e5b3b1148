"""The gateway's placement against a real Redis: waiting out a registry that Redis lost.

After Redis restarts empty no worker is registered until its next heartbeat; an open meanwhile
waits for one rather than failing. The race the CI once hit: the registry fills between a failed
placement and the gateway's look at the registry, and the open must still land.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from redis.asyncio import Redis

from gateway import session_store
from shared.errors import CapacityExhausted
from shared.store.placement import Placement, place_session
from shared.store.registry import WorkerInfo, register_worker
from shared.store.schema import KeySchema
from tests.conftest import Servers

TTL_S = 60.0


@pytest.fixture(scope="module")
def redis_url(servers: Servers) -> str:
    return servers.redis("redis")


def worker_info(worker_id: str, *, sessions: int = 0) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        url=f"ws://{worker_id}.test:9000/v1/link",
        model="tiny",
        max_sessions=2,
        sessions=sessions,
        kv_tokens_free=1000,
        kv_tokens_total=4096,
        state="ready",
    )


def pick(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, before_first_refusal: WorkerInfo | None = None
) -> Placement:
    """`SessionStore._pick` on an empty registry; `before_first_refusal` registers just after the
    first placement found nothing, before the refusal reaches the store."""

    async def body() -> Placement:
        redis = Redis.from_url(redis_url)
        schema = KeySchema(f"t{uuid.uuid4().hex[:10]}")
        refused = 0

        async def placement(*args: Any, **kwargs: Any) -> Placement:
            nonlocal refused
            try:
                return await place_session(*args, **kwargs)
            except CapacityExhausted:
                refused += 1
                if refused == 1 and before_first_refusal is not None:
                    await register_worker(redis, schema, before_first_refusal, TTL_S)
                raise

        monkeypatch.setattr(session_store, "place_session", placement)
        store = session_store.SessionStore(redis, schema, grace_s=1.0, default_idle_timeout_s=60.0)
        try:
            return await store._pick()
        finally:
            await redis.aclose()

    return asyncio.run(body())


def test_an_open_lands_on_a_worker_that_registers_just_after_placement_found_none(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert pick(redis_url, monkeypatch, before_first_refusal=worker_info("w-late")).worker_id == "w-late"


def test_full_workers_are_refused_without_waiting(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CapacityExhausted):
        pick(redis_url, monkeypatch, before_first_refusal=worker_info("w-full", sessions=2))


def test_an_empty_registry_is_refused_once_the_wait_is_over(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_store, "EMPTY_REGISTRY_WAIT_S", 0.3)
    with pytest.raises(CapacityExhausted):
        pick(redis_url, monkeypatch)


def test_a_move_lands_on_its_target_while_it_is_ready_and_elsewhere_once_it_is_not(redis_url: str) -> None:
    """A drain's `migrate` names the worker holding the session's warm copy (docs/failover.md)."""
    from dataclasses import replace

    from shared.protocol.messages import OpenConfig
    from shared.store.registry import SessionRecord, mark_draining

    async def body() -> tuple[str, str]:
        redis = Redis.from_url(redis_url)
        schema = KeySchema(f"t{uuid.uuid4().hex[:10]}")
        for worker_id in ("w-busy", "w-warm"):
            await register_worker(
                redis, schema, replace(worker_info(worker_id), sessions=int(worker_id == "w-warm")), TTL_S
            )
        store = session_store.SessionStore(redis, schema, grace_s=1.0, default_idle_timeout_s=60.0)
        record = SessionRecord(worker="w-old", token_sha256="0" * 64, model="tiny", created_ms=0)
        try:
            to_target = await store.move("s", record, OpenConfig(), "w-warm")  # not the least loaded
            await mark_draining(redis, schema, "w-warm")
            elsewhere = await store.move("s", record, OpenConfig(), "w-warm")
            return to_target.record.worker, elsewhere.record.worker
        finally:
            await redis.aclose()

    assert asyncio.run(body()) == ("w-warm", "w-busy")
