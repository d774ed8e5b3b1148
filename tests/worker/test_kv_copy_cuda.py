"""A drain's KV copy on a real GPU: pages gathered into pinned memory on the host tier's side stream,
ordered by events, then scattered into another engine's pages. Run by scripts/gpu-check.sh
(`pytest -m cuda`); without CUDA these skip and say so."""

from __future__ import annotations

import pytest
import torch

from shared.protocol.messages import OpenConfig
from worker.engine import Engine
from worker.tokenizer.incremental import EMPTY_TAIL

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]
CONFIG = OpenConfig(stop_token_ids=(), max_output_tokens=3)
TURNS = [[(11 * t + j) % 200 + 1 for j in range(64)] for t in range(5)]


def test_pages_leave_through_pinned_memory_and_answer_as_they_would_have() -> None:
    options = {"device": "cuda", "kv_tokens": 4096, "host_kv_tokens": 4096}
    with Engine.load("tiny", **options) as source, Engine.load("tiny", **options) as target:
        source.open_session(session_id="s", config=CONFIG)
        history: list[int] = []
        for seq, chunk in enumerate(TURNS[:4], 1):
            history += [*chunk, *source.run_turn("s", tokens=chunk, seq=seq, timeout=60).tokens]
        export = source.export_kv("s").result(timeout=60)
        assert export.data.is_pinned() and export.ready is not None
        # The session goes on at once: its next turn is queued behind the copy out, never racing it.
        stayed = source.run_turn("s", tokens=TURNS[4], seq=5, timeout=60)
        kept = target.import_copy(
            "s",
            config=CONFIG,
            history=history,
            accepted_seq=4,
            text_tail=EMPTY_TAIL,
            kv_tokens=export.tokens,
            kv=torch.frombuffer(bytearray(export.payload()), dtype=export.data.dtype),
        ).result(timeout=60)
        assert kept == len(export.tokens)
        target.open_session(session_id="s", config=CONFIG, history=history, accepted_seq=4, adopt=True)
        moved = target.run_turn("s", tokens=TURNS[4], seq=5, timeout=60)
        assert moved.tokens == stayed.tokens
