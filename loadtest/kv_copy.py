"""Host-tier copy bandwidth: how fast whole KV pages move device -> host and back.

    python -m loadtest.kv_copy [--device cuda] [--dtype bfloat16] [--pages 2048] [--repeats 5]

The pool is shaped like Llama-3.1-8B's KV (32 layers, 8 KV heads of 128, pages of 16 tokens) in
the layout the device's attention backend uses (`nhd` on CUDA, `head_major` on the CPU). Each
repeat parks every page on the host (one run: the page allocator keeps sessions contiguous) and
restores it, through the engine's own `PageCopier` (side stream and events on CUDA); the copies'
seconds are the CUDA events' elapsed time (wall time on the CPU). scripts/gpu-check.sh runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from worker.attention.kv_pool import KVPool
from worker.engine.engine import torch_dtype
from worker.engine.memory.page_copy import CopyCounter, HostKVPool, PageCopier


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
    return {
        "bytes_per_copy": off.bytes / max(off.count, 1),
        "offload_gb_s": off.bytes / off.seconds / 1e9 if off.seconds else 0.0,
        "restore_gb_s": back.bytes / back.seconds / 1e9 if back.seconds else 0.0,
        "restore_ms_per_copy": back.seconds * 1000 / max(back.count, 1),
    }


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
