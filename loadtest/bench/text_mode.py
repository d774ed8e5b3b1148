"""The `text` mode: streaming sessions fed text, cut mid-word, as a typing or speech client sends it.

Each turn is two chunks: the first part of the turn's text (no output: the worker commits what can
no longer change and holds back the tail) and the rest, asking for the turn's outputs (which
commits the tail). The text is plain English prose, each session starting at another offset; a
turn carries about `input_tokens` tokens of it. Its latency, compared with `streaming` (token
chunks), is the price of exact incremental tokenization, and its tail/head ratio shows that price
does not grow with the session (the history is never re-tokenized).
"""

from __future__ import annotations

import logging
import threading
import time

from loadtest.bench.clients import RESULT_TIMEOUT_S, open_together, run_clients
from loadtest.bench.config import TEXT, BenchConfig
from loadtest.bench.results import ModeRun
from worker.engine import Engine

logger = logging.getLogger(__name__)

PROSE = (
    "Realtime interaction models listen while you speak and answer in a few tokens at a time. "
    "Each micro-turn carries a fragment of text, cut wherever the recognizer paused: mid-word, "
    "between two digits of 2048, or inside a word like extraordinarily. The server must see the "
    "same tokens the whole sentence would give, and it must not pay more for turn 300 than turn 3. "
)


def turn_texts(engine: Engine, config: BenchConfig) -> list[list[str]]:
    """Per session, per turn: the turn's text (about `input_tokens` tokens of prose)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError(f"the text mode needs a tokenizer; model {config.model} has none")
    chars_per_token = len(PROSE) / len(tokenizer.encode(PROSE))
    size = max(int(config.input_tokens * chars_per_token), 2)
    corpus = PROSE * (-(-(size * config.turns + len(PROSE) * config.sessions) // len(PROSE)) + 1)
    texts = []
    for session in range(config.sessions):
        start = session * 37  # each session cuts the prose at other places
        texts.append([corpus[start + t * size : start + (t + 1) * size] for t in range(config.turns)])
    return texts


def run_text(engine: Engine, config: BenchConfig) -> ModeRun:
    run = ModeRun.empty(TEXT, sessions=config.sessions, turns=config.turns)
    texts = turn_texts(engine, config)
    start = threading.Barrier(config.sessions)

    def client(session: int) -> None:
        sid = open_together(engine, start)
        try:
            for turn, text in enumerate(texts[session]):
                cut = len(text) // 2
                began = time.perf_counter()
                engine.submit(sid, text=text[:cut], max_output_tokens=0)
                engine.run_turn(
                    sid, text=text[cut:], max_output_tokens=config.output_tokens, timeout=RESULT_TIMEOUT_S
                )
                run.turn_ms[turn][session] = (time.perf_counter() - began) * 1000
        finally:
            engine.close_session(sid)

    run.wall_s = run_clients("text", config.sessions, client)
    logger.info("text: %d sessions x %d turns in %.1f s", config.sessions, config.turns, run.wall_s)
    return run
