"""The host tier on a real GPU: pinned pages, copies on a side stream ordered by events, which the
host never waits for. Run by scripts/gpu-check.sh; without CUDA these skip and say so. The pool test
uses `nhd` pages (flashinfer's); the engines choose their backend as a worker does (`auto`:
flashinfer where installed, which scripts/gpu-check.sh compiles before the tests run), on random
weights of SmolLM2's shape (the GPU machine cannot carry the GGUF)."""

from __future__ import annotations

import pytest
import torch

from worker.attention.kv_pool import KVPool
from worker.engine import Engine
from worker.engine.memory.page_copy import HostKVPool, PageCopier

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]
CUDA = torch.device("cuda")
# GPU cycles a queued `torch.cuda._sleep` spins (about half a second): work still running on the
# compute stream when a copy is asked for, which the host must not wait for.
BUSY_CYCLES = 1_000_000_000


def test_pages_round_trip_through_pinned_memory_in_stream_order() -> None:
    pool = KVPool(
        num_layers=4,
        num_pages=64,
        page_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device=CUDA,
    )
    host = HostKVPool(pool, 64)
    assert host.paged.is_pinned()
    copier = PageCopier(pool, host)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, device=CUDA).to(torch.bfloat16))
    original = pool.paged().clone()
    torch.cuda._sleep(BUSY_CYCLES)  # type: ignore[no-untyped-call]  # a step still running on the compute stream
    copier.to_host(list(range(8, 40)), list(range(32)))
    assert copier.stream is not None
    # The host went on at once: the copy is queued behind the step, not done (a strided copy staged
    # through pageable memory would have waited for both before returning).
    assert not copier.stream.query()
    pool.buffer.zero_()  # queued on the compute stream after the copy: must not reach the host copy
    copier.to_device(list(range(32)), list(range(20, 52)))
    restored = pool.paged().narrow(pool.page_axis, 20, 32)  # read on the compute stream, after the copy
    assert torch.equal(restored, original.narrow(pool.page_axis, 8, 32))
    torch.cuda.synchronize()
    copier.settle()
    assert copier.restored.seconds > 0


def test_sessions_parked_on_the_host_answer_as_in_a_roomy_pool_on_cuda() -> None:
    def converse(engine: Engine) -> list[tuple[int, ...]]:
        sids = [engine.open_session(stop_token_ids=()) for _ in range(4)]
        for i, sid in enumerate(sids):
            engine.run_turn(sid, tokens=[(3 * i + j) % 200 + 1 for j in range(90)], max_output_tokens=2)
        return [engine.run_turn(sid, tokens=[1, 2, 3], max_output_tokens=4).tokens for sid in sids]

    options = {"device": "cuda", "dtype": "bfloat16", "page_size": 16}
    with Engine.load("smollm2-135m-shape", kv_tokens=16 * 16, host_kv_tokens=64 * 16, **options) as pressed:
        parked = converse(pressed)
        assert pressed.stats().memory.restores.count >= 4
    with Engine.load("smollm2-135m-shape", kv_tokens=64 * 16, host_kv_tokens=0, **options) as roomy:
        assert converse(roomy) == parked
