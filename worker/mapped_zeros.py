"""Big host buffers that start as zeros without being written: an anonymous mapping (its pages are
the kernel's zeros until first touched), made resident afterwards by a background thread at the
lowest scheduling priority.

Why: the CPU KV pool (a GiB in the benchmarks) was zeroed at start with `zero_()`, 0.7-2.2 s of a core
on the 2-vCPU VMs here (the first write of each page is a page fault, and on a VM the host's too), and
3-5 s while a rolling restart's other worker served every session on the same two cores: the restart's
boot took a core from the turns of the worker still serving (docs/benchmarks.md, issue #34). Mapped
instead of written, the buffer is zeros at once; the thread then asks the kernel to populate its pages
(`MADV_POPULATE_WRITE`, Linux 5.14+: page tables filled as if written, the contents untouched, so the
engine may write pages meanwhile) a piece at a time at nice 19, so within the worker's own CPU share
(its container's, where each runs in one) it takes what the process's other threads leave. The pool
is resident soon after start, so the process's memory is what it will stay, not creeping up as
sessions first touch their pages. Where the kernel refuses the advice (an older kernel, another OS),
the pages are populated as they are first written; nothing else changes.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE: Final = 23  # linux/mman.h, Linux 5.14
MADV_HUGEPAGE: Final = 14  # linux/mman.h: back the range with 2 MiB pages where the kernel can
# Bytes populated per call. The call holds the process's memory-map lock for reading: a thread that
# maps or unmaps memory meanwhile (a large allocation) waits for the piece, so pieces are small; it
# also bounds how long the thread goes on after its buffer is dropped.
PREFAULT_PIECE: Final = 2 << 20
IDLE_NICE: Final = 19  # the lowest priority a thread can ask for


@dataclass(frozen=True)
class MappedZeros:
    tensor: torch.Tensor  # flat, `dtype`, every element 0
    # Set once every page is resident, or populating stopped (refused by the kernel, buffer dropped).
    resident: threading.Event


def mapped_zeros(numel: int, dtype: torch.dtype, *, huge_pages: bool = False) -> MappedZeros:
    """A flat host tensor of `numel` (at least 1) zeros, mapped now and made resident in the background;
    with `huge_pages`, asked to be backed by 2 MiB pages (Linux, where transparent huge pages are
    `madvise` or `always`): for a buffer read at scattered small offsets, such as the KV pool, where
    each 4 KiB page read is a TLB miss (the CPU attention over 5,000 positions of 4 sessions: 0.86x on
    a Xeon VM, 0.96x on Zen 4, docs/benchmarks.md)."""
    nbytes = numel * dtype.itemsize
    if nbytes < 1:
        raise ValueError(f"a host buffer needs at least one element, not {numel}")
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor keeps the mapping alive (frombuffer holds a reference to it), its views the tensor.
    tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype)
    # Before any page is touched, so the population below faults huge pages in.
    if huge_pages and sys.platform == "linux" and _madvise(tensor.data_ptr(), nbytes, MADV_HUGEPAGE) != 0:
        logger.info("mapped zeros: %d MiB in 4 KiB pages (%s)", nbytes >> 20, os.strerror(ctypes.get_errno()))
    resident = threading.Event()
    threading.Thread(
        target=_populate,
        args=(weakref.ref(tensor), tensor.data_ptr(), nbytes, resident),
        name="mapped-zeros-prefault",
        daemon=True,
    ).start()
    return MappedZeros(tensor, resident)


def _libc_madvise() -> Callable[[int, int, int], int]:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


# madvise(address, length, advice) -> 0 or -1 (errno set); a module attribute so a test can watch it.
_madvise: Callable[[int, int, int], int] = _libc_madvise()


def _populate(
    tensor: weakref.ref[torch.Tensor], address: int, nbytes: int, resident: threading.Event
) -> None:
    try:
        if sys.platform == "linux":  # setpriority on a thread id moves that thread only on Linux
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IDLE_NICE)
            except OSError as exc:
                logger.debug("prefault: priority unchanged (%s)", exc)
        began = time.monotonic()
        for offset in range(0, nbytes, PREFAULT_PIECE):
            alive = tensor()  # held during the call: the mapping cannot go away under it
            if alive is None:
                return
            if _madvise(address + offset, min(PREFAULT_PIECE, nbytes - offset), MADV_POPULATE_WRITE) != 0:
                error = ctypes.get_errno()
                # EINVAL: a kernel without the advice; anything else (ENOMEM: the host is short of
                # memory) is the operator's to know.
                level = logging.INFO if error == errno.EINVAL else logging.WARNING
                logger.log(
                    level,
                    "mapped zeros: %d MiB not populated ahead (%s); its pages fill as first written",
                    nbytes >> 20,
                    os.strerror(error),
                )
                return
            del alive
        logger.info("mapped zeros: %d MiB resident after %.1f s", nbytes >> 20, time.monotonic() - began)
    finally:
        resident.set()
