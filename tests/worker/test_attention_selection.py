"""Backend selection: CPU installs never reach flashinfer; names are checked."""

from __future__ import annotations

import sys

import pytest
import torch

from worker.attention import backend_class, resolve_backend_name
from worker.attention.torch_backend import TorchAttention
from worker.engine import Engine


def test_auto_is_torch_on_cpu() -> None:
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    assert backend_class("torch") is TorchAttention


def test_flashinfer_needs_cuda_and_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend_name("flashinfer", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("triton", torch.device("cpu"))


def test_a_cpu_engine_never_imports_flashinfer() -> None:
    with Engine.load("tiny", kv_tokens=256, attention="auto") as engine:
        assert engine.attention_backend == "torch"
        engine.run_turn(engine.open_session(), tokens=[1, 2, 3], max_output_tokens=2)
    assert "flashinfer" not in sys.modules
