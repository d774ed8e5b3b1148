"""The host KV tier: its memory (whole pages in the device pool's layout) and the page copies.

The host tier's memory and the copies in and out of it are one concept: the memory is laid out for
the copies, and nothing else reads or writes it.

A host page holds exactly what a device page holds (every layer's keys and values for `page_size`
positions), laid out as the device pool's `paged()` view with its own page count, so a run of
consecutive pages copies as one strided block per layer instead of token by token. On CUDA the
memory is pinned, so copies run asynchronously on a side stream; on the CPU it is plain memory,
taken lazily: pages the tier never uses are never resident.

Pages are copied in runs: where consecutive device pages map to consecutive host pages (the page
allocator keeps a session's pages contiguous when it can), a run is one `narrow` per side, a
strided block per layer, not a gather of tokens.

On CUDA the copies run on a side stream, ordered by events both ways, and never block the host:
- before a copy the side stream waits for the work already queued on the compute stream (the
  pages' last writer, or the step that last read pages now reused);
- after it the compute stream waits for the copy: a step that reads restored pages, or writes into
  pages just offloaded (now free), is queued behind it.
So the engine thread may free or reuse page ids at once: the GPU keeps the order. On the CPU the
copies are plain synchronous copies, the same runs. Seconds are wall time on the CPU and, on CUDA,
the events' elapsed time, settled when the copy has finished (`settle`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.attention.kv_pool import KVPool


class HostKVPool:
    """The host tier's pages, shaped as the device pool's `paged()` view with `num_pages` pages."""

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


@dataclass
class CopyCounter:
    """One direction's totals, for the worker's /metrics."""

    count: int = 0
    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0


def page_runs(sources: Sequence[int], targets: Sequence[int]) -> list[tuple[int, int, int]]:
    """(source start, target start, length) runs where both page lists are consecutive."""
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} pages copied into {len(targets)}")
    runs: list[tuple[int, int, int]] = []
    for source, target in zip(sources, targets, strict=True):
        if runs:
            s0, t0, n = runs[-1]
            if source == s0 + n and target == t0 + n:
                runs[-1] = (s0, t0, n + 1)
                continue
        runs.append((source, target, 1))
    return runs


class PageCopier:
    def __init__(self, device_pool: KVPool, host_pool: HostKVPool) -> None:
        self.device_paged = device_pool.paged()
        self.host_paged = host_pool.paged
        self.axis = device_pool.page_axis
        self.page_bytes = device_pool.page_bytes
        device = device_pool.device
        # torch's CUDA stream and event constructors are untyped.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.offloaded = CopyCounter()
        self.restored = CopyCounter()
        # CUDA: (counter, start event, end event) of copies whose time is not yet settled.
        self._timing: list[tuple[CopyCounter, torch.cuda.Event, torch.cuda.Event]] = []

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self._copy(self.device_paged, device_pages, self.host_paged, host_pages, self.offloaded)

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        self._copy(self.host_paged, host_pages, self.device_paged, device_pages, self.restored)

    def settle(self) -> None:
        """Add the elapsed time of finished CUDA copies to their counters (no-op on the CPU)."""
        pending = []
        for counter, start, end in self._timing:
            if end.query():  # type: ignore[no-untyped-call]
                counter.seconds += start.elapsed_time(end) / 1000.0
            else:
                pending.append((counter, start, end))
        self._timing = pending

    def _copy(
        self,
        source: torch.Tensor,
        source_pages: Sequence[int],
        target: torch.Tensor,
        target_pages: Sequence[int],
        counter: CopyCounter,
    ) -> None:
        runs = page_runs(source_pages, target_pages)
        counter.count += 1
        counter.pages += len(source_pages)
        counter.bytes += len(source_pages) * self.page_bytes
        if self.stream is None:
            started = time.perf_counter()
            for source_start, target_start, length in runs:
                target.narrow(self.axis, target_start, length).copy_(
                    source.narrow(self.axis, source_start, length)
                )
            counter.seconds += time.perf_counter() - started
            return
        compute = torch.cuda.current_stream(self.stream.device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            blocks = zip(page_blocks(source, self.axis), page_blocks(target, self.axis), strict=True)
            for source_block, target_block in blocks:
                for source_start, target_start, length in runs:
                    target_block.narrow(0, target_start, length).copy_(
                        source_block.narrow(0, source_start, length), non_blocking=True
                    )
            end.record(self.stream)
        compute.wait_event(end)
        self._timing.append((counter, start, end))

    def wait_for_host(self) -> None:
        """Wait until no queued copy still reads or writes the host tier: before the host itself
        reads or writes its pages (a drain's KV copy, leaving or arriving). A page freed by a
        restore is free at once for the GPU's copies (stream order), not for the host's."""
        if self.stream is not None:
            self.stream.synchronize()


def page_blocks(paged: torch.Tensor, axis: int) -> list[torch.Tensor]:
    """`paged` as the blocks that are contiguous from its page axis on, one per index of the axes
    before it (a layer's keys, its values; with `nhd` on CUDA 2 per layer): a run of pages in a
    block is one contiguous range on either side, so its copy between the device and pinned memory
    is a single asynchronous transfer. The whole run at once is strided, and torch would stage it
    through pageable host memory: synchronous, waiting for every queued step."""
    return list(paged.flatten(0, axis - 1).unbind(0)) if axis > 0 else [paged]
