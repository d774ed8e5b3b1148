"""Backend selection: CPU installs never reach flashinfer; names are checked; the choice is reported."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from shared.settings import EXIT_REFUSED
from tests.processes import run_to_exit
from worker.attention import (
    AUTO,
    BACKENDS,
    REFERENCE,
    AttentionBackend,
    AttentionShape,
    TorchAttention,
    choose_backend,
    cpu_backend,
)
from worker.engine import Engine
from worker.server.metrics import WorkerMetrics

SHAPE = AttentionShape(
    torch.device("cpu"), torch.float32, num_heads=4, num_kv_heads=2, head_dim=64, page_size=16
)


def test_torch_is_torch_and_auto_is_the_cpu_kernel_where_it_runs() -> None:
    assert choose_backend("torch", SHAPE) is TorchAttention
    expected = TorchAttention if cpu_backend.KERNEL is None else cpu_backend.CpuAttention
    assert choose_backend("auto", SHAPE) is expected


def test_auto_passes_over_the_cpu_kernel_where_it_cannot_serve() -> None:
    # bfloat16 and a head size the kernel does not take: auto serves the torch reference.
    for shape in (replace(SHAPE, dtype=torch.bfloat16), replace(SHAPE, head_dim=60)):
        assert cpu_backend.CpuAttention.unavailable(shape) is not None
        assert choose_backend("auto", shape) is TorchAttention


def test_asking_for_the_cpu_kernel_where_it_cannot_serve_is_refused() -> None:
    refusal = "--attention cpu cannot serve here: it runs float32 on the CPU only"
    with pytest.raises(ValueError, match=refusal):
        choose_backend("cpu", replace(SHAPE, dtype=torch.bfloat16))


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_backend("triton", SHAPE)


def test_a_cpu_engine_never_imports_flashinfer_and_names_its_backend() -> None:
    expected = "torch" if cpu_backend.KERNEL is None else "cpu"
    with Engine.load("tiny", kv_tokens=256, attention="auto") as engine:
        assert engine.attention_backend == expected
        engine.run_turn(engine.open_session(), tokens=[1, 2, 3], max_output_tokens=2)
        stats = engine.stats()
    assert "flashinfer" not in sys.modules
    assert stats.attention_backend == expected
    line = f'microturn_worker_attention_backend{{backend="{expected}"}} 1'
    assert line in WorkerMetrics().render(stats).splitlines()


def test_a_worker_asked_for_flashinfer_it_cannot_use_refuses_to_start_and_says_why() -> None:
    # A CPU machine without the `gpu` extra: the start-up check cannot pass.
    done = run_to_exit("worker", "--model", "tiny", "--attention", "flashinfer")
    assert done.returncode == EXIT_REFUSED, done.stderr[-2000:]
    assert "the worker does not start: --attention flashinfer cannot serve here" in done.stderr
    assert "not installed" in done.stderr


def test_each_registered_backend_loads_the_class_of_its_name() -> None:
    # An entry names its class as a string (so choosing another backend imports nothing of it):
    # a renamed class or module, or an entry whose name is not its class's, fails here.
    assert BACKENDS[REFERENCE].load() is TorchAttention and AUTO not in BACKENDS
    for name, entry in BACKENDS.items():
        backend = entry.load()
        assert issubclass(backend, AttentionBackend) and backend.name == name == entry.name
        assert (entry.package is None) == (entry.install == ""), f"{name}: a package comes with how to get it"
