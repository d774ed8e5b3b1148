"""The KV tensor pool: every layer's keys and values in fixed pages, allocated once at start.

Page ids come from `worker.engine.memory.page_allocator`; this module only owns the memory. Page p holds
slots p * page_size ... (p + 1) * page_size - 1 in either layout; each attention backend picks the
layout it reads best:
- `nhd`: per layer [num_pages, page_size, num_kv_heads, head_dim] for K and for V, the paged layout
  flashinfer takes as its (k, v) cache;
- `head_major`: per layer [num_kv_heads, num_pages * page_size, head_dim]: a session on consecutive
  pages is one contiguous matrix per head, which plain torch matmuls read in place.
"""

from __future__ import annotations

import math
import threading
from typing import Literal

import torch

from shared.settings import KV_INT8, KV_INT8_KEYS
from worker.attention.int8_kv import PAGE_MULTIPLE
from worker.mapped_zeros import mapped_zeros

KVLayout = Literal["nhd", "head_major"]


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
        layout: KVLayout = "nhd",
        int8_keys: bool = False,
        int8_values: bool = False,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"the KV pool needs at least one page of one token ({num_pages} x {page_size})")
        if int8_keys and (dtype != torch.float16 or layout != "head_major" or page_size % PAGE_MULTIPLE):
            raise ValueError(
                f"{KV_INT8_KEYS} keeps a head-major float16 pool of pages of a multiple of {PAGE_MULTIPLE} "
                f"(not {dtype}, {layout}, {page_size})"
            )
        if int8_values and not int8_keys:
            raise ValueError(f"int8 values come with int8 keys ({KV_INT8})")
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = layout
        # Whether the key slots hold the int8-keys form (worker/attention/int8_kv.py): what the
        # attention backend writes and reads there; everything else moves the pages' bytes as they are.
        self.int8_keys = int8_keys
        self.int8_values = int8_values  # the value slots too (the `int8` form)
        per_layer = (
            (num_pages, page_size, num_kv_heads, head_dim)
            if layout == "nhd"
            else (num_kv_heads, num_pages * page_size, head_dim)
        )
        shape = (num_layers, 2, *per_layer)
        # Zeros, not garbage (a backend may read a page's unwritten slots, masked). On the CPU the pool
        # is mapped as zeros and made resident in the background at idle priority, not written at
        # start: a worker restarting beside another one on the same cores no longer takes a core from
        # its turns for seconds (worker/mapped_zeros.py). `resident` is set once it is. In 2 MiB pages
        # where the kernel gives them: a step reads its rows' pages scattered over the pool.
        if device.type == "cpu":
            host = mapped_zeros(math.prod(shape), dtype, huge_pages=True)
            self.buffer = host.tensor.view(shape)
            self.resident = host.resident
        else:
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
            self.resident = threading.Event()
            self.resident.set()
        # Every layer's views, made once: a step asks for them once per layer, and indexing the
        # buffer costs more host time than the small ops of a decode step's attention.
        self._keys = tuple(self.buffer[layer, 0] for layer in range(num_layers))
        self._values = tuple(self.buffer[layer, 1] for layer in range(num_layers))

    def keys(self, layer: int) -> torch.Tensor:
        return self._keys[layer]

    def values(self, layer: int) -> torch.Tensor:
        return self._values[layer]

    @property
    def page_axis(self) -> int:
        """The axis of `paged()` that indexes pages."""
        return 2 if self.layout == "nhd" else 3

    def paged(self) -> torch.Tensor:
        """The whole pool with an explicit page axis (a view, no copy): `nhd` [L, 2, P, page, H, D],
        `head_major` [L, 2, H, P, page, D]. The host tier copies whole pages along this axis."""
        if self.layout == "nhd":
            return self.buffer
        layers, two, heads, _slots, head_dim = self.buffer.shape
        return self.buffer.view(layers, two, heads, self.num_pages, self.page_size, head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer, keys and values."""
        return self.num_bytes // self.num_pages

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def pending_bytes(self) -> int:
        """Bytes mapped but not yet made resident (counted whole while any are): what the host's
        available memory still counts as free although this pool will take it."""
        return 0 if self.resident.is_set() else self.num_bytes
