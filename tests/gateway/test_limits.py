"""Admission limits: frame size, tokens per chunk, token bucket, in-flight cost; refusals charge nothing."""

from __future__ import annotations

import pytest

from gateway.limits import (
    ChunkCost,
    LimitValues,
    SessionLimits,
    TokenBucket,
    check_chunk_tokens,
    check_frame_size,
)
from shared.backpressure import DEFAULT_TURN_MS, MIN_RETRY_AFTER_MS
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


def test_a_batch_is_checked_whole_and_charged_whole() -> None:
    clock = Clock()
    rule = limits(clock, max_queued_tokens=20, max_queued_outputs=2, chunk_burst=3)
    rule.admit([ChunkCost(1, 5, False)])
    # Three more would pass the bucket's burst (one token left after two): refused, nothing charged.
    with pytest.raises(RateLimited):
        rule.admit([ChunkCost(2, 1, False), ChunkCost(3, 1, False), ChunkCost(4, 1, False)])
    with pytest.raises(Backpressure):  # 5 in flight + 16 > 20: the queue, before the rate
        rule.admit([ChunkCost(2, 8, False), ChunkCost(3, 8, True)])
    assert rule.in_flight == 1
    rule.admit([ChunkCost(2, 7, False), ChunkCost(3, 8, True)])  # exactly the rest of both
    assert rule.in_flight == 3
    with pytest.raises(ChunkTooLarge, match="burst"):
        rule.admit([ChunkCost(s, 1, False) for s in range(10, 14)])  # more than the burst, ever


def test_chunks_admitted_ahead_pass_the_machines_admission_uncharged() -> None:
    clock = Clock()
    rule = limits(clock, max_queued_tokens=20, chunk_burst=3)
    rule.admit([ChunkCost(1, 10, False), ChunkCost(2, 10, False)], ahead=True)  # a dialect's event
    # The machine admits each chunk as it comes: charged once already, so no second charge.
    rule.admit_chunk(1, tokens=None, text_chars=10, wants_output=False)
    rule.admit_chunk(2, tokens=None, text_chars=10, wants_output=False)
    assert rule.in_flight == 2
    with pytest.raises(Backpressure):  # a native chunk meets the same full queue
        rule.admit_chunk(3, tokens=None, text_chars=1, wants_output=False)
    rule.settle(1)
    rule.settle(2)
    rule.admit_chunk(3, tokens=None, text_chars=1, wants_output=False)  # one bucket token was left
    with pytest.raises(RateLimited):
        rule.admit_chunk(4, tokens=None, text_chars=1, wants_output=False)
