"""Where a decode step's time goes (#32, point 2): the step whole, then each part alone.

    python -m loadtest.step_split [--model smollm2-135m] [--weights auto] [--context 560]

One session of `--context` positions on the paged torch backend, then one-token steps (plan,
forward, logits of the row, argmax), as the engine runs a decode step. Printed, in ms (median and
10th percentile of `--repeats`):

- `step_1_thread` and `step_2_threads`: the whole step on 1 and on 2 intra-op threads, thread CPU
  time of the calling thread and wall time, the two thread counts alternating (the engine's
  single-thread rule, worker/engine/model_runner.py, picks between them by the step's size); then
  the same for an append of `--append` tokens (a micro-turn's chunk) after the context;
- the parts on 1 thread, each timed alone on the same weights and KV: the layer matrices (every
  layer's linears at one row), the output projection, attention (plan and every layer's KV write
  and attend), the elementwise ops (embedding, and the model's row ops: norms, RoPE, SiLU, residual
  adds, worker/model/row_ops.py), and what is left
  of the step (Python between ops, sampling's argmax, the allocator).

Thread CPU time is what to compare under load (other processes take wall time, not CPU time); the
2-thread wall time means something only on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import torch

_PAGE = 16
_CPU = torch.device("cpu")


def _times(run: Callable[[], object], repeats: int) -> tuple[list[float], list[float]]:
    run()
    cpu, wall = [], []
    for _ in range(repeats):
        started_cpu, started_wall = time.thread_time(), time.perf_counter()
        run()
        cpu.append((time.thread_time() - started_cpu) * 1e3)
        wall.append((time.perf_counter() - started_wall) * 1e3)
    return cpu, wall


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": round(ordered[len(ordered) // 2], 2), "p10": round(ordered[len(ordered) // 10], 2)}


def run(
    model_name: str,
    *,
    weights: str,
    attention_name: str,
    context: int,
    append: int,
    repeats: int,
    kv_dtype_name: str = "auto",
) -> dict[str, Any]:
    from worker.attention import paged_attention
    from worker.attention.base import paged_metadata
    from worker.attention.kv_dtype import choose_kv_form
    from worker.model.llama import LlamaModel
    from worker.model.loader import load_model

    threads_before = torch.get_num_threads()
    loaded = load_model(model_name, device=_CPU, dtype=torch.float32, weights=weights)
    config = loaded.config
    model = LlamaModel(config, loaded.weights, device=_CPU, dtype=torch.float32)
    pages = list(range(-(-(context + append) // _PAGE)))
    kv_form = choose_kv_form(
        kv_dtype_name,
        device=_CPU,
        dtype=torch.float32,
        weight_form=loaded.weights.form,
        attention=attention_name,
        page_size=_PAGE,
    )
    shape = kv_form.attention_shape(config, device=_CPU, dtype=torch.float32, page_size=_PAGE)
    attention = paged_attention(attention_name, shape, num_layers=config.num_layers, num_pages=len(pages))
    ids = torch.randint(
        0, min(5000, config.vocab_size), (context + append,), generator=torch.Generator().manual_seed(0)
    )
    attention.plan(paged_metadata([0], [context], [pages], _PAGE))
    model.forward(ids[:context], torch.arange(context), attention)
    position = torch.tensor([context])

    def step(tokens: int = 1) -> int:
        attention.plan(paged_metadata([context], [tokens], [pages], _PAGE))
        positions = torch.arange(context, context + tokens)
        hidden = model.forward(ids[context : context + tokens], positions, attention)
        return int(model.logits(hidden[-1:]).argmax(dim=-1)[0])

    result: dict[str, Any] = {
        "model": model_name,
        "weights": loaded.weights.form,
        "row_ops": type(model.row_ops).__name__,
        "attention_backend": attention.name,
        "kv_dtype": kv_form.name,
        "context": context,
    }
    for tokens, label in ((1, "step"), (append, f"append_{append}")):
        by_threads: dict[int, tuple[list[float], list[float]]] = {1: ([], []), 2: ([], [])}
        for turn in range(repeats):
            for threads in (1, 2) if turn % 2 == 0 else (2, 1):
                torch.set_num_threads(threads)
                cpu, wall = _times(functools.partial(step, tokens), 1)
                by_threads[threads][0].extend(cpu)
                by_threads[threads][1].extend(wall)
        for threads, (cpu, wall) in by_threads.items():
            name = f"{label}_{threads}_thread{'s' if threads > 1 else ''}"
            result[name] = {"thread_cpu": _summary(cpu), "wall": _summary(wall)}

    torch.set_num_threads(1)
    row = torch.randn(1, config.hidden_size)
    wide = torch.randn(1, config.intermediate_size)
    layers = loaded.weights.layers

    def matrices() -> None:
        for layer in layers:
            layer.qkv(row)
            layer.o_proj(row)
            layer.gate_up(row)
            layer.down(wide)

    query = torch.randn(1, config.num_heads, config.head_dim)
    key = torch.randn(1, config.num_kv_heads, config.head_dim)

    def attend() -> None:
        attention.plan(paged_metadata([context], [1], [pages], _PAGE))
        for index in range(config.num_layers):
            attention.forward(index, query, key, key)

    cos, sin = model.rope.tables(position)
    qkv = torch.randn(1, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim)
    gate_up = torch.randn(1, 2 * config.intermediate_size)
    ops = model.row_ops  # the model's own: torch's under `float`, the native ones for a quantised form

    def elementwise() -> None:
        x = loaded.weights.embed(ids[context : context + 1])
        ops.norm(x, layers[0].input_norm)
        for index, layer in enumerate(layers):
            ops.rotate(qkv, cos, sin)
            x, _ = ops.add_norm(x, row, layer.post_attention_norm)
            ops.silu_mul(gate_up)
            norm = loaded.weights.final_norm if index + 1 == len(layers) else layers[index + 1].input_norm
            x, _ = ops.add_norm(x, row, norm)

    parts = {
        "layer_matrices": matrices,
        "output_projection": lambda: model.logits(row),
        "attention": attend,
        "elementwise": elementwise,
    }
    medians = {}
    for name, part in parts.items():
        cpu, _wall = _times(part, repeats)
        result[name] = _summary(cpu)
        medians[name] = result[name]["median"]
    result["rest"] = round(result["step_1_thread"]["thread_cpu"]["median"] - sum(medians.values()), 2)
    torch.set_num_threads(threads_before)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.step_split", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--attention", default="auto", help="auto, torch or cpu (worker/attention)")
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        help="auto, float32, float16, int8-keys or int8 (worker/attention/kv_dtype.py)",
    )
    parser.add_argument("--context", type=int, default=560)
    parser.add_argument("--append", type=int, default=33, help="tokens of the append step timed")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    print(
        json.dumps(
            run(
                args.model,
                weights=args.weights,
                attention_name=args.attention,
                context=args.context,
                append=args.append,
                repeats=args.repeats,
                kv_dtype_name=args.kv_dtype,
            ),
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
