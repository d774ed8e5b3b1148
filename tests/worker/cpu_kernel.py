"""The marker of the tests that need the CPU attention kernel (worker/attention/cpu_kernel.c): they
skip, naming why, where its extension is not built or the CPU lacks AVX2, FMA or F16C."""

from __future__ import annotations

import pytest

from worker.attention.cpu_backend import KERNEL, UNAVAILABLE_REASON

needs_cpu_kernel = pytest.mark.skipif(
    KERNEL is None, reason=f"the CPU attention kernel: {UNAVAILABLE_REASON}"
)
