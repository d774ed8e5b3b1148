"""A socket's credential keeps its caller's time (gateway/auth/session_auth.py): the times here are made up.

The credential reads no clock: admission gets an `Instant` (both clocks, as the shell reads them),
the session's life the monotonic time of each event. So a session at the edge of its life, or a
budget spent just before midnight, is played by naming the moment, not by waiting for it. Admission
runs on a real Redis (the key's slot and its spend are Lua scripts there).
"""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from gateway.auth.api_keys import ApiKey, KeyStore
from gateway.auth.client_tokens import ClientTokenStore
from gateway.auth.key_ledger import KeyLedger
from gateway.auth.session_auth import WARN_LEAD_FRACTION, AuthDeps, Principal, SessionAuth
from gateway.session.guard import Expire, Instant
from shared.errors import RateLimited, SessionExpired
from shared.protocol.key_limits import AuthLimits, KeyLimits
from shared.protocol.messages import SessionExpiring
from shared.store.schema import KeySchema
from tests.conftest import Servers

CREATED_MS = 1_760_000_000_000  # a session's creation, wall clock, as its record holds it
NOON_S = datetime.datetime(2026, 3, 1, 12, tzinfo=datetime.UTC).timestamp()


@pytest.fixture(scope="module")
def redis_url(servers: Servers) -> str:
    return servers.redis()


def with_deps(redis_url: str, body: Callable[[AuthDeps, KeyStore], Awaitable[None]]) -> None:
    async def main() -> None:
        redis = Redis.from_url(redis_url, decode_responses=False)
        schema = KeySchema(f"t{uuid.uuid4().hex[:10]}")
        keys = KeyStore(redis, schema)
        deps = AuthDeps(schema, KeyLedger(redis, schema, keys), ClientTokenStore(redis, schema), 60.0)
        try:
            await asyncio.wait_for(body(deps, keys), 60)
        finally:
            await redis.aclose()

    asyncio.run(main())


async def new_key(keys: KeyStore, limits: KeyLimits) -> ApiKey:
    _, key = await keys.create(f"k{uuid.uuid4().hex[:8]}", limits)
    return key


def test_a_session_resumed_inside_its_warning_window_is_warned_at_once(redis_url: str) -> None:
    async def body(deps: AuthDeps, keys: KeyStore) -> None:
        key = await new_key(keys, KeyLimits(max_session_s=3.0))
        granted = AuthLimits(key_sha256=key.digest, max_session_s=3.0)
        auth = SessionAuth(Principal(key), deps)
        # 2.6 s after its creation: inside the last 20 % of its 3 s.
        at = Instant(monotonic_s=500.0, wall_s=CREATED_MS / 1000 + 2.6)
        await auth.admit_resume("s1", CREATED_MS, granted, at)
        verdict, deadline = auth.start(500.1)  # opened on its worker 100 ms later
        assert verdict is None and deadline is not None
        assert deadline.warn_in_s == 0.0  # at once
        assert deadline.warning == SessionExpiring("s1", "max_duration", expires_in_ms=300)
        assert deadline.expire_in_s == pytest.approx(0.3) and isinstance(deadline.expiry, Expire)
        await auth.release()
        # At its end (or past it), the resume is refused before anything is held.
        late = SessionAuth(Principal(key), deps)
        with pytest.raises(SessionExpired):
            await late.admit_resume("s1", CREATED_MS, granted, Instant(9.0, CREATED_MS / 1000 + 3.0))

    with_deps(redis_url, body)


def test_a_new_session_is_warned_a_fifth_of_its_life_ahead_of_its_end(redis_url: str) -> None:
    async def body(deps: AuthDeps, keys: KeyStore) -> None:
        key = await new_key(keys, KeyLimits(max_session_s=100.0))
        auth = SessionAuth(Principal(key), deps)
        await auth.admit_open("s2", Instant(monotonic_s=10.0, wall_s=NOON_S))
        verdict, deadline = auth.start(12.0)  # opened 2 s after its admission: 98 s left
        lead = WARN_LEAD_FRACTION * 100.0
        assert verdict is None and deadline is not None
        assert deadline.expire_in_s == pytest.approx(98.0)
        assert deadline.warn_in_s == pytest.approx(98.0 - lead)
        assert deadline.warning.expires_in_ms == int(lead * 1000)
        await auth.release()

    with_deps(redis_url, body)


def test_a_spent_daily_budget_refuses_chunks_until_the_utc_day_turns(redis_url: str) -> None:
    async def body(deps: AuthDeps, keys: KeyStore) -> None:
        key = await new_key(keys, KeyLimits(max_tokens_per_day=10))
        auth = SessionAuth(Principal(key), deps)
        await auth.admit_open("s3", Instant(monotonic_s=0.0, wall_s=NOON_S))
        auth.check_chunk(1.0)  # nothing spent yet
        assert auth.on_done(10) is None  # the key's budget, not the session's: no verdict
        with pytest.raises(RateLimited) as refused:
            auth.check_chunk(3600.0)  # 13:00 UTC
        assert refused.value.retry_after_ms == 11 * 3600 * 1000
        with pytest.raises(RateLimited) as refused:
            auth.check_chunk(13 * 3600.0)  # 01:00 UTC the next day, still spent as this gateway knows
        assert refused.value.retry_after_ms == 23 * 3600 * 1000
        await auth.release()

    with_deps(redis_url, body)
