"""The client's retry bookkeeping (Sans-I/O): which refusals are resent, how often, how long it waits."""

from __future__ import annotations

import pytest

from shared.client.clients import TurnWaiter
from shared.client.retry import NO_RETRY, ChunkRetries, RetryPolicy
from shared.errors import ErrorCode, RateLimited
from shared.protocol.messages import Error, InputChunk, OutputDone, Timing

CHUNK = InputChunk(3, text="hi")


def refusal(ms: int | None = 200, *, seq: int = 3, fatal: bool = False) -> Error:
    return Error(ErrorCode.RATE_LIMITED, "slow down", fatal, seq, ms)


def test_bounded_resends_then_the_error_raises() -> None:
    retries = ChunkRetries(RetryPolicy(attempts=2, max_wait_s=0.1))
    retries.sent(CHUNK)
    for _ in range(2):
        waiter = TurnWaiter(3, retries)
        assert waiter.feed(refusal()).value == "done"
        assert waiter.retry_in == pytest.approx(0.1)  # capped by max_wait_s
        assert retries.resend(3) == CHUNK
    with pytest.raises(RateLimited):
        TurnWaiter(3, retries).feed(refusal())
    assert retries.delay_for(refusal()) is None  # forgotten once it raised


def test_only_recoverable_refusals_with_a_hint_are_retried() -> None:
    retries = ChunkRetries(RetryPolicy())
    retries.sent(CHUNK)
    assert retries.delay_for(refusal(None)) is None
    assert retries.delay_for(refusal(fatal=True)) is None
    assert retries.delay_for(refusal(seq=4)) is None  # not a chunk this client sent
    assert retries.delay_for(refusal(50)) == pytest.approx(0.05)


def test_no_retry_and_answered_chunks_are_not_resent() -> None:
    off = ChunkRetries(NO_RETRY)
    off.sent(CHUNK)
    with pytest.raises(RateLimited):
        TurnWaiter(3, off).feed(refusal())
    on = ChunkRetries(RetryPolicy())
    on.sent(CHUNK)
    done = OutputDone(3, (), "", "length", Timing(0.0, 0.0), committed_tokens=1)
    assert TurnWaiter(3, on).feed(done).value == "done"
    assert on.delay_for(refusal()) is None
    with pytest.raises(ValueError):
        RetryPolicy(attempts=-1)
