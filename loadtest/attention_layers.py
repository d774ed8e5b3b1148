"""What one step's attention costs over a model's layers, per backend (the CPU kernel's figures in
docs/benchmarks.md):

    python -m loadtest.attention_layers --shape tiny --rows 1 --queries 48 --context 6000
    python -m loadtest.attention_layers --shape smollm2-135m-shape --queries 1 --context 5300 \
        --kv-dtype float32,float16,int8-keys,int8

`--rows` sessions of `--context` positions each (pages scattered through the pool, as sessions
leave them), then one step that feeds `--queries` new tokens to every row (1: a decode step; 48: a
streamed chunk's append): the backend's plan and, for every layer of `--shape`, its KV write and
attention, on `--threads` intra-op threads, with the pool in each of `--kv-dtype` (`auto`: as a
quantised weight form's worker resolves it under that backend, worker/attention/kv_dtype.py).
Printed per backend and KV form: the median and the fastest of `--repeats` steps in ms, and the
multiply-adds a second the fastest reached (scores and weighted values, each query against the keys
it sees). Random K, V and queries: only the numbers matter.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata

_PAGE = 16
_CPU = torch.device("cpu")


def _step_times(
    attention: AttentionBackend,
    meta: AttentionMetadata,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    layers: int,
    repeats: int,
) -> list[float]:
    """Each step's ms (plan, then every layer's KV write and attention), sorted; one step first."""

    def step() -> None:
        attention.plan(meta)
        for layer in range(layers):
            attention.forward(layer, *qkv)

    step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)


def run(
    shape_name: str,
    *,
    backends: list[str],
    rows: int,
    queries: int,
    context: int,
    threads: int,
    repeats: int,
    kv_dtypes: tuple[str, ...] = ("float32",),
) -> dict[str, Any]:
    from worker.attention import paged_attention
    from worker.attention.base import paged_metadata
    from worker.attention.int8_kv import pack_pages, pack_value_pages
    from worker.attention.kv_dtype import choose_kv_form
    from worker.model.presets import SHAPES

    config = SHAPES[shape_name]
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    pages_each = -(-(context + queries) // _PAGE)
    generator = torch.Generator().manual_seed(0)
    # Row r's page j is pool page j * rows + r: every row's pages interleaved with the others'.
    tables = [[j * rows + r for j in range(pages_each)] for r in range(rows)]
    meta = paged_metadata([context] * rows, [queries] * rows, tables, _PAGE)
    tokens = rows * queries
    q = torch.randn(tokens, heads, dim, generator=generator)
    k = torch.randn(tokens, kv_heads, dim, generator=generator)
    v = torch.randn(tokens, kv_heads, dim, generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    results: dict[str, Any] = {}
    try:
        for name in backends:
            for kv_dtype_name in kv_dtypes:
                # as a quantised weight form's worker resolves the setting (`auto`: int8 under `cpu`)
                form = choose_kv_form(
                    kv_dtype_name,
                    device=_CPU,
                    dtype=torch.float32,
                    weight_form="int4",
                    attention=name,
                    page_size=_PAGE,
                )
                shape = form.attention_shape(config, device=_CPU, dtype=torch.float32, page_size=_PAGE)
                attention = paged_attention(
                    name, shape, num_layers=config.num_layers, num_pages=rows * pages_each
                )
                pool = attention.kv_pool
                pool.buffer.normal_(generator=generator)  # the history's keys and values

                def fill(slots: torch.Tensor, pack: Callable[[torch.Tensor], torch.Tensor]) -> None:
                    """One layer's key or value slots as the kernel writes random int8 rows there."""
                    random_rows = torch.randn(kv_heads, rows * pages_each, _PAGE, dim, generator=generator)
                    slots.view(torch.uint8).view(kv_heads, rows * pages_each, -1).copy_(pack(random_rows))

                # the keys (and values) as the kernel writes them, where the pool holds them as int8
                for layer in range(config.num_layers if form.int8_keys else 0):
                    fill(pool.keys(layer), pack_pages)
                    if form.int8_values:
                        fill(pool.values(layer), pack_value_pages)
                times = _step_times(attention, meta, (q, k, v), config.num_layers, repeats)
                # Query j of a row sees context + j + 1 keys; scores and weighted values: 2 x dim each.
                seen = rows * sum(context + j + 1 for j in range(queries))
                macs = 2 * seen * heads * dim * config.num_layers
                results[f"{attention.name} {kv_dtype_name}"] = {
                    "median_ms": round(times[len(times) // 2], 2),
                    "fastest_ms": round(times[0], 2),
                    "gmac_per_s": round(macs / times[0] / 1e6, 1),
                }
    finally:
        torch.set_num_threads(before)
    return {
        "shape": shape_name,
        "rows": rows,
        "queries": queries,
        "context": context,
        "threads": threads,
        "backends": results,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.attention_layers", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--shape", default="tiny", help="a model shape of worker/model/presets.py's SHAPES")
    parser.add_argument("--attention", default="cpu,torch", help="comma-separated backends")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--queries", type=int, default=48, help="new tokens per row (1: a decode step)")
    parser.add_argument("--context", type=int, default=6000, help="positions each row holds before the step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--kv-dtype", default="float32", help="comma-separated: auto, float32, float16, int8-keys, int8"
    )
    args = parser.parse_args(argv)
    result = run(
        args.shape,
        backends=args.attention.split(","),
        rows=args.rows,
        queries=args.queries,
        context=args.context,
        threads=args.threads,
        repeats=args.repeats,
        kv_dtypes=tuple(args.kv_dtype.split(",")),
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
