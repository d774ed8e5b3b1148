"""The one interface every attention backend implements, and the metadata they are all fed.

A step's batch is ragged: row i feeds q_lens[i] new tokens of one session whose KV (after this
step's tokens are written) spans kv_lens[i] tokens in pages
kv_page_indices[kv_page_indptr[i]:kv_page_indptr[i + 1]]. The causal mask is aligned bottom-right:
query j of row i sees keys k <= kv_lens[i] - q_lens[i] + j, i.e. a chunk attends to the whole
session before it. Positions equal KV indices (position p lives in page p // page_size, slot
p % page_size of that row's page list).

The metadata lives on the host: the model runner builds it from its page tables with no device
involved, and each backend's `plan` derives what its kernels need there, then copies it to the KV
pool's device in one transfer. So a step never reads a device tensor back to decide anything (on
CUDA such a read waits for the GPU's queue to drain). The host-to-device copies themselves are
still plain copies from pageable memory, which CUDA completes before returning; pinned staging
buffers and non-blocking copies belong to the GPU work, which has not run on a GPU yet.

`plan` runs once per step; `forward` runs once per layer and reuses the plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from worker.attention.kv_pool import KVLayout, KVPool


@dataclass(frozen=True)
class AttentionMetadata:
    # Every tensor here is on the host (CPU memory), whatever device the step runs on.
    qo_indptr: torch.Tensor  # [rows + 1] int32
    kv_page_indptr: torch.Tensor  # [rows + 1] int32
    kv_page_indices: torch.Tensor  # [sum of pages] int32
    kv_last_page_len: torch.Tensor  # [rows] int32; 1 <= len <= page_size
    positions: torch.Tensor  # [tokens] int64
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    @property
    def is_decode(self) -> bool:
        """Every row feeds exactly one token: the shape CUDA graphs capture."""
        return all(n == 1 for n in self.q_lens)


@dataclass(frozen=True)
class AttentionShape:
    """What choosing and checking a backend needs to know of the model and the pool."""

    device: torch.device
    dtype: torch.dtype  # the model's: what the queries and outputs are
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_dtype: torch.dtype | None = None  # the KV pool's (worker/attention/kv_dtype.py); None: `dtype`
    int8_keys: bool = False  # its key slots hold the int8-keys form (worker/attention/int8_kv.py)
    int8_values: bool = False  # (with int8_keys) its value slots hold int8 values too

    @property
    def pool_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


def paged_metadata(
    starts: Sequence[int], q_lens: Sequence[int], page_tables: Sequence[Sequence[int]], page_size: int
) -> AttentionMetadata:
    """A step's metadata on the host: row i feeds q_lens[i] tokens after starts[i] cached ones, its KV
    in the first pages of page_tables[i] (which must cover starts[i] + q_lens[i] tokens)."""
    kv_lens = tuple(start + q_len for start, q_len in zip(starts, q_lens, strict=True))
    qo_indptr = [0]
    page_indptr = [0]
    page_indices: list[int] = []
    last_page_len = []
    positions: list[int] = []
    for start, q_len, kv_len, pages in zip(starts, q_lens, kv_lens, page_tables, strict=True):
        num_pages = (kv_len + page_size - 1) // page_size
        if num_pages > len(pages):
            raise RuntimeError(f"row needs {num_pages} pages but its table has {len(pages)}")
        qo_indptr.append(qo_indptr[-1] + q_len)
        page_indices.extend(pages[:num_pages])
        page_indptr.append(len(page_indices))
        last_page_len.append(kv_len - (num_pages - 1) * page_size)
        positions.extend(range(start, kv_len))
    return AttentionMetadata(
        qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32),
        kv_page_indptr=torch.tensor(page_indptr, dtype=torch.int32),
        kv_page_indices=torch.tensor(page_indices, dtype=torch.int32),
        kv_last_page_len=torch.tensor(last_page_len, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64),
        q_lens=tuple(q_lens),
        kv_lens=kv_lens,
    )


class AttentionBackend(ABC):
    name: ClassVar[str]
    # The KV pool layout this backend reads; the model runner allocates the pool in it.
    kv_layout: ClassVar[KVLayout]

    @classmethod
    def unavailable(cls, shape: AttentionShape) -> str | None:
        """Why this backend cannot serve `shape` on this machine (a kernel not built, a CPU feature or
        a dtype it lacks), else None. Asked before the start-up check; `auto` passes over a backend
        that says why."""
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
        """`dtype` is the model's, which the queries, outputs and arithmetic are in (None: the pool's);
        the pool may hold its keys and values narrower (`AttentionShape.kv_dtype`)."""
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype or kv_pool.buffer.dtype

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare everything the step's layers share (write slots, gather indices, masks)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this step's k, v ([tokens, kv_heads, dim]) into the pool and attend.

        Returns [tokens, heads, dim].
        """
