"""Text streamed into a session: what it commits, when, and what a refusal leaves behind."""

from __future__ import annotations

import threading

import pytest

from shared.errors import BadSequence, CapacityExhausted
from worker.engine import Engine

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def test_text_in_nine_character_pieces_is_the_whole_text(tiny: Engine) -> None:
    assert tiny.tokenizer is not None
    whole = tiny.open_session(stop_token_ids=())
    reply_whole = tiny.run_turn(whole, text=PROMPT, max_output_tokens=6, timeout=30)
    sid = tiny.open_session(stop_token_ids=())
    parts = pieces(PROMPT, 9)
    committed: list[int] = []
    for part in parts[:-1]:
        result = tiny.run_turn(sid, text=part, max_output_tokens=0, timeout=30)
        assert result.tokens == ()
        committed += result.inputs
    last = tiny.run_turn(sid, text=parts[-1], max_output_tokens=6, timeout=30)  # asking for output flushes
    committed += last.inputs
    assert committed == tiny.tokenizer.encode(PROMPT) == list(reply_whole.inputs)
    assert last.tokens == reply_whole.tokens and last.length == reply_whole.length
    # A cut special token was never committed half: without the tail it would be bytes.
    assert committed.count(tiny.tokenizer.token_id("<|im_start|>") or -1) == 2


def test_token_chunk_and_flush_commit_the_tail(tiny: Engine) -> None:
    assert tiny.tokenizer is not None
    sid = tiny.open_session()
    held = tiny.run_turn(sid, text="hello wor", timeout=30)
    assert held.inputs == tuple(tiny.tokenizer.encode("hello"))  # " wor" may still grow
    flushed = tiny.run_turn(sid, text="ld", flush=True, timeout=30)
    assert flushed.inputs == tuple(tiny.tokenizer.encode(" world"))
    tiny.run_turn(sid, text="<|im_", timeout=30)
    with_tokens = tiny.run_turn(sid, tokens=[1, 2], timeout=30)
    assert with_tokens.inputs == (*tiny.tokenizer.encode("<|im_"), 1, 2)
    assert with_tokens.length == len(tiny.tokenizer.encode("hello world<|im_")) + 2


def test_capacity_refusal_keeps_seq_and_text_and_the_retry_is_accepted() -> None:
    with Engine.load("tiny", kv_tokens=256, page_size=16) as engine:
        assert engine.tokenizer is not None
        reference = engine.open_session(stop_token_ids=())
        expected = [
            engine.run_turn(reference, text="ab", seq=0, timeout=30).inputs,
            engine.run_turn(reference, text="c" * 60, seq=1, max_output_tokens=3, timeout=30),
            engine.run_turn(reference, tokens=[5, 6], seq=2, max_output_tokens=3, timeout=30).tokens,
        ]
        engine.close_session(reference)

        hog = engine.open_session(stop_token_ids=())
        started = threading.Event()
        hogging = engine.submit(
            hog, tokens=[1] * 20, max_output_tokens=200, on_token=lambda _d: started.set()
        )
        assert started.wait(30)
        sid = engine.open_session(stop_token_ids=())
        assert engine.run_turn(sid, text="ab", seq=0, timeout=30).inputs == expected[0]
        refused = engine.submit(sid, text="c" * 60, seq=1, max_output_tokens=3)
        behind = engine.submit(sid, tokens=[5, 6], seq=2, max_output_tokens=3)
        with pytest.raises(CapacityExhausted) as error:
            refused.result(30)
        assert error.value.retry_after_ms is not None
        with pytest.raises(CapacityExhausted):
            behind.result(30)
        engine.cancel(hog)
        assert hogging.result(30).finish == "cancelled"
        engine.close_session(hog)
        # The same seqs again: accepted, and the session is the one that was never refused.
        retried = engine.run_turn(sid, text="c" * 60, seq=1, max_output_tokens=3, timeout=30)
        assert (retried.inputs, retried.tokens, retried.length) == (
            expected[1].inputs,
            expected[1].tokens,
            expected[1].length,
        )
        assert (
            engine.run_turn(sid, tokens=[5, 6], seq=2, max_output_tokens=3, timeout=30).tokens == expected[2]
        )
        with pytest.raises(BadSequence):
            engine.run_turn(sid, tokens=[7], seq=2, timeout=30)


def test_paste_burst_of_twenty_text_pieces_is_accepted_whole() -> None:
    """Under the default limits, a paragraph sent as 20 pieces behind a running turn all queues."""
    with Engine.load("tiny", kv_tokens=4096) as engine:
        assert engine.tokenizer is not None
        sid = engine.open_session(stop_token_ids=())
        started = threading.Event()
        busy = engine.submit(sid, tokens=[1, 2], max_output_tokens=20, on_token=lambda _d: started.set())
        assert started.wait(30)
        paragraph = ("The quick brown fox jumps over the lazy dog, twice: 1234 5678. " * 7)[:400]
        futures = [engine.submit(sid, text=part, max_output_tokens=0) for part in pieces(paragraph, 20)]
        assert len(futures) == 20
        flushed = engine.submit(sid, text="", flush=True)
        busy.result(30)
        committed = [t for f in [*futures, flushed] for t in f.result(30).inputs]
        assert committed == engine.tokenizer.encode(paragraph)
