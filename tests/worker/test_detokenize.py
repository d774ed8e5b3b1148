"""The one incremental decoder: streamed deltas and the terminal chat both rely on it."""

from __future__ import annotations

import io

from worker.console import chat
from worker.engine import Engine
from worker.tokenizer.detokenize import IncrementalDecoder
from worker.tokenizer.tokenizer import Tokenizer

TOKENIZER = Tokenizer.byte_level(512)


def test_a_character_split_over_tokens_comes_out_whole_once_complete() -> None:
    text = "aé€!"
    tokens = TOKENIZER.encode(text)
    assert len(tokens) == 1 + 2 + 3 + 1  # one token per byte
    decoder = IncrementalDecoder(TOKENIZER)
    pieces = [decoder.feed(token) for token in tokens]
    assert pieces == ["a", "", "é", "", "", "€", "!"]
    assert "".join(p or "" for p in pieces) == text


def test_special_tokens_are_kept_or_skipped_as_asked() -> None:
    end = TOKENIZER.token_id("<|im_end|>")
    assert end is not None
    tokens = [*TOKENIZER.encode("hi"), end]
    kept = IncrementalDecoder(TOKENIZER)
    skipped = IncrementalDecoder(TOKENIZER, skip_special_tokens=True)
    assert "".join(kept.feed(t) or "" for t in tokens) == "hi<|im_end|>"
    assert "".join(skipped.feed(t) or "" for t in tokens) == "hi"


def test_no_tokenizer_means_no_text() -> None:
    assert IncrementalDecoder(None).feed(1) is None


def test_the_terminal_chat_prints_the_reply_it_sampled() -> None:
    stdout = io.StringIO()
    with Engine.load("tiny", kv_tokens=1024) as engine:
        chat(engine, max_reply_tokens=6, stdin=io.StringIO("hello\n"), stdout=stdout)
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        # The same prompt sent whole (micro-turns change no token): the reply chat must have shown.
        prompt = tokenizer.encode(tokenizer.chat_prompt("hello", system="You are a helpful AI assistant."))
        sid = engine.open_session(idle_timeout_s=None)
        reply = engine.run_turn(sid, tokens=prompt, max_output_tokens=6).tokens
    header, shown = stdout.getvalue().split("\n", 1)
    assert header.startswith("microturn console: tiny")
    # Shown: the longest prefix of the reply that ends on a whole character (the rest is held back).
    prefixes = (tokenizer.decode(reply[:n], skip_special_tokens=True) for n in range(len(reply), -1, -1))
    expected = next(text for text in prefixes if not text.endswith("\ufffd"))
    assert shown.startswith(expected + "\n  [")
    assert f"{len(reply)} tokens" in shown
