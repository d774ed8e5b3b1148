"""The CUDA weight-only kernel against bf16 `F.linear`, per model step, by row count.

    python -m loadtest.weight_kernels [--device cuda] [--models NAME,...] [--rows 1,8,64,512] [--json F]

For each model shape, the matrices one forward step multiplies (fused qkv, o_proj, fused gate_up,
down, times the layers, and the lm_head once) are timed at M rows each: bf16 `F.linear` on dense
weights (the `float` form), and the kernel of worker/model/weight_only_kernel.py on random Q4_1
groups (`int4`, as a float checkpoint is quantised at load; Q4_0 is the same kernel without the
minimum) and Q8_0 groups (`int8`), both by the engine's method (ROWSUM), and Q4_1 by the other
(DOT, `int4_q4_1_dot`): which of the two the engine should use is one of the table's questions.
A row of the table is the step's matrices in milliseconds, summed from each distinct matrix's time
times how often a step multiplies it, and the weights' GB/s at that time. Each time is a loop of
back-to-back calls between two synchronisations, Python launch cost included, as the engine pays
it. SmolLM2-135M's shape is written out here (its file is not carried to a GPU machine).

On the CPU (`--device cpu`) the kernel runs under Triton's interpreter: only a smoke test of the
harness, `--models smoke --rows 1,2 --repeats 1 --rounds 1`; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig
from worker.model.linear_blocks import BlockLinear
from worker.model.presets import SHAPES, TINY
from worker.model.weight_only_kernel import Method

# Small enough for Triton's interpreter on a CPU: the harness's smoke test.
SMOKE_SHAPE = replace(
    TINY,
    name="smoke",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
)
MODELS = {SMOKE_SHAPE.name: SMOKE_SHAPE, **SHAPES}
DEFAULT_MODELS = ("smollm2-135m-shape", "llama-3.2-1b-shape", "llama-3.1-8b-shape")
# bf16 F.linear; Q4_1 and Q8_0 through the engine's method (ROWSUM); Q4_1 through the other (DOT).
FORMS = ("bf16", "int4_q4_1", "int8_q8_0", "int4_q4_1_dot")


@dataclass(frozen=True)
class Timing:
    """One matrix at one row count in one form: its median seconds and resident bytes."""

    matrix: str
    out_features: int
    in_features: int
    per_step: int  # how many times a forward step multiplies this matrix
    rows: int
    form: str
    seconds: float
    num_bytes: int


def step_matrices(config: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, out_features, in_features, times a step multiplies it) for one forward step."""
    c = config
    attention = c.num_heads * c.head_dim
    return [
        ("qkv", attention + 2 * c.num_kv_heads * c.head_dim, c.hidden_size, c.num_layers),
        ("o_proj", c.hidden_size, attention, c.num_layers),
        ("gate_up", 2 * c.intermediate_size, c.hidden_size, c.num_layers),
        ("down", c.hidden_size, c.intermediate_size, c.num_layers),
        ("lm_head", c.vocab_size, c.hidden_size, 1),
    ]


def _seconds(
    linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeats: int, rounds: int
) -> float:
    """Seconds a call takes back to back (launch included): the median of `rounds` of `repeats`."""

    def synchronize() -> None:
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)

    linear(x)  # the warm-up: the kernel's compilation, cuBLAS's choice
    per_call: list[float] = []
    for _ in range(rounds):
        synchronize()
        began = time.perf_counter()
        for _ in range(repeats):
            linear(x)
        synchronize()
        per_call.append((time.perf_counter() - began) / repeats)
    return statistics.median(per_call)


def _dense(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def linear(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    return linear


def measure_model(
    config: ModelConfig, rows: Sequence[int], device: torch.device, repeats: int, rounds: int = 3
) -> list[Timing]:
    """Every step matrix of `config` at every row count in every form."""
    timings: list[Timing] = []
    generator = torch.Generator(device=device).manual_seed(0)
    for name, out, width, per_step in step_matrices(config):
        weight = torch.randn(out, width, generator=generator, device=device) * width**-0.5
        dense = weight.to(torch.bfloat16)
        forms: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
            "bf16": (_dense(dense), dense.numel() * dense.element_size())
        }
        q4_1 = BlockLinear.q4_1_from_float(weight, None)
        q8_0 = BlockLinear.q8_0_from_float(weight, None)
        forms["int4_q4_1"] = (q4_1, q4_1.num_bytes)
        forms["int8_q8_0"] = (q8_0, q8_0.num_bytes)
        forms["int4_q4_1_dot"] = (replace(q4_1, method=Method.DOT), q4_1.num_bytes)
        del weight
        for m in rows:
            x = torch.randn(m, width, generator=generator, device=device).to(torch.bfloat16)
            for form, (linear, num_bytes) in forms.items():
                seconds = _seconds(linear, x, repeats, rounds)
                timings.append(Timing(name, out, width, per_step, m, form, seconds, num_bytes))
        del forms, dense
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return timings


def step_table(timings: list[Timing], rows: Sequence[int]) -> list[dict[str, float]]:
    """Per row count: each form's step matrices in ms and the weights' GB/s at that speed."""
    table = []
    for m in rows:
        line = {"rows": float(m)}
        for form in FORMS:
            picked = [t for t in timings if t.rows == m and t.form == form]
            seconds = sum(t.seconds * t.per_step for t in picked)
            line[f"{form}_ms"] = seconds * 1000
            line[f"{form}_gb_s"] = sum(t.num_bytes * t.per_step for t in picked) / seconds / 1e9
        table.append(line)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.weight_kernels", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=", ".join(MODELS))
    parser.add_argument("--rows", default="1,8,64,512", help="row counts M to time")
    parser.add_argument("--repeats", type=int, default=20, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds; the median is kept")
    parser.add_argument("--json", help="also write every timing here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = [int(m) for m in args.rows.split(",")]
    lines = [
        f"weight-only kernels against bf16 F.linear on {device} (ms per step's matrices; GB/s of weights)"
    ]
    header = f"{'model':<20} {'M':>4} " + " ".join(f"{form + ' ms':>14} {'GB/s':>7}" for form in FORMS)
    header += "".join(
        f" {form.split('_')[0] + ('_dot' if form.endswith('dot') else '') + '/bf16':>13}"
        for form in FORMS[1:]
    )
    lines.append(header)
    everything: dict[str, object] = {"device": str(device), "rows": rows}
    for model in args.models.split(","):
        timings = measure_model(MODELS[model], rows, device, args.repeats, args.rounds)
        table = step_table(timings, rows)
        everything[model] = {"steps": table, "matrices": [asdict(t) for t in timings]}
        for line in table:
            cells = " ".join(f"{line[form + '_ms']:>14.3f} {line[form + '_gb_s']:>7.0f}" for form in FORMS)
            ratios = "".join(f" {line[form + '_ms'] / line['bf16_ms']:>13.2f}" for form in FORMS[1:])
            lines.append(f"{model:<20} {int(line['rows']):>4} {cells} {ratios}")
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(everything, out, indent=2)
            out.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
