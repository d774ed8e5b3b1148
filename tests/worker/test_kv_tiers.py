"""The host KV tier: idle sessions parked on the host under pressure and copied back exactly.

Each scenario runs its turns one at a time, so the pressured run and the roomy run feed the model
the same batches: the only difference is where the KV waited between turns.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import psutil
import pytest
import torch

from shared.errors import CapacityExhausted
from tests.worker.cpu_kernel import needs_cpu_kernel
from tests.worker.smollm2 import engine_on
from worker.attention.kv_pool import KVPool
from worker.engine import Engine, TurnResult
from worker.engine.config import EngineConfig
from worker.engine.memory import sizing
from worker.engine.memory.page_copy import HostKVPool, PageCopier, page_blocks, page_runs
from worker.model.loader import LoadedModel
from worker.model.presets import TINY

PAGE = 16


def _converse(engine: Engine, sessions: int, turns: int, history: int) -> list[list[TurnResult]]:
    """`sessions` sessions of `history` tokens each, then `turns` rounds of one short turn each."""
    sids = [engine.open_session(stop_token_ids=(), logprobs=True) for _ in range(sessions)]
    for i, sid in enumerate(sids):
        prompt = [(7 * i + j) % 200 + 1 for j in range(history)]
        engine.run_turn(sid, tokens=prompt, max_output_tokens=2, timeout=60)
    results: list[list[TurnResult]] = [[] for _ in sids]
    for turn in range(turns):
        for i, sid in enumerate(sids):
            chunk = [(11 * turn + 3 * i + j) % 200 + 1 for j in range(4)]
            results[i].append(engine.run_turn(sid, tokens=chunk, max_output_tokens=3, timeout=60))
    return results


def _outputs(results: list[list[TurnResult]]) -> list[list[tuple[tuple[int, ...], object]]]:
    return [[(r.tokens, r.logprobs) for r in session] for session in results]


@pytest.mark.parametrize(
    "kv_dtype",
    [
        "float32",
        "float16",
        # the int8 forms' pages hold int8 rows and scales in float16 slots: moved as bytes, kept exact
        pytest.param("int8-keys", marks=needs_cpu_kernel),
        pytest.param("int8", marks=needs_cpu_kernel),
    ],
)
def test_sessions_parked_on_the_host_continue_exactly_without_recompute(kv_dtype: str) -> None:
    # Each session holds ~6 pages; the device pool holds two of them, the host tier all six.
    with Engine.load(
        "tiny", kv_tokens=14 * PAGE, page_size=PAGE, host_kv_tokens=64 * PAGE, kv_dtype=kv_dtype
    ) as pressed:
        pressured = _converse(pressed, sessions=6, turns=3, history=80)
        memory = pressed.stats().memory
    with Engine.load(
        "tiny", kv_tokens=256 * PAGE, page_size=PAGE, host_kv_tokens=0, kv_dtype=kv_dtype
    ) as roomy:
        unpressured = _converse(roomy, sessions=6, turns=3, history=80)
    assert _outputs(pressured) == _outputs(unpressured)
    assert memory.offloads.count >= 6 and memory.restores.count >= 6
    assert memory.restores.bytes == memory.restores.pages * memory.offloads.bytes // memory.offloads.pages
    assert memory.drops == 0 and memory.recomputes == 0


def test_a_restored_turn_forwards_only_its_own_tokens() -> None:
    with Engine.load("tiny", kv_tokens=8 * PAGE, page_size=PAGE, host_kv_tokens=32 * PAGE) as engine:
        first = engine.open_session(stop_token_ids=())
        engine.run_turn(first, tokens=list(range(1, 90)), max_output_tokens=2, timeout=60)
        second = engine.open_session(stop_token_ids=())
        engine.run_turn(second, tokens=list(range(100, 190)), max_output_tokens=2, timeout=60)
        assert engine.stats().memory.host_pages_used > 0  # the first went to the host
        before = engine.stats().tokens_forwarded
        engine.run_turn(first, tokens=[5, 6, 7], max_output_tokens=4, timeout=60)
        # Its last sampled token, the 3 inputs, then 3 decodes: no pass over its 91-token history.
        assert engine.stats().tokens_forwarded - before == 1 + 3 + 3
        assert engine.stats().memory.recomputes == 0


def test_a_full_host_tier_drops_the_oldest_parked_session() -> None:
    # The device holds one ~6-page session, the host one more: the third push drops the oldest.
    with Engine.load("tiny", kv_tokens=8 * PAGE, page_size=PAGE, host_kv_tokens=7 * PAGE) as engine:
        sids = [engine.open_session(stop_token_ids=()) for _ in range(3)]
        for i, sid in enumerate(sids):
            engine.run_turn(
                sid, tokens=[(i + j) % 200 + 1 for j in range(90)], max_output_tokens=1, timeout=60
            )
        memory = engine.stats().memory
        assert memory.drops == 1 and memory.offloads.count == 2
        engine.run_turn(sids[0], tokens=[1, 2], max_output_tokens=1, timeout=60)  # dropped: recomputes
        assert engine.stats().memory.recomputes == 1


def test_busy_sessions_are_never_taken_and_the_refusal_is_typed() -> None:
    with Engine.load("tiny", kv_tokens=8 * PAGE, page_size=PAGE, host_kv_tokens=64 * PAGE) as engine:
        long_turn = engine.open_session(stop_token_ids=())
        running = engine.submit(long_turn, tokens=list(range(1, 100)), max_output_tokens=20)
        other = engine.open_session(stop_token_ids=())
        refused = engine.submit(other, tokens=list(range(1, 60)), max_output_tokens=8)
        with pytest.raises(CapacityExhausted) as error:
            refused.result(timeout=60)
        assert error.value.retry_after_ms is not None
        assert len(running.result(timeout=60).tokens) == 20


def test_host_kv_tokens_zero_has_no_tier() -> None:
    with Engine.load("tiny", kv_tokens=8 * PAGE, page_size=PAGE, host_kv_tokens=0) as engine:
        assert engine.stats().memory.host_pages_total == 0


@pytest.mark.parametrize("layout", ["nhd", "head_major"])
def test_pages_round_trip_through_the_host_in_runs(layout: str) -> None:
    pool = KVPool(
        num_layers=2,
        num_pages=8,
        page_size=4,
        num_kv_heads=2,
        head_dim=3,
        dtype=torch.float32,
        device=torch.device("cpu"),
        layout=layout,  # type: ignore[arg-type]
    )
    pool.buffer.copy_(torch.randn_like(pool.buffer))
    copier = PageCopier(pool, HostKVPool(pool, 6))
    original = pool.paged().clone()
    copier.to_host([2, 3, 4, 7], [0, 1, 2, 5])
    pool.buffer.zero_()
    copier.to_device([0, 1, 2, 5], [1, 2, 3, 6])
    paged = pool.paged()
    for source, target in [(2, 1), (3, 2), (4, 3), (7, 6)]:
        assert torch.equal(paged.select(pool.page_axis, target), original.select(pool.page_axis, source))
    assert copier.restored.bytes == 4 * pool.page_bytes


@pytest.mark.parametrize("layout", ["nhd", "head_major"])
def test_a_run_of_pages_is_one_contiguous_range_in_each_block_cuda_copies(layout: str) -> None:
    """On CUDA the tier copies a run block by block (one async transfer each; a strided run would be
    staged through pageable memory, synchronously): the blocks must be contiguous and cover the run."""
    pool = KVPool(
        num_layers=2,
        num_pages=8,
        page_size=4,
        num_kv_heads=2,
        head_dim=3,
        dtype=torch.float32,
        device=torch.device("cpu"),
        layout=layout,  # type: ignore[arg-type]
    )
    pool.buffer.copy_(torch.randn_like(pool.buffer))
    host = HostKVPool(pool, 6)
    source, target = page_blocks(pool.paged(), pool.page_axis), page_blocks(host.paged, pool.page_axis)
    assert len(source) == len(target) == 2 * 2 * (1 if layout == "nhd" else 2)  # layers, K/V (, heads)
    for source_block, target_block in zip(source, target, strict=True):
        run = source_block.narrow(0, 2, 3)
        assert run.is_contiguous() and target_block.narrow(0, 1, 3).is_contiguous()
        target_block.narrow(0, 1, 3).copy_(run)
    assert torch.equal(host.paged.narrow(pool.page_axis, 1, 3), pool.paged().narrow(pool.page_axis, 2, 3))


def test_page_runs_join_consecutive_pages_on_both_sides() -> None:
    assert page_runs([2, 3, 4, 7], [0, 1, 2, 5]) == [(2, 0, 3), (7, 5, 1)]
    assert page_runs([1, 2], [5, 3]) == [(1, 5, 1), (2, 3, 1)]
    with pytest.raises(ValueError):
        page_runs([1], [])


@pytest.fixture(scope="module")
def smollm2_engines(smollm2_model: LoadedModel) -> Iterator[tuple[Engine, Engine]]:
    with (
        engine_on(smollm2_model, kv_tokens=12 * PAGE, page_size=PAGE, host_kv_tokens=64 * PAGE) as pressed,
        engine_on(smollm2_model, kv_tokens=64 * PAGE, page_size=PAGE, host_kv_tokens=0) as roomy,
    ):
        yield pressed, roomy


@pytest.mark.slow
def test_smollm2_sessions_under_pressure_answer_as_in_a_roomy_pool(
    smollm2_engines: tuple[Engine, Engine],
) -> None:
    pressed, roomy = smollm2_engines
    pressured = _converse(pressed, sessions=4, turns=2, history=70)
    assert pressed.stats().memory.restores.count >= 4 and pressed.stats().memory.recomputes == 0
    assert _outputs(pressured) == _outputs(_converse(roomy, sessions=4, turns=2, history=70))


def test_the_host_tier_is_sized_net_of_a_cpu_pool_still_filling(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU pool is mapped at start and becomes resident afterwards (worker/mapped_zeros.py): the
    memory available when the tier is sized still counts it, so the tier leaves it out."""
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=8 * 2**30))
    config = EngineConfig(device="cpu", host_kv_tokens=-1, page_size=PAGE)
    page_bytes = sizing.kv_bytes_per_token(TINY, torch.float32) * PAGE
    share = sizing.HOST_KV_MEMORY_FRACTION
    assert sizing.host_pages(config, TINY, torch.float32) == int(8 * 2**30 * share) // page_bytes
    net = sizing.host_pages(config, TINY, torch.float32, pending_bytes=2**30)
    assert net == int(7 * 2**30 * share) // page_bytes
    assert sizing.host_pages(config, TINY, torch.float32, pending_bytes=9 * 2**30) == 0
