"""The weight-kernel benchmark's harness on the CPU (the kernel under Triton's interpreter): it times
every step matrix in every form and writes the table and the JSON the GPU run reports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from loadtest.weight_kernels import FORMS, main, step_matrices
from worker.model.presets import SHAPES

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (the CUDA kernels' compiler)"
)


def test_the_step_matrices_are_the_models_own() -> None:
    config = SHAPES["llama-3.1-8b-shape"]
    shapes = {name: (out, width, count) for name, out, width, count in step_matrices(config)}
    assert shapes["qkv"] == ((32 + 2 * 8) * 128, 4096, 32)
    assert shapes["gate_up"] == (2 * 14336, 4096, 32)
    assert shapes["lm_head"] == (128256, 4096, 1)


def test_a_smoke_run_times_every_matrix_in_every_form(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "kernels.json"
    args = ["--device", "cpu", "--models", "smoke", "--rows", "3", "--repeats", "1", "--rounds", "1"]
    assert main([*args, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    matrices = figures["smoke"]["matrices"]
    assert len(matrices) == 5 * len(FORMS)  # 5 step matrices
    assert all(m["seconds"] > 0 and m["num_bytes"] > 0 for m in matrices)
    quantised = {m["form"]: m["num_bytes"] for m in matrices if m["matrix"] == "down"}
    assert quantised["int4_q4_1"] < quantised["int8_q8_0"] < quantised["bf16"]
    printed = capsys.readouterr().out
    assert [line.split()[:2] for line in printed.splitlines()[2:]] == [["smoke", "3"]]
