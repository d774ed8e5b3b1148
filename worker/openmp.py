"""How long the OpenMP runtime's idle threads spin before they sleep: chosen once per process, by
what the process's cores are shared with, before torch loads the runtime.

torch's intra-op threads and the C kernels (worker/model/block_dot.c, worker/attention/cpu_kernel.c)
run on one libgomp, which reads `GOMP_SPINCOUNT` once, when it is loaded (by `import torch`). After a
parallel region its worker threads spin for that many pauses (300,000 by default, milliseconds on
the CPUs measured) before sleeping, so the next region starts without a wake-up:
- on cores the worker has to itself (`--cpu-single-thread-max-tokens 0`: every step on every
  thread) the spin is what a step's ~200 small regions need: SmolLM2's decode step on 2 threads
  took 19.5 ms at the default, 21.9 at 10,000 spins and 37.7 at 100 (2 cores, 2026-11-27);
- on cores shared with the gateway and other workers (the default rule: small steps on one thread)
  a spinning thread takes a core another process needs: a rolling restart of two `tiny` workers
  beside the gateway and the load on 2 cores (32 sessions of 1,000 tokens) streamed at p50/p99
  72/195 ms with 100 spins, 351/584 ms with 10,000 and 1,195/1,498 ms at 100,000.
So a worker that shares its cores spins SHARED_SPINS; one that has them keeps libgomp's default. An
operator's own `GOMP_SPINCOUNT` is kept.

This module imports nothing that loads torch (the package's init and the entry points call it
first).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Final

logger = logging.getLogger(__name__)

GOMP_SPINCOUNT: Final = "GOMP_SPINCOUNT"
# Pauses an idle thread spins before it sleeps where the cores are shared (libgomp's own floor for
# an oversubscribed process).
SHARED_SPINS: Final = 100


def choose_spin(*, shared_cores: bool) -> bool:
    """Set the spin for this process; False (and a warning) where torch already loaded libgomp."""
    if "torch" in sys.modules:
        logger.warning("torch was imported before the OpenMP spin was chosen: libgomp keeps what it read")
        return False
    if shared_cores:
        os.environ.setdefault(GOMP_SPINCOUNT, str(SHARED_SPINS))
    return True
