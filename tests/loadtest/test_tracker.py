"""The load user's in-flight bookkeeping: each chunk resolves exactly once."""

from __future__ import annotations

import pytest

from loadtest.capacity.tracker import TIMEOUT_CODE, InFlight, Outcome


def test_done_fail_and_expire_resolve_each_chunk_once() -> None:
    inflight = InFlight()
    inflight.sent(0, "chunk", at=1.0)
    inflight.sent(1, "reply", at=1.2)
    inflight.sent(2, "chunk", at=1.4)
    assert inflight.done(0, at=1.01, length=50) == Outcome("chunk", 0, pytest.approx(10.0), None, 50)
    assert inflight.done(0, at=1.5) is None  # a replayed output after a resume: already counted
    assert inflight.failed(1, "backpressure", at=1.25) == Outcome(
        "reply", 1, pytest.approx(50.0), "backpressure"
    )
    assert inflight.failed(7, "bad_sequence", at=2.0) is None
    assert inflight.expire(now=2.0, timeout_s=1.0) == []
    (late,) = inflight.expire(now=3.0, timeout_s=1.0)
    assert (late.seq, late.error) == (2, TIMEOUT_CODE)
    assert len(inflight) == 0
    with pytest.raises(ValueError):
        inflight.sent(3, "chunk", at=0.0)
        inflight.sent(3, "chunk", at=0.0)
