"""flashinfer paged attention (the CUDA backend), a thin layer over the engine's paged metadata.

The engine's `AttentionMetadata` is already flashinfer's paged format: `qo_indptr`, the page
indptr, the page indices and the last pages' lengths, with a sequence length of
(pages - 1) * page_size + last_page_len that already counts this step's tokens. So a step is:

- `plan` (once per step): one host-to-device copy of the int32 arrays the kernels read on the
  device (page indices and indptr, last page lengths, each new token's row and position), and one
  `BatchPrefillWithPagedKVCacheWrapper.plan` with `causal=True`. flashinfer aligns the causal mask
  bottom-right (query i of a row with q new tokens over kv keys sees keys j <= kv - q + i), which is
  exactly "a chunk attends to the whole session before it". `plan` reads the indptr arrays on the
  host, so they are passed as the host tensors the metadata already holds.
- `forward` (once per layer): `append_paged_kv_cache` writes the step's k and v into the layer's
  NHD pages, then the wrapper's `run` attends.

flashinfer is imported here and nowhere else, when the backend is built (on CUDA, or where the
tests put a reference of its API in its place): `import flashinfer` has broken on CPU-only torch.
Its kernels take head dims 64, 128 and 256 and one q/kv dtype (bf16 or fp16 on CUDA), planned
explicitly because `plan` defaults to float16 and `run` refuses a mismatch.

Status: written against flashinfer-python 0.7.2.post1's API (scripts/check_flashinfer_api.py holds
every call here against the wheel's source), run on the CPU through a reference of that API, and
compared with the torch backend at every start on CUDA (worker/attention/self_check.py); it has
never run on a GPU in this project.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from worker.attention.kv_pool import KVPool

# The split-k scratch space flashinfer's documentation recommends for the prefill wrapper.
WORKSPACE_BYTES: Final = 128 * 2**20
SUPPORTED_HEAD_DIMS: Final = (64, 128, 256)
# What its CUDA kernels compute in (the CPU reference the tests use takes float32 too).
CUDA_DTYPES: Final = (torch.bfloat16, torch.float16)


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"
    kv_layout = "nhd"

    @classmethod
    def unavailable(cls, shape: AttentionShape) -> str | None:
        if shape.int8_keys:
            return "it reads keys and values as floats; the int8 forms are the cpu attention kernel's"
        if shape.pool_dtype != shape.dtype:
            return f"its KV pool holds the model's dtype ({shape.dtype}), not {shape.pool_dtype}"
        return None

    def __init__(
        self,
        kv_pool: KVPool,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        if dtype is not None and dtype != kv_pool.buffer.dtype:
            raise ValueError(f"flashinfer computes in its pool's dtype ({kv_pool.buffer.dtype}), not {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"flashinfer's kernels take head_dim {SUPPORTED_HEAD_DIMS}, not {head_dim}")
        dtype = kv_pool.buffer.dtype
        if kv_pool.device.type == "cuda" and dtype not in CUDA_DTYPES:
            raise ValueError(f"flashinfer's kernels take bfloat16 or float16, not {dtype} (--dtype bfloat16)")
        super().__init__(kv_pool, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        self._flashinfer: Any = importlib.import_module("flashinfer")
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self._wrapper: Any = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            float_workspace_buffer=workspace, kv_layout="NHD"
        )
        # This step's device arrays for `append_paged_kv_cache`, set by `plan`.
        self._append: tuple[torch.Tensor, ...] | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        pool = self.kv_pool
        rows = torch.arange(meta.num_rows, dtype=torch.int32)
        batch_indices = torch.repeat_interleave(rows, torch.tensor(meta.q_lens, dtype=torch.int64))
        host = (
            meta.kv_page_indices,
            meta.kv_page_indptr,
            meta.kv_last_page_len,
            batch_indices,
            meta.positions.to(torch.int32),
        )
        on_device = torch.split(torch.cat(host).to(pool.device), [len(part) for part in host])
        indices, indptr, last_page_len, token_rows, token_positions = on_device
        self._append = (token_rows, token_positions, indices, indptr, last_page_len)
        dtype = pool.buffer.dtype
        self._wrapper.plan(
            qo_indptr=meta.qo_indptr,
            paged_kv_indptr=meta.kv_page_indptr,
            paged_kv_indices=indices,
            paged_kv_last_page_len=meta.kv_last_page_len,
            num_qo_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim_qk=self.head_dim,
            page_size=pool.page_size,
            causal=True,
            q_data_type=dtype,
            kv_data_type=dtype,
        )

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self._append is not None, "plan() must run before forward()"
        token_rows, token_positions, indices, indptr, last_page_len = self._append
        cache = (self.kv_pool.keys(layer), self.kv_pool.values(layer))
        self._flashinfer.append_paged_kv_cache(
            append_key=k,
            append_value=v,
            batch_indices=token_rows,
            positions=token_positions,
            paged_kv_cache=cache,
            kv_indices=indices,
            kv_indptr=indptr,
            kv_last_page_len=last_page_len,
            kv_layout="NHD",
        )
        out: torch.Tensor = self._wrapper.run(q=q, paged_kv_cache=cache)
        return out
