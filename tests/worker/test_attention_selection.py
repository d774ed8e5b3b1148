"""Backend selection: CPU installs never reach flashinfer; names are checked; the choice is reported."""

from __future__ import annotations

import sys

import pytest
import torch

from worker.attention import TorchAttention, choose_backend
from worker.engine import Engine
from worker.server.metrics import WorkerMetrics

SHAPE = {"dtype": torch.float32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "page_size": 16}


def test_auto_and_torch_are_torch_on_cpu() -> None:
    for name in ("auto", "torch"):
        assert choose_backend(name, device=torch.device("cpu"), **SHAPE) is TorchAttention


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_backend("triton", device=torch.device("cpu"), **SHAPE)


def test_a_cpu_engine_never_imports_flashinfer_and_names_its_backend() -> None:
    with Engine.load("tiny", kv_tokens=256, attention="auto") as engine:
        assert engine.attention_backend == "torch"
        engine.run_turn(engine.open_session(), tokens=[1, 2, 3], max_output_tokens=2)
        stats = engine.stats()
    assert "flashinfer" not in sys.modules
    assert stats.attention_backend == "torch"
    assert (
        'microturn_worker_attention_backend{backend="torch"} 1' in WorkerMetrics().render(stats).splitlines()
    )
