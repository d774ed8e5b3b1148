"""glibc's malloc told to keep freed buffers for reuse: set once per worker process, at its start.

A worker moves megabytes through short-lived buffers: a drain's KV copy (the export's staging
tensor, the websocket frames the sender masks and the receiver reassembles, the receiver's payload),
a long append's activations. glibc serves a request over its mmap threshold (128 KB at first, raised
as such blocks are freed, at most 32 MB) from a fresh mapping, and returns freed heap to the OS past
its trim threshold, so such a buffer comes back as untouched memory: a page fault per 4 KB the first
time each page is written, which on the VMs measured costs more than the copy itself. Moving 144 MB
over the KV copy stream in 4 MB frames (two processes on 2 cores, 2026-11-27): the sender took 0.15
CPU-seconds and 72,000 faults with glibc's defaults, 0.08 s and none with these settings; the
receiver 0.12-0.15 s and 27,000-37,000 faults, 0.08-0.09 s and none. A drain of 8 `tiny` sessions
of 4k tokens (147 MB) faulted 26,000 times on its sender and 39,000 on its target.

So the worker serves every request under `MMAP_THRESHOLD_BYTES` (mallopt's documented maximum on
64-bit) from the heap, and keeps up to `TRIM_THRESHOLD_BYTES` of freed heap in each malloc arena
instead of returning it: a freed buffer is the next one's, already mapped. Larger blocks (a real
deployment's KV pool and host tier) are still mapped on their own and returned when freed. The cost
is bounded: an arena keeps about what its threads once held in such buffers at one time, plus the
trim threshold.

An operator's own malloc tunables (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, or
`GLIBC_TUNABLES` naming `glibc.malloc.`) are kept; elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from typing import Final

logger = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD: Final = -1
M_MMAP_THRESHOLD: Final = -3
# Requests below this come from the heap (a drain's 18 MB staging tensors and 4 MB frames do).
MMAP_THRESHOLD_BYTES: Final = 32 * 2**20
# Freed heap an arena keeps for reuse before any is returned to the OS.
TRIM_THRESHOLD_BYTES: Final = 256 * 2**20


def _operator_tunables() -> list[str]:
    named = [name for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        named.append("GLIBC_TUNABLES")
    return named


def reuse_freed_memory() -> bool:
    """Set both thresholds for this process; False where this is not glibc, the operator set their
    own, or glibc refused a setting (logged)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    named = _operator_tunables()
    if named:
        logger.info("malloc: keeping the operator's %s", " and ".join(named))
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = {
        "mmap threshold": (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        "trim threshold": (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
    }
    refused = [name for name, (param, value) in settings.items() if mallopt(param, value) != 1]
    if refused:
        logger.warning(
            "malloc: glibc refused the %s: freed buffers may come back as fresh pages", " and ".join(refused)
        )
    return not refused
