"""Paged attention for the CPU in one C call per layer (cpu_kernel.c, the `_cpu_kernel` extension pip
builds); `auto`'s choice on a CPU with AVX2, FMA and F16C. Its pool holds float32, or float16
(`--kv-dtype`, worker/attention/kv_dtype.py), computed on as float32 either way, or float16 values
beside int8 keys scored in integers (worker/attention/int8_kv.py).

It reads the same head-major pool as the torch reference (so a KV copy or a host-tier page means the
same bytes under either backend) straight from the rows' pages, with no gather, no padding and no
per-layer buffers: a decode step's attention through torch is a dozen small ops per layer, and on a
2-core CPU those ops, not the arithmetic, were half of SmolLM2's step (docs/benchmarks.md).

The engine's promise holds by construction (cpu_kernel.c's header): each query token's sums, per KV
head, run in position order whatever queries share its job, so a query's output is the same bits
whether its history came in one step or many, alone or in a batch, on one thread or two. Its
numbers are not the torch reference's bits (another summation order, another exp); the start-up
check holds it to them within self_check.py's tolerance, as any other backend.
"""

from __future__ import annotations

from functools import cached_property
from typing import ClassVar

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from worker.attention.int8_kv import PAGE_MULTIPLE
from worker.native import load_extension

# KERNEL is None where it does not run, and UNAVAILABLE_REASON says why (empty where it runs).
KERNEL, UNAVAILABLE_REASON = load_extension("worker.attention._cpu_kernel", needs="AVX2, FMA or F16C")


class CpuAttention(AttentionBackend):
    name = "cpu"
    kv_layout = "head_major"

    # The kernel's AVX-512 path where the CPU has it (the same bits as its AVX2 path; a test turns it off
    # to compare the two).
    WIDE: ClassVar[bool] = True

    # The step's row metadata, int32 and contiguous, kept alive while the layers pass their addresses
    # (`_row_args`: those addresses and the row count, as every layer's call passes them).
    _rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _row_args: tuple[int, int, int, int, int] | None = None

    @classmethod
    def unavailable(cls, shape: AttentionShape) -> str | None:
        if KERNEL is None:
            return UNAVAILABLE_REASON
        if shape.device.type != "cpu" or shape.dtype != torch.float32:
            return f"it runs float32 on the CPU only, not {shape.dtype} on {shape.device.type}"
        if shape.pool_dtype not in (torch.float32, torch.float16):
            return f"its KV pool holds float32 or float16, not {shape.pool_dtype}"
        if shape.int8_keys and (shape.pool_dtype != torch.float16 or shape.page_size % PAGE_MULTIPLE):
            return f"its int8 keys sit in a float16 pool of pages of a multiple of {PAGE_MULTIPLE}"
        if shape.int8_values and not shape.int8_keys:
            return "its int8 values come with int8 keys"
        group = shape.num_heads // shape.num_kv_heads
        if shape.head_dim % 32 or not 32 <= shape.head_dim <= 256 or group > 16:
            return (
                f"it takes head_dim a multiple of 32 up to 256 (not {shape.head_dim}) and at most 16 query "
                f"heads per KV head (not {group})"
            )
        return None

    @cached_property
    def _layer_pools(self) -> tuple[tuple[int, int], ...]:
        """Each layer's key and value addresses, fixed with the pool: asked of torch once, not on every
        layer call."""
        pool = self.kv_pool
        return tuple(
            (pool.keys(i).data_ptr(), pool.values(i).data_ptr()) for i in range(pool.buffer.shape[0])
        )

    def plan(self, meta: AttentionMetadata) -> None:
        rows = (
            meta.qo_indptr.to(torch.int32).contiguous(),
            torch.tensor(meta.kv_lens, dtype=torch.int32),
            meta.kv_page_indptr.to(torch.int32).contiguous(),
            meta.kv_page_indices.to(torch.int32).contiguous(),
        )
        self._rows = rows
        self._row_args = (
            rows[0].data_ptr(),
            rows[1].data_ptr(),
            rows[2].data_ptr(),
            rows[3].data_ptr(),
            len(meta.kv_lens),
        )

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = _heads_contiguous(q), _heads_contiguous(k), _heads_contiguous(v)
        tokens = q.shape[0]
        out = q.new_empty(tokens, self.num_heads, self.head_dim)
        self.attend_at(
            layer,
            (q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0)),
            tokens,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def attend_at(
        self, layer: int, qkv: tuple[int, int, int, int, int, int], tokens: int, out_at: int, threads: int
    ) -> None:
        """forward by address: `qkv` is q's, k's and v's address and token stride (in floats), each
        token's heads contiguous, float32; out [tokens, heads, head_dim] float32 contiguous."""
        assert KERNEL is not None, "CpuAttention is chosen only where its kernel runs"
        row_args = self._row_args
        assert row_args is not None, "plan() must run before forward()"
        keys, values = self._layer_pools[layer]
        pool = self.kv_pool
        KERNEL.attend(
            *qkv,
            tokens,
            keys,
            values,
            pool.num_pages * pool.page_size,
            *row_args,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            pool.page_size,
            out_at,
            threads,
            pool.buffer.dtype == torch.float16,
            self.WIDE,
            pool.int8_keys,
            pool.int8_values,
        )


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim] float32 with each token's heads contiguous (any token stride), as the
    kernel reads it: the model's q, k, v are views of the fused projection with such strides."""
    x = x.float()
    heads, dim = x.shape[1], x.shape[2]
    if x.stride(2) == 1 and x.stride(1) == dim and x.stride(0) >= heads * dim:
        return x
    return x.contiguous()
