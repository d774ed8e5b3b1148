"""The host KV tier's memory: whole pages in the device pool's own page layout.

A host page holds exactly what a device page holds (every layer's keys and values for `page_size`
positions), laid out as the device pool's `paged()` view with its own page count, so a run of
consecutive pages copies as one strided block per layer instead of token by token. On CUDA the
memory is pinned, so copies run asynchronously on a side stream (worker/engine/memory/page_copy.py);
on the CPU it is plain memory, taken lazily: pages the tier never uses are never resident.
"""

from __future__ import annotations

import torch

from worker.attention.kv_pool import KVPool


class HostKVPool:
    def __init__(self, device_pool: KVPool, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("a host tier needs at least one page (0 turns the tier off)")
        self.num_pages = num_pages
        self.page_axis = device_pool.page_axis
        self.page_bytes = device_pool.page_bytes
        shape = list(device_pool.paged().shape)
        shape[self.page_axis] = num_pages
        pin = device_pool.device.type == "cuda"
        # empty, not zeros: unlike the device pool, the host tier is read only where it was written.
        self.paged = torch.empty(shape, dtype=device_pool.buffer.dtype, device="cpu", pin_memory=pin)

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.page_bytes
