"""The `no_session` baseline: same conversation as streaming, but every turn recomputes the history."""

from __future__ import annotations

from shared.settings import WorkerSettings, parse_settings
from worker.engine import Engine

TURNS = [([101 + i, 150 + i, 200 + i], 2 if i % 2 else 0) for i in range(6)]


def _converse(engine: Engine) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
    """Outputs per turn, pages held after each turn, tokens forwarded by each turn."""
    sid = engine.open_session(max_output_tokens=0, stop_token_ids=())
    outputs, pages, forwarded = [], [], []
    for tokens, k in TURNS:
        before = engine.stats().tokens_forwarded
        outputs.append(engine.run_turn(sid, tokens=tokens, max_output_tokens=k).tokens)
        stats = engine.stats()
        pages.append(stats.pages_used)
        forwarded.append(stats.tokens_forwarded - before)
    engine.close_session(sid)
    return outputs, pages, forwarded


def test_no_session_recomputes_history_and_answers_the_same() -> None:
    with (
        Engine.load("tiny", kv_tokens=4096) as streaming,
        Engine.load("tiny", kv_tokens=4096, no_session=True) as baseline,
    ):
        s_out, s_pages, s_fwd = _converse(streaming)
        b_out, b_pages, b_fwd = _converse(baseline)
    assert b_out == s_out  # exact recompute of the same history: greedy outputs match
    assert all(p > 0 for p in s_pages) and b_pages == [0] * len(TURNS)  # no KV kept between turns
    # Streaming forwards each turn's own tokens; the baseline forwards the whole history again.
    length = 0
    for (tokens, k), s, b in zip(TURNS, s_fwd, b_fwd, strict=True):
        assert s <= len(tokens) + k + 1
        assert b >= length + len(tokens)
        length += len(tokens) + k
    assert sum(b_fwd) > 2 * sum(s_fwd)


def test_the_worker_flag_turns_it_on() -> None:
    # `--no-session` must not be read as the negation of a `--session` flag (BooleanOptionalAction).
    assert parse_settings(WorkerSettings, ["--no-session"], "microturn worker").no_session is True
    assert parse_settings(WorkerSettings, [], "microturn worker").no_session is False
