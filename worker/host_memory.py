"""Big host buffers that start as zeros without being written: an anonymous mapping (its pages are
the kernel's zeros until first touched), made resident afterwards by a background thread at the
lowest scheduling priority.

Why: the CPU KV pool (a GiB by default) was zeroed at start with `zero_()`, 0.7-2.2 s of a core on the
2-vCPU VMs here (the first write of each page is a page fault, and on a VM the host's too), and 3-5 s
while a rolling restart's other worker served every session on the same two cores: the restart's
boot took a core from the turns of the worker still serving (docs/benchmarks.md, issue #34). Mapped
instead of written, the buffer is zeros at once; the thread then asks the kernel to populate its pages
(`MADV_POPULATE_WRITE`, Linux 5.14+: page tables filled as if written, the contents untouched, so the
engine may write pages meanwhile) a piece at a time at nice 19, so it takes only the CPU nobody else
wants, and the pool is still resident soon after start: a host short of memory fails early, and the
process's memory does not creep up as sessions first touch their pages. Where the kernel refuses the
advice, the pages are populated as they are first written (nothing else changes).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Final

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE: Final = 23  # linux/mman.h, Linux 5.14
# Bytes populated per call: small enough that the thread stops soon after its buffer is dropped.
PREFAULT_PIECE: Final = 32 << 20
IDLE_NICE: Final = 19  # the lowest priority a thread can ask for


@dataclass(frozen=True)
class ZeroedHostBuffer:
    tensor: torch.Tensor  # flat, `dtype`, every element 0.0
    # Set once every page is resident, or populating stopped (refused by the kernel, buffer dropped).
    resident: threading.Event


def zeroed_host_buffer(numel: int, dtype: torch.dtype) -> ZeroedHostBuffer:
    """A flat host tensor of `numel` zeros, mapped now and made resident in the background."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor keeps the mapping alive (frombuffer holds a reference to it).
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype)
    resident = threading.Event()
    threading.Thread(
        target=_populate,
        args=(weakref.ref(tensor), tensor.data_ptr(), nbytes, resident),
        name="host-memory-prefault",
        daemon=True,
    ).start()
    return ZeroedHostBuffer(tensor, resident)


def _populate(
    tensor: weakref.ref[torch.Tensor], address: int, nbytes: int, resident: threading.Event
) -> None:
    try:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IDLE_NICE)  # this thread only
        except OSError as exc:
            logger.debug("host memory prefault: priority unchanged (%s)", exc)
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        for offset in range(0, nbytes, PREFAULT_PIECE):
            alive = tensor()  # held during the call: the mapping cannot go away under it
            if alive is None:
                return
            length = min(PREFAULT_PIECE, nbytes - offset)
            if madvise(address + offset, length, MADV_POPULATE_WRITE) != 0:
                error = ctypes.get_errno()
                logger.info(
                    "host memory: %d MiB not populated ahead (%s); its pages fill as first written",
                    nbytes >> 20,
                    os.strerror(error),
                )
                return
            del alive
    finally:
        resident.set()
