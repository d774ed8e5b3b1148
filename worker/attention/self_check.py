"""Checks an attention backend against the torch reference before a worker serves with it.

A backend that has never run on this machine's GPU (flashinfer, in this project) must not be
trusted on its build alone: a kernel compiled for another architecture, a changed API, a wrong
layout all give plausible-looking garbage. So at start the worker runs one small ragged batch
through the candidate and through `TorchAttention` in float32 and compares every output.

The batch covers what a step can hold: a prefill, an append after cached tokens, a decode row; rows
crossing page boundaries and ending mid-page; pages out of order; GQA when the model has it. It runs
two steps (write a context, then append to it) so the candidate reads KV it wrote itself.
"""

from __future__ import annotations

import logging
from typing import Final

import torch

from worker.attention.base import AttentionBackend, AttentionShape, paged_metadata
from worker.attention.int8_kv import QUERY_LEVELS, through_rounding
from worker.attention.kv_pool import KVPool
from worker.attention.torch_backend import TorchAttention

logger = logging.getLogger(__name__)

# Per dtype, how far the candidate's outputs may stand from float32 torch (atol = rtol): a bf16
# output carries 8 bits of mantissa, so its rounding alone is ~4e-3 of the value.
TOLERANCE: Final = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
_SEED: Final = 20240607


def _batch(page_size: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Page tables (out of order, room to spare) and each row's (cached, appended) tokens per step."""
    tables = [[5, 2, 9], [0, 7, 3, 11], [4, 1, 6]]
    # (context written by step 1, tokens appended by step 2): a decode row, an append that crosses
    # a page boundary, a long append ending mid-page.
    steps = [(page_size + 3, 1), (page_size - 2, 5), (1, 2 * page_size + 1)]
    return tables, steps


def _run(
    backend: AttentionBackend,
    pool: KVPool,
    tables: list[list[int]],
    steps: list[tuple[int, int]],
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> list[torch.Tensor]:
    outputs = []
    for step, (q, k, v) in enumerate(inputs):
        starts = [0 if step == 0 else cached for cached, _ in steps]
        q_lens = [cached if step == 0 else added for cached, added in steps]
        backend.plan(paged_metadata(starts, q_lens, tables, pool.page_size))
        outputs.append(backend.forward(0, q, k, v).float().cpu())
    return outputs


def compare_with_torch(backend: type[AttentionBackend], shape: AttentionShape) -> str | None:
    """None when `backend` agrees with the torch reference on the check batch, else why not."""
    device, dtype, page_size = shape.device, shape.dtype, shape.page_size
    num_heads, num_kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    tables, steps = _batch(page_size)
    num_pages = 1 + max(max(table) for table in tables)
    generator = torch.Generator().manual_seed(_SEED)
    inputs = []
    for step in range(2):
        tokens = sum(cached if step == 0 else added for cached, added in steps)
        shapes = (
            (tokens, num_heads, head_dim),
            (tokens, num_kv_heads, head_dim),
            (tokens, num_kv_heads, head_dim),
        )
        # Rounded to the candidate's dtype first (keys and values to its pool's too, where that is
        # narrower; the queries and keys (and values) through their integer rows where the pool holds int8
        # keys (and values), which the candidate then rounds again to the same integers), so both sides
        # see the same numbers; int8 values' weights are rounded too, within the tolerance.
        q, k, v = (torch.randn(s, generator=generator).to(dtype) for s in shapes)
        if shape.int8_keys:
            q, k = through_rounding(q, QUERY_LEVELS).to(dtype), through_rounding(k).to(dtype)
        else:
            k = k.to(shape.pool_dtype).to(dtype)
        v = through_rounding(v).to(dtype) if shape.int8_values else v.to(shape.pool_dtype).to(dtype)
        inputs.append((q, k, v))

    def pool(
        layout: str,
        on: torch.device,
        pool_dtype: torch.dtype,
        int8_keys: bool = False,
        int8_values: bool = False,
    ) -> KVPool:
        return KVPool(
            num_layers=1,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=pool_dtype,
            device=on,
            layout="nhd" if layout == "nhd" else "head_major",
            int8_keys=int8_keys,
            int8_values=int8_values,
        )

    reference_pool = pool(TorchAttention.kv_layout, torch.device("cpu"), torch.float32)
    expected = _run(
        TorchAttention(reference_pool, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim),
        reference_pool,
        tables,
        steps,
        [(q.float(), k.float(), v.float()) for q, k, v in inputs],
    )
    try:
        candidate_pool = pool(backend.kv_layout, device, shape.pool_dtype, shape.int8_keys, shape.int8_values)
        got = _run(
            backend(
                candidate_pool, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
            ),
            candidate_pool,
            tables,
            steps,
            [(q.to(device), k.to(device), v.to(device)) for q, k, v in inputs],
        )
    except Exception as exc:  # any failure to build or run the candidate is a failed check
        return f"{backend.name} failed on the check batch: {type(exc).__name__}: {exc}"
    tolerance = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        if want.shape != have.shape:
            where = f"in step {step + 1}, not {tuple(want.shape)}"
            return f"{backend.name} returned shape {tuple(have.shape)} {where}"
        if not torch.allclose(have, want, atol=tolerance, rtol=tolerance):
            worst = (have - want).abs().max().item()
            return (
                f"{backend.name} differs from the torch reference by up to {worst:.3g} in step {step + 1} "
                f"(tolerance {tolerance:g} for {dtype})"
            )
    return None
