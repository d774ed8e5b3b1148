"""The CPU's block dot-product kernels (worker/model/block_dot.c, the `_block_dot` extension pip builds):
whether they run here, and why not.

They run on an x86 CPU with AVX2, FMA and F16C where the extension was built (it is optional: a
machine with no C compiler at install gets none). Where they do not, the `int4` form falls back to
torch's kernels (worker/model/weight_form.py).
"""

from __future__ import annotations

from types import ModuleType


def _load() -> tuple[ModuleType | None, str]:
    try:
        from worker.model import _block_dot  # type: ignore[attr-defined]  # built by pip from block_dot.c
    except ImportError:
        return None, "the _block_dot extension was not built (no C compiler at install?)"
    kernels: ModuleType = _block_dot
    if not kernels.supported():
        return None, "this CPU lacks AVX2, FMA or F16C"
    return kernels, ""


# KERNELS is None where they do not run, and UNAVAILABLE_REASON says why (empty where they run).
KERNELS, UNAVAILABLE_REASON = _load()


def block_dot_available() -> bool:
    return KERNELS is not None
