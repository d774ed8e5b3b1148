"""The KV tensor pool: every layer's keys and values in fixed pages, allocated once at start.

Page ids come from `worker.engine.page_allocator`; this module only owns the memory. Layout per
layer is NHD, [num_pages, page_size, num_kv_heads, head_dim], separately for K and V: the layout
both attention backends read (flashinfer takes the (k, v) pair as its paged cache).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"KV pool needs at least one page of at least one token (got {num_pages} x {page_size})"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.buffer = torch.zeros(
            (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    def keys(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @staticmethod
    def bytes_per_page(
        *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )
