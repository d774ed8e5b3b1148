"""Admission limits: frame size, tokens per chunk, token bucket, in-flight cost; refusals charge nothing."""

from __future__ import annotations

import pytest

from gateway.limits import (
    DEFAULT_TURN_MS,
    MIN_RETRY_AFTER_MS,
    LimitValues,
    SessionLimits,
    TokenBucket,
    check_chunk_tokens,
    check_frame_size,
)
from shared.errors import Backpressure, ChunkTooLarge, RateLimited
from shared.settings import GatewaySettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limits(clock: Clock, **overrides: float) -> SessionLimits:
    values = {
        "max_frame_bytes": 1024,
        "max_chunk_tokens": 8,
        "max_chunks_per_s": 10.0,
        "chunk_burst": 3,
        "max_queued_tokens": 8,
        "max_queued_outputs": 1,
    }
    values.update(overrides)
    return SessionLimits(LimitValues(**values), clock)  # type: ignore[arg-type]


def test_frame_and_chunk_size_limits_are_inclusive() -> None:
    check_frame_size(1024, 1024)
    with pytest.raises(ChunkTooLarge, match="1025 bytes"):
        check_frame_size(1025, 1024)
    check_chunk_tokens(8, 8)
    with pytest.raises(ChunkTooLarge, match="9 tokens"):
        check_chunk_tokens(9, 8)


def test_bucket_bursts_then_refills_at_its_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=8.0, burst=3, clock=clock)  # binary-exact steps: no rounding noise
    assert [bucket.try_take() for _ in range(3)] == [None, None, None]
    assert bucket.try_take() == 125  # one token at 8/s is 125 ms away
    clock.now += 0.0625
    assert bucket.try_take() == 63  # half way there (rounded up); the refused attempt took nothing
    clock.now += 0.0625
    assert bucket.try_take() is None
    clock.now += 60  # idle time saves up to the burst only
    assert [bucket.try_take() for _ in range(4)] == [None, None, None, 125]


def test_bucket_never_advises_a_zero_wait() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=1e6, burst=1, clock=clock)
    assert bucket.try_take() is None
    assert bucket.try_take() == MIN_RETRY_AFTER_MS


def test_bucket_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate=0, burst=1)
    with pytest.raises(ValueError):
        TokenBucket(rate=1, burst=0)


def admit(
    session: SessionLimits, seq: int, tokens: int | None = 1, chars: int = 0, output: bool = False
) -> None:
    session.admit_chunk(seq, tokens=tokens, text_chars=chars, wants_output=output)


def test_admit_checks_size_then_queue_then_rate_and_refusals_cost_no_token() -> None:
    clock = Clock()
    session = limits(clock)
    with pytest.raises(ChunkTooLarge):
        admit(session, 1, tokens=9)
    admit(session, 1, tokens=6)
    with pytest.raises(Backpressure) as bp:
        admit(session, 2, tokens=3)  # 6 + 3 queued tokens exceed 8
    assert bp.value.retry_after_ms == DEFAULT_TURN_MS
    admit(session, 2, tokens=None, chars=2)  # a text chunk: its characters stand in for its tokens
    session.settle(1)
    session.settle(2)
    admit(session, 3, tokens=1)  # the burst of 3 is used only by admitted chunks
    with pytest.raises(RateLimited) as rl:
        admit(session, 4, tokens=1)
    assert rl.value.retry_after_ms == 100


def test_queue_is_bounded_by_cost_not_by_count() -> None:
    clock = Clock()
    session = limits(clock, chunk_burst=100, max_queued_tokens=40)
    for seq in range(20):  # a paste burst: twenty small pieces all go through
        admit(session, seq, tokens=None, chars=2)
    with pytest.raises(Backpressure):
        admit(session, 20, tokens=None, chars=1)
    for seq in range(20):
        session.settle(seq)
    admit(session, 21, tokens=2, output=True)
    with pytest.raises(Backpressure):
        admit(session, 22, tokens=1, output=True)  # one output-asking turn in flight at most
    admit(session, 22, tokens=1)  # a no-output chunk is still welcome
    session.settle(21)
    admit(session, 23, tokens=1, output=True)


def test_a_chunk_with_nothing_ahead_of_it_is_never_refused_for_the_queue() -> None:
    session = limits(Clock(), max_queued_tokens=1)
    admit(session, 1, tokens=8, output=True)


def test_backpressure_hint_follows_the_measured_turn_time() -> None:
    session = limits(Clock())
    for _ in range(50):
        session.observe_turn(400.0)
    admit(session, 1, tokens=1, output=True)
    with pytest.raises(Backpressure) as bp:
        admit(session, 2, tokens=1, output=True)
    assert bp.value.retry_after_ms is not None and 390 <= bp.value.retry_after_ms <= 400


def test_limit_values_come_from_settings_and_are_reported() -> None:
    settings = GatewaySettings(max_frame_bytes=2048, max_chunk_tokens=7, max_queued_outputs=3)
    values = LimitValues.from_settings(settings)
    assert values.as_map() == {
        "max_frame_bytes": 2048,
        "max_chunk_tokens": 7,
        "max_chunks_per_s": settings.max_chunks_per_s,
        "chunk_burst": settings.chunk_burst,
        "max_queued_tokens": settings.max_queued_tokens,
        "max_queued_outputs": 3,
    }
