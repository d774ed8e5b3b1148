"""A session's KV as whole pages that leave this worker or arrive from another (a drain's copy).

The transfer layout is page-major: page i's bytes (every layer, keys then values, in the pool's own
layout within the page) follow page i-1's, so a run of pages is one contiguous byte range and a
frame of the KV copy stream (shared/protocol/kv_copy.py) is whole pages. Pages are gathered out of
the device pool (or the host tier, for a session parked there) into one staging buffer, run by run
(`page_runs`: one strided copy per run of consecutive pages, not per page); arriving pages are
scattered into the target's pages the same way.

On CUDA the gather runs on the host tier's side stream into pinned memory, ordered by events both
ways as the tier's own copies are (worker/engine/memory/page_copy.py): it waits for the work queued
on the compute stream, and the compute stream waits for it before it can overwrite those pages, so
the engine thread never blocks; each run is made page-major on the device, then leaves in one
contiguous asynchronous copy; the sender reads the buffer once `KVExport.ready` has fired. With
no host tier (no side stream) the gather is a synchronous copy. On the CPU it is a plain copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, is_dataclass

import numpy as np
import torch

from worker.engine.memory.page_copy import page_runs
from worker.model.config import ModelConfig
from worker.model.weights import ModelWeights

# Elements of each weight tensor the model fingerprint reads (evenly strided): weights that differ
# differ almost everywhere (another seed, another file), so a sample tells them apart cheaply.
FINGERPRINT_SAMPLE: int = 4096


@dataclass
class KVExport:
    """One session's KV, gathered for another worker."""

    tokens: list[int]  # the tokens whose KV it holds (the first `len(tokens)` positions)
    data: torch.Tensor  # CPU, page-major [pages, *page shape]
    ready: torch.cuda.Event | None = None  # CUDA: fired when `data` holds the pages

    @property
    def pages(self) -> int:
        return int(self.data.shape[0])

    def payload(self) -> memoryview:
        """The pages' bytes, page-major (blocks until a CUDA gather has finished: call it off the
        event loop)."""
        if self.ready is not None:
            self.ready.synchronize()
        payload: memoryview = memoryview(self.data.view(torch.uint8).reshape(-1).numpy().data)
        return payload


def page_shape(paged: torch.Tensor, axis: int) -> list[int]:
    """The shape of one page of a paged view (`KVPool.paged()`, the host tier's), its page axis out."""
    shape = list(paged.shape)
    del shape[axis]
    return shape


def staging(paged: torch.Tensor, axis: int, pages: int) -> torch.Tensor:
    """A page-major CPU buffer for `pages` pages of the paged view `paged` (pinned on CUDA)."""
    pin = paged.device.type == "cuda"
    return torch.empty([pages, *page_shape(paged, axis)], dtype=paged.dtype, device="cpu", pin_memory=pin)


def gather(
    source: torch.Tensor,
    axis: int,
    pages: Sequence[int],
    out: torch.Tensor,
    *,
    stream: torch.cuda.Stream | None,
) -> torch.cuda.Event | None:
    """Copy the pages `pages` of the paged view `source` into page-major `out` (its first
    `len(pages)` pages); on CUDA with a side stream, asynchronously: the event fires when done."""
    runs = page_runs(pages, range(len(pages)))
    if stream is None or source.device.type != "cuda":
        for start, at, length in runs:
            out.narrow(0, at, length).movedim(0, axis).copy_(source.narrow(axis, start, length))
        return None
    compute = torch.cuda.current_stream(stream.device)
    stream.wait_stream(compute)  # the pages' last writer comes first
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        for start, at, length in runs:
            # The run made page-major on the device first, so the copy out is one contiguous
            # device-to-pinned transfer, asynchronous. Copied strided as it lies, torch would stage it
            # through pageable host memory: a synchronous copy that waits for every queued step.
            # The staged run is the side stream's (the caching allocator reuses it only after the
            # copies queued behind it on this stream).
            run = source.narrow(axis, start, length).movedim(axis, 0).contiguous()
            out.narrow(0, at, length).copy_(run, non_blocking=True)
        ready.record(stream)
    compute.wait_event(ready)  # a step that reuses these pages waits for the copy out
    return ready


def scatter(data: torch.Tensor, target: torch.Tensor, axis: int, pages: Sequence[int]) -> None:
    """Write page-major `data` (its first `len(pages)` pages) into the pages `pages` of `target`."""
    for start, at, length in page_runs(range(len(pages)), pages):
        target.narrow(axis, at, length).copy_(data.narrow(0, start, length).movedim(0, axis))


def model_fingerprint(config: ModelConfig, weights: ModelWeights, row_ops: str) -> str:
    """A fingerprint of the model's config and weights and what computes between its matrices
    (`row_ops`, the model's RowOps class): equal on two workers that load the same model the same
    way (the same weight form included: int4 and float give different KV; so do torch's and the
    native row ops, in the last bits), so their KV pages mean the same."""
    digest = hashlib.sha256(repr(config).encode())
    digest.update(row_ops.encode())
    parts: list[tuple[str, object]] = [
        ("embed", weights.embed),
        ("final_norm", weights.final_norm),
        ("lm_head", weights.lm_head),
    ]
    for i, layer in enumerate(weights.layers):
        parts += [(f"{i}.{f.name}", getattr(layer, f.name)) for f in fields(layer)]
    for name, shape, dtype, sample in (t for part in parts for t in _samples(*part)):
        digest.update(f"{name}{shape}{dtype}".encode())
        digest.update(sample.to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


def _samples(name: str, value: object) -> Iterator[tuple[str, tuple[int, ...], torch.dtype, torch.Tensor]]:
    """The arrays a weight holds, named by their path, each as its shape, its dtype and up to
    FINGERPRINT_SAMPLE of its elements, evenly strided: a tensor itself, or those of a weight form
    (worker/model/linear.py, embedding.py: dataclasses of tensors or stored GGUF blocks), its
    class named in the path so two forms of one matrix never match. A stored block array is sampled
    in numpy and only the sample handed to torch: the blocks are read-only (the GGUF's mapping),
    and torch warns at every start for a read-only array it is given."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        yield name, tuple(value.shape), value.dtype, value.detach().reshape(-1)[_sampled(value.numel())]
    elif isinstance(value, np.ndarray):
        sample = torch.from_numpy(value.reshape(-1)[_sampled(value.size)].copy())
        yield name, tuple(value.shape), sample.dtype, sample
    elif is_dataclass(value):
        for f in fields(value):
            yield from _samples(f"{name}.{type(value).__name__}.{f.name}", getattr(value, f.name))


def _sampled(count: int) -> slice:
    """Up to FINGERPRINT_SAMPLE of `count` elements, evenly strided from the first."""
    step = max(count // FINGERPRINT_SAMPLE, 1)
    return slice(0, step * FINGERPRINT_SAMPLE, step)
