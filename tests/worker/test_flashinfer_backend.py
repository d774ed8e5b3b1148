"""The flashinfer backend on the CPU, through a reference of flashinfer's API put in its place.

What runs here is the backend's own code (its metadata, its calls and their arguments) against
`flashinfer_reference`, which implements flashinfer's documented semantics independently; the
reference itself is held against the real wheel's source in test_flashinfer_api.py.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Iterator

import pytest
import torch

from tests.worker import flashinfer_reference
from worker.attention import BackendRefused, TorchAttention, choose_backend, decide
from worker.attention.base import AttentionBackend, AttentionShape, paged_metadata
from worker.attention.flashinfer_backend import FlashInferAttention
from worker.attention.kv_pool import KVPool
from worker.attention.self_check import compare_with_torch
from worker.engine import Engine

CPU = torch.device("cpu")
HEADS = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 64}  # GQA, group of 4
SHAPE = AttentionShape(CPU, torch.float32, page_size=16, **HEADS)


@pytest.fixture
def reference(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_reference.module())
    yield


@pytest.fixture
def broken(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_reference.wrong())
    yield


def _pool(backend: type[AttentionBackend], num_pages: int, page_size: int) -> KVPool:
    return KVPool(
        num_layers=2,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=HEADS["num_kv_heads"],
        head_dim=HEADS["head_dim"],
        dtype=torch.float32,
        device=CPU,
        layout=backend.kv_layout,
    )


@pytest.mark.usefixtures("reference")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_steps_across_page_boundaries_match_the_torch_backend(seed: int) -> None:
    """Rows of random lengths on shuffled pages, appended over several steps (prefills, appends
    and decodes mixed), both layers: every output equals the torch backend's."""
    rng = random.Random(seed)
    page_size, rows, num_pages = 4, 5, 64
    pages = list(range(num_pages))
    rng.shuffle(pages)
    tables = [pages[i * 12 : (i + 1) * 12] for i in range(rows)]  # 48 tokens of room per row
    backends = {}
    for cls in (TorchAttention, FlashInferAttention):
        pool = _pool(cls, num_pages, page_size)
        backends[cls.name] = cls(pool, **HEADS)
    lengths = [0] * rows
    generator = torch.Generator().manual_seed(seed)
    for _step in range(5):
        q_lens = [rng.choice([1, 1, 2, 3, 7, 9]) for _ in range(rows)]
        meta = paged_metadata(lengths, q_lens, tables, page_size)
        tokens = sum(q_lens)
        q = torch.randn(tokens, HEADS["num_heads"], HEADS["head_dim"], generator=generator)
        k, v = (
            torch.randn(tokens, HEADS["num_kv_heads"], HEADS["head_dim"], generator=generator) for _ in "kv"
        )
        for backend in backends.values():
            backend.plan(meta)
        for layer in range(2):
            want = backends["torch"].forward(layer, q, k, v)
            have = backends["flashinfer"].forward(layer, q, k, v)
            assert torch.allclose(have, want, atol=1e-5, rtol=1e-5), (have - want).abs().max()
        lengths = [n + q for n, q in zip(lengths, q_lens, strict=True)]
    assert max(lengths) > 3 * page_size  # the rows really crossed pages


def _plans(seed: int) -> list[list[tuple[list[int], int]]]:
    rng = random.Random(seed)
    return [
        [
            ([rng.randrange(1, 500) for _ in range(rng.randint(1, 20))], rng.choice([0, 2, 3]))
            for _ in range(5)
        ]
        for _ in range(8)
    ]


def _run_alone(engine: Engine, plan: list[tuple[list[int], int]]) -> list[tuple[int, ...]]:
    sid = engine.open_session(stop_token_ids=())
    tokens = [engine.run_turn(sid, tokens=chunk, max_output_tokens=k, timeout=60).tokens for chunk, k in plan]
    engine.close_session(sid)
    return tokens


@pytest.mark.usefixtures("reference")
def test_an_engine_on_flashinfer_equals_torch_and_eight_interleaved_sessions_equal_each_alone() -> None:
    plans = _plans(11)
    options = {"kv_tokens": 4096, "page_size": 4, "max_chunk_tokens": 256}
    with Engine.load("tiny", attention="torch", **options) as engine:
        on_torch = [_run_alone(engine, plan) for plan in plans]
    with Engine.load("tiny", attention="flashinfer", **options) as engine:
        assert engine.attention_backend == "flashinfer"
        assert engine.stats().attention_backend == "flashinfer"
        alone = [_run_alone(engine, plan) for plan in plans]
        sids = [engine.open_session(stop_token_ids=()) for _ in plans]
        futures = [
            [engine.submit(sid, tokens=chunk, max_output_tokens=k) for chunk, k in plan]
            for sid, plan in zip(sids, plans, strict=True)
        ]
        together = [[f.result(60).tokens for f in fs] for fs in futures]
    assert alone == on_torch
    assert together == alone


@pytest.mark.usefixtures("reference")
def test_the_self_check_passes_a_faithful_flashinfer() -> None:
    problem = compare_with_torch(FlashInferAttention, SHAPE)
    assert problem is None


@pytest.mark.usefixtures("broken")
def test_the_self_check_catches_a_wrong_mask_and_names_it() -> None:
    problem = compare_with_torch(FlashInferAttention, SHAPE)
    assert problem is not None and "differs from the torch reference" in problem


def test_the_self_check_reports_a_backend_that_cannot_even_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    problem = compare_with_torch(FlashInferAttention, SHAPE)
    assert problem is not None and "ModuleNotFoundError" in problem


def test_auto_falls_back_to_torch_with_a_warning_and_flashinfer_refuses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="worker.attention"):
        assert decide("auto", FlashInferAttention, "it differs", SHAPE) is TorchAttention
    assert "failed its start-up check" in caplog.text and "it differs" in caplog.text
    with pytest.raises(BackendRefused, match="it differs"):
        decide("flashinfer", FlashInferAttention, "it differs", SHAPE)
    assert decide("auto", FlashInferAttention, None, SHAPE) is FlashInferAttention
    assert decide("flashinfer", FlashInferAttention, None, SHAPE) is FlashInferAttention


@pytest.mark.usefixtures("broken")
def test_a_worker_asked_for_a_broken_flashinfer_refuses_to_start_and_says_why() -> None:
    with pytest.raises(BackendRefused, match="differs from the torch reference"):
        Engine.load("tiny", attention="flashinfer", kv_tokens=256)


def test_flashinfer_asked_for_without_the_package_is_refused_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr("worker.attention.importlib.util.find_spec", lambda name: None)
    with pytest.raises(BackendRefused, match="not installed"):
        choose_backend("flashinfer", SHAPE)


@pytest.mark.usefixtures("reference")
def test_auto_on_the_cpu_never_picks_flashinfer_even_when_importable() -> None:
    chosen = choose_backend("auto", SHAPE)
    assert chosen is TorchAttention or chosen.name == "cpu"


def test_flashinfer_refuses_head_dims_its_kernels_lack() -> None:
    pool = KVPool(
        num_layers=1, num_pages=4, page_size=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, device=CPU
    )
    with pytest.raises(ValueError, match="head_dim"):
        FlashInferAttention(pool, num_heads=4, num_kv_heads=2, head_dim=32)
