"""The session's one queue rule (shared/backpressure.py), as the gateway and the engine both apply it."""

from __future__ import annotations

import pytest

from shared.backpressure import DEFAULT_TURN_MS, MIN_RETRY_AFTER_MS, check_queue, retry_after_ms
from shared.errors import Backpressure


def test_nothing_ahead_is_always_admitted() -> None:
    check_queue(0, 0, tokens=1000, outputs=5, tokens_limit=1, outputs_limit=1)


def test_the_queue_is_bounded_by_tokens_and_by_turns_asking_for_output() -> None:
    check_queue(6, 0, tokens=2, outputs=1, tokens_limit=8, outputs_limit=1)
    with pytest.raises(Backpressure):
        check_queue(6, 0, tokens=3, outputs=0, tokens_limit=8, outputs_limit=1)
    with pytest.raises(Backpressure):
        check_queue(1, 1, tokens=1, outputs=1, tokens_limit=8, outputs_limit=1)
    check_queue(1, 1, tokens=1, outputs=0, tokens_limit=8, outputs_limit=1)  # no output asked: welcome


def test_one_retry_hint_rule() -> None:
    with pytest.raises(Backpressure) as refused:
        check_queue(8, 0, tokens=1, outputs=0, tokens_limit=8, outputs_limit=1)
    assert refused.value.retry_after_ms == retry_after_ms() == DEFAULT_TURN_MS
    with pytest.raises(Backpressure) as measured:
        check_queue(8, 0, tokens=1, outputs=0, tokens_limit=8, outputs_limit=1, turn_ms=399.2)
    assert measured.value.retry_after_ms == 400
    assert retry_after_ms(0.0) == MIN_RETRY_AFTER_MS
