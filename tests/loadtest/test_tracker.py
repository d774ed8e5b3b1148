"""The load user's in-flight bookkeeping: each chunk resolves exactly once."""

from __future__ import annotations

import pytest

from loadtest.capacity.tracker import MAX_ATTEMPTS, TIMEOUT_CODE, InFlight, Outcome


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


def test_a_refused_chunk_is_resent_under_a_new_seq_until_its_attempts_run_out() -> None:
    inflight = InFlight()
    inflight.sent(4, "reply", at=1.0)
    inflight.sent(5, "chunk", at=1.1)
    assert inflight.can_retry(4) and inflight.retry(4, 6)
    assert not inflight.retry(4, 7)  # no longer in flight under 4
    assert not inflight.retry(5, 6)  # 6 is taken
    # One request: its name and its first send time carry over to the seq it was resent under.
    assert inflight.done(6, at=1.5) == Outcome("reply", 6, pytest.approx(500.0), None, 0)
    seq = 5
    for new_seq in range(7, 7 + MAX_ATTEMPTS - 1):
        assert inflight.retry(seq, new_seq)
        seq = new_seq
    assert not inflight.can_retry(seq) and not inflight.retry(seq, 100)
    assert inflight.failed(seq, "backpressure", at=2.1) == Outcome(
        "chunk", seq, pytest.approx(1000.0), "backpressure"
    )
