"""Restoring a session that streams text (worker/server/restore.py with the real tokenizer).

The property: a session rebuilt from a log cut at any durable point plus the gateway's tail (some
turns delivered, the rest re-run) equals the uninterrupted session, token for token: the same
committed inputs, the same outputs, the same held-back text. Text is cut mid-word, through digits,
multibyte characters and special tokens, so the tail at the durable point is usually not empty.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from shared.protocol.link import UndurableTurn
from shared.protocol.messages import InputChunk, OpenConfig
from shared.store.log_format import encode_log_record
from worker.engine import Engine, SessionRules, TurnResult
from worker.server.restore import plan_restore
from worker.tokenizer.incremental import EMPTY_TAIL

TEXT = (
    "<|im_start|>user\nThe quick brown fox jumps over 12345 lazy dogs; naïve café, 日本語 text.<|im_end|>\n"
    "<|im_start|>assistant\nSure: the fox (a vulpine) jumped 678 times.<|im_end|>\n"
)
OUT = 2
NO_WINDOW = 8192  # a context limit these sessions never reach
CONFIG: dict[str, Any] = {"max_output_tokens": OUT, "stop_token_ids": ()}


def chunks() -> list[InputChunk]:
    """7-character pieces; every third asks for output (and so commits the whole tail)."""
    pieces = [TEXT[i : i + 7] for i in range(0, len(TEXT), 7)]
    return [InputChunk(seq, None, piece, OUT if seq % 3 == 2 else 0) for seq, piece in enumerate(pieces)]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine.load(
        "tiny", kv_tokens=4096, page_size=16, max_pending_tokens=4096, max_pending_outputs=64
    ) as e:
        yield e


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[TurnResult]:
    """The uninterrupted session, every chunk submitted at once: queued no-output chunks merge into
    one append, and each one's result must still carry its own tail."""
    sid = engine.open_session(**CONFIG)
    futures: list[Future[TurnResult]] = [
        engine.submit(sid, text=c.text, seq=c.seq, max_output_tokens=c.max_output_tokens) for c in chunks()
    ]
    results = [f.result(60) for f in futures]
    engine.close_session(sid)
    return results


def record(result: TurnResult) -> bytes:
    """The record worker/server/service.py logs for a turn."""
    tokens = result.inputs + result.tokens
    tail = result.tail
    return encode_log_record(
        result.seq, tokens, inputs=len(result.inputs), tail_text=tail.text, tail_context=tail.context
    )


def test_each_result_carries_the_tail_after_its_own_input(
    engine: Engine, reference: list[TurnResult]
) -> None:
    assert engine.text is not None
    tail = EMPTY_TAIL
    for chunk, result in zip(chunks(), reference, strict=True):
        assert chunk.text is not None
        inputs, tail = engine.text.feed(tail, chunk.text, flush=bool(chunk.max_output_tokens))
        assert (list(result.inputs), result.tail) == (inputs, tail)


def durable_points(reference: list[TurnResult]) -> list[int]:
    """Every durable point where text is held back, plus none logged at all."""
    return [-1] + [r.seq for r in reference if not r.tail.empty]


@pytest.mark.parametrize("delivered_after", [0, 1, 4, 100])
def test_a_restored_text_session_equals_the_uninterrupted_one(
    engine: Engine, reference: list[TurnResult], delivered_after: int
) -> None:
    all_chunks = chunks()
    points = durable_points(reference)
    assert len(points) > 3  # the text really is held back at durable points
    for durable in points:
        delivered = min(durable + delivered_after, len(all_chunks) - 1)
        log = b"".join(record(r) for r in reference[: durable + 1])
        tail = [
            UndurableTurn(c, reference[c.seq].tokens if c.seq <= delivered else None)
            for c in all_chunks[durable + 1 :]
        ]
        plan = plan_restore(
            "s",
            log,
            tail,
            delivered,
            rules=SessionRules(OpenConfig(max_output_tokens=OUT), NO_WINDOW, engine.text),
        )
        for forced in plan.forced:
            expected = reference[forced.seq]
            assert (forced.tokens, forced.inputs) == (
                list(expected.inputs + expected.tokens),
                len(expected.inputs),
            )
            assert forced.tail == expected.tail
        held = reference[delivered].tail if delivered >= 0 else EMPTY_TAIL
        assert plan.text_tail == held
        sid = engine.open_session(
            history=plan.history, accepted_seq=plan.finished_seq, text_tail=plan.text_tail, **CONFIG
        )
        for chunk in plan.rerun:
            result = engine.run_turn(
                sid, text=chunk.text, seq=chunk.seq, max_output_tokens=chunk.max_output_tokens, timeout=60
            )
            expected = reference[chunk.seq]
            assert (result.inputs, result.tokens, result.tail) == (
                expected.inputs,
                expected.tokens,
                expected.tail,
            )
            if chunk.max_output_tokens:  # a merged no-output chunk reports its append's end
                assert result.length == expected.length
        engine.close_session(sid)


def test_the_log_answers_a_text_turn_with_its_committed_input_count(reference: list[TurnResult]) -> None:
    asked = next(r for r in reference if r.tokens and r.seq > 0)
    log = b"".join(record(r) for r in reference[: asked.seq + 1])
    lost = [UndurableTurn(c, None) for c in chunks()[asked.seq : asked.seq + 1]]
    plan = plan_restore(
        "s", log, lost, asked.seq - 1, rules=SessionRules(OpenConfig(max_output_tokens=OUT), NO_WINDOW, None)
    )
    [answer] = plan.answers
    assert (answer.done.tokens, answer.done.committed_tokens, answer.length) == (
        asked.tokens,
        len(asked.inputs),
        asked.length,
    )
