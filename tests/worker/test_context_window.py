"""`truncate` with a retention ratio: the per-turn rule (docs/protocol.md), held against the engine
fed each window whole, across several cuts, with the prefix's KV kept across each cut."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from shared.protocol.messages import OpenConfig
from shared.store.log_format import Cut
from tests.worker.smollm2 import engine_on
from worker.engine import Engine
from worker.engine.memory.window import cut_before, opening_history
from worker.model.loader import LoadedModel

LIMIT, KEEP, RATIO = 160, 8, 0.6


def _rule(history: list[int], grows_by: int) -> list[int]:
    """The rule as docs/protocol.md states it, written apart from the engine's."""
    if len(history) + grows_by <= LIMIT:
        return history
    recent = math.floor(RATIO * LIMIT) - KEEP - grows_by
    return history[:KEEP] + (history[len(history) - recent :] if recent > 0 else [])


def test_the_rule_cuts_below_the_limit_and_keeps_the_prefix() -> None:
    config = OpenConfig(
        max_context_tokens=100, context_policy="truncate", keep_prefix_tokens=4, retention_ratio=0.8
    )
    assert cut_before(90, 10, config, 100) is None
    assert cut_before(95, 10, config, 100) == Cut(4, 80 - 4 - 10)
    assert cut_before(95, 90, config, 100) == Cut(4, 0)  # nothing recent fits
    assert cut_before(95, 10, OpenConfig(max_context_tokens=100), 100) is None  # `error` never cuts
    assert Cut(2, 3).apply(list(range(10))) == [0, 1, 7, 8, 9]
    assert Cut(2, 0).apply(list(range(10))) == [0, 1]
    ratio_one = OpenConfig(context_policy="truncate", keep_prefix_tokens=4, retention_ratio=1.0)
    assert opening_history(list(range(120)), ratio_one, 100) == [0, 1, 2, 3, *range(24, 120)]


@pytest.fixture(scope="module")
def smollm2(smollm2_model: LoadedModel) -> Iterator[Engine]:
    with engine_on(smollm2_model, kv_tokens=4096, host_kv_tokens=0) as engine:
        yield engine


@pytest.mark.slow
def test_every_turn_answers_as_its_window_sent_whole_across_several_cuts(smollm2: Engine) -> None:
    options = {
        "stop_token_ids": (),
        "max_context_tokens": LIMIT,
        "context_policy": "truncate",
        "keep_prefix_tokens": KEEP,
        "retention_ratio": RATIO,
    }
    sid = smollm2.open_session(**options)
    history: list[int] = []
    cuts = 0
    for turn in range(21):  # the window is cut before turns 10, 15 and 20
        chunk = [(97 * turn + 13 * j) % 5000 + 100 for j in range(12)]
        window = _rule(history, len(chunk) + 4)
        before = smollm2.stats().tokens_forwarded
        result = smollm2.run_turn(sid, tokens=chunk, max_output_tokens=4, timeout=120)
        if window is not history:
            cuts += 1
            assert result.cut == Cut(KEEP, len(window) - KEEP)
            # The prefix's KV was kept: only the recent tokens, the chunk and 3 decodes were fed.
            assert smollm2.stats().tokens_forwarded - before == len(window) - KEEP + len(chunk) + 3
            whole = smollm2.open_session(stop_token_ids=(), history=window)
            assert (
                smollm2.run_turn(whole, tokens=chunk, max_output_tokens=4, timeout=120).tokens
                == result.tokens
            )
            smollm2.close_session(whole)
        else:
            assert result.cut is None
        history = window + chunk + list(result.tokens)
        assert result.length == len(history) <= LIMIT
    assert cuts >= 3


@pytest.fixture
def tiny() -> Iterator[Engine]:
    with Engine.load("tiny", kv_tokens=4096, max_pending_tokens=4096, max_pending_outputs=16) as engine:
        yield engine


def test_queued_chunks_cut_where_chunks_sent_one_by_one_cut(tiny: Engine) -> None:
    """A fold of queued no-output chunks never spans a cut: the window is the same either way."""
    options = {
        "stop_token_ids": (),
        "max_context_tokens": 96,
        "context_policy": "truncate",
        "keep_prefix_tokens": 4,
        "retention_ratio": 0.5,
    }
    chunks = [[(5 * i + j) % 200 + 1 for j in range(10)] for i in range(24)]

    def run(queued: bool) -> list[tuple[Cut | None, tuple[int, ...]]]:
        sid = tiny.open_session(**options)
        outputs = [(i % 4 == 3) * 2 for i in range(len(chunks))]
        if queued:
            futures = [
                tiny.submit(sid, tokens=c, max_output_tokens=o) for c, o in zip(chunks, outputs, strict=True)
            ]
            results = [f.result(timeout=60) for f in futures]
        else:
            results = [
                tiny.run_turn(sid, tokens=c, max_output_tokens=o, timeout=60)
                for c, o in zip(chunks, outputs, strict=True)
            ]
        return [(r.cut, r.tokens) for r in results]

    one_by_one = run(False)
    assert sum(cut is not None for cut, _ in one_by_one) >= 2
    assert run(True) == one_by_one


def test_a_prefix_given_as_text_is_counted_in_tokens_and_kept(tiny: Engine) -> None:
    from shared.errors import InvalidMessage
    from shared.protocol.codec import config_from_map
    from worker.engine.memory.window import resolve_prefix

    config = config_from_map({"context_policy": "truncate", "keep_prefix_text": "be brief"})
    resolved, tokens = resolve_prefix(config, tiny.text)
    assert tokens and resolved.keep_prefix_tokens == len(tokens) and resolved.keep_prefix_text is None
    assert resolve_prefix(OpenConfig(), tiny.text) == (OpenConfig(), [])
    with pytest.raises(InvalidMessage, match="not both"):
        config_from_map({"keep_prefix_text": "x", "keep_prefix_tokens": 3})
