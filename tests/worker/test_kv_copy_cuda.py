"""A drain's KV copy on a real GPU: pages gathered into pinned memory on the host tier's side stream,
ordered by events, while steps run, then scattered into another engine's pages. Run by
scripts/gpu-check.sh (`pytest -m cuda`); without CUDA these skip and say so. The engines serve with
the torch attention backend (no kernel compile: the file runs in seconds); the gather's own test
uses `nhd` pages, flashinfer's layout."""

from __future__ import annotations

import pytest
import torch

from shared.protocol.messages import OpenConfig
from worker.attention.kv_pool import KVPool
from worker.engine import Engine
from worker.engine.memory.kv_transfer import gather, staging
from worker.tokenizer.incremental import EMPTY_TAIL

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]
CUDA = torch.device("cuda")
CONFIG = OpenConfig(stop_token_ids=(), max_output_tokens=3)
TURNS = [[(11 * t + j) % 200 + 1 for j in range(64)] for t in range(5)]
# GPU cycles a queued `torch.cuda._sleep` spins (about half a second): a step still running.
BUSY_CYCLES = 1_000_000_000


def test_the_pages_leave_on_the_side_stream_while_a_step_runs() -> None:
    pool = KVPool(
        num_layers=4,
        num_pages=64,
        page_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device=CUDA,
    )
    pool.buffer.copy_(torch.randn(pool.buffer.shape, device=CUDA).to(torch.bfloat16))
    expected = pool.paged().clone()
    pages = [3, 4, 5, 9, 10, 40]  # three runs
    out = staging(pool.paged(), pool.page_axis, len(pages))
    assert out.is_pinned()
    side = torch.cuda.Stream(CUDA)  # type: ignore[no-untyped-call]
    torch.cuda._sleep(BUSY_CYCLES)  # type: ignore[no-untyped-call]  # the step on the compute stream
    ready = gather(pool.paged(), pool.page_axis, pages, out, stream=side)
    # The engine thread went on at once: the copy out is queued behind the step, not done.
    assert ready is not None and not ready.query()  # type: ignore[no-untyped-call]
    pool.buffer.zero_()  # the next step overwrites the pages: it waits for the copy out
    ready.synchronize()
    for index, page in enumerate(pages):
        assert torch.equal(out[index].to(CUDA), expected.select(pool.page_axis, page))
    assert not pool.buffer.any()


def test_pages_leave_through_pinned_memory_and_answer_as_they_would_have() -> None:
    options = {"device": "cuda", "kv_tokens": 4096, "host_kv_tokens": 4096, "attention": "torch"}
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
