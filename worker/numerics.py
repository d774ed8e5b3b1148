"""Reproducible float sums on the CPU: a row's result must not depend on the rows computed with it.

The engine promises that a session streamed in micro-turns gets the same tokens as its history sent
whole, and a session batched with others the same as alone. That needs every row of a step to be
computed in the same order of additions whatever the step's shape. MKL, torch's CPU BLAS, picks its
kernels by matrix size, pointer alignment and thread count (a one-row product runs as a matrix-
vector kernel that sums in another order than a 32-row one), unless its Conditional Numerical
Reproducibility mode is strict, which it reads from MKL_CBWR at its first call. Measured on the
Zen 4 machine (docs/benchmarks.md, "Weight forms"): with it, every row of SmolLM2's linears and of
the attention's matmuls is bitwise the same at any row count and 1 or 2 threads; without it, rows
differ in the last bits between 1, 2..9 and 31+ rows. The cost falls on the float path's one-row
products (no matrix-vector kernel); the quantised forms' linears do not use MKL.

`worker/__init__.py` calls `reproducible_blas` before anything in the worker runs a matmul; an
operator's own MKL_CBWR is kept. `blas_is_row_invariant` probes whether it took effect (MKL may
have run before the worker package was imported).
"""

from __future__ import annotations

import os

MKL_CBWR = "MKL_CBWR"
# AUTO: the fastest code path for this CPU; STRICT: the same sums whatever the shapes and threads.
STRICT_REPRODUCIBLE = "AUTO,STRICT"


def reproducible_blas() -> None:
    os.environ.setdefault(MKL_CBWR, STRICT_REPRODUCIBLE)


def blas_is_row_invariant() -> bool:
    """Whether a row of a float matrix product comes out the same alone as among 32 rows."""
    import torch  # here, not at module level: the package init must not import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 576, generator=generator)
    rows = torch.randn(32, 576, generator=generator)
    return bool(torch.equal(F.linear(rows[:1], weight), F.linear(rows, weight)[:1]))
