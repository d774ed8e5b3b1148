"""Host-tier copy bandwidth: how fast whole KV pages move device -> host and back, and leave for
another worker (a drain's KV copy).

    python -m loadtest.kv_copy [--device cuda] [--dtype bfloat16] [--pages 2048] [--repeats 5]

The pool is shaped like Llama-3.1-8B's KV (32 layers, 8 KV heads of 128, pages of 16 tokens) in
the layout the device's attention backend uses (`nhd` on CUDA, `head_major` on the CPU). Each
repeat parks every page on the host (one run: the page allocator keeps sessions contiguous) and
restores it, through the engine's own `PageCopier` (side stream and events on CUDA); the copies'
seconds are the CUDA events' elapsed time (wall time on the CPU). Then each repeat exports every
page as a drain does (`gather` into the pinned staging buffer on the tier's side stream,
worker/engine/memory/kv_transfer.py): `export_gb_s` from the call to its `ready` event on an idle
device, and `export_host_ms`, what the call costs the engine thread while a step (a queued
`torch.cuda._sleep`) still runs: the overlap with serving, which is the point of the side stream
(a copy that waited for the step would cost the step's whole time). scripts/gpu-check.sh runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Final

import torch

from worker.attention.kv_pool import KVPool
from worker.dtypes import torch_dtype
from worker.engine.memory.kv_transfer import gather, staging
from worker.engine.memory.page_copy import CopyCounter, HostKVPool, PageCopier

# GPU cycles of the step an export overlaps (`torch.cuda._sleep`; about 0.1 s on current GPUs).
STEP_CYCLES: Final = 200_000_000


def measure(device: torch.device, dtype: torch.dtype, pages: int, repeats: int) -> dict[str, float]:
    pool = KVPool(
        num_layers=32,
        num_pages=pages,
        page_size=16,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        device=device,
        layout="nhd" if device.type == "cuda" else "head_major",
    )
    copier = PageCopier(pool, HostKVPool(pool, pages))
    ids = list(range(pages))
    for _ in range(repeats + 1):  # the first round warms up (pinned pages, kernels)
        if _ == 1:
            copier.offloaded, copier.restored = CopyCounter(), CopyCounter()
        copier.to_host(ids, ids)
        copier.to_device(ids, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    copier.settle()
    off, back = copier.offloaded, copier.restored
    export_s, host_s = _exports(pool, copier, ids, repeats)
    return {
        "bytes_per_copy": off.bytes / max(off.count, 1),
        "offload_gb_s": off.bytes / off.seconds / 1e9 if off.seconds else 0.0,
        "restore_gb_s": back.bytes / back.seconds / 1e9 if back.seconds else 0.0,
        "restore_ms_per_copy": back.seconds * 1000 / max(back.count, 1),
        "export_gb_s": off.bytes / max(off.count, 1) / export_s / 1e9 if export_s else 0.0,
        "export_host_ms": host_s * 1000,
    }


def _exports(pool: KVPool, copier: PageCopier, ids: list[int], repeats: int) -> tuple[float, float]:
    """(seconds an export takes to be ready on an idle device, seconds its call takes on the host
    while a step runs), each the best of `repeats` after a warm-up."""
    out = staging(pool.paged(), pool.page_axis, len(ids))
    cuda = pool.device.type == "cuda"
    ready_s, host_s = [], []
    for repeat in range(repeats + 1):
        started = time.perf_counter()
        ready = gather(pool.paged(), pool.page_axis, ids, out, stream=copier.stream)
        if ready is not None:
            ready.synchronize()
        ready_s.append(time.perf_counter() - started)
        if cuda:  # the same export behind a running step: the host must not wait for it
            torch.cuda._sleep(STEP_CYCLES)  # type: ignore[no-untyped-call]
        started = time.perf_counter()
        ready = gather(pool.paged(), pool.page_axis, ids, out, stream=copier.stream)
        host_s.append(time.perf_counter() - started)
        if ready is not None:
            ready.synchronize()
        if repeat == 0:  # the warm-up: pinned pages, kernels
            ready_s, host_s = [], []
    return min(ready_s, default=0.0), min(host_s, default=0.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.kv_copy", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pages", type=int, default=2048, help="pages moved per copy (16 tokens each)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    figures = measure(torch.device(args.device), torch_dtype(args.dtype), args.pages, args.repeats)
    text = json.dumps({"device": args.device, "dtype": args.dtype, "pages": args.pages, **figures}, indent=2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
