"""Reproducible float sums on the CPU: a row's result must not depend on the rows computed with it.

The engine promises that a session streamed in micro-turns gets the same tokens as its history sent
whole, and a session batched with others the same as alone. That needs every row of a step to be
computed in the same order of additions whatever the step's shape. MKL, torch's CPU BLAS, picks its
kernels by matrix size, pointer alignment and thread count. Two rules hold its sums to one order:

- its Conditional Numerical Reproducibility mode is strict, which it reads from MKL_CBWR at its
  first call (`worker/__init__.py` calls `reproducible_blas` before anything in the worker runs a
  matmul; an operator's own MKL_CBWR is kept);
- every product the promise rests on has at least MIN_ROWS rows and MIN_COLUMNS output columns
  (`at_least_rows`; the attention pads its queries and keys). Measured on the 2-core Zen 4 VM
  (2026-11-27, MKL 2024.2, CBWR strict or not alike): products of 1-3 rows, and products of fewer
  than 12 output columns, run other kernels (matrix-vector-like) that sum a dot product in another
  order than the general one, so a one-token step's row differed in the last bits from the same row
  in a longer step; at 4 or more rows and 12 or more columns every row tried (up to 256 rows, 1,088
  columns, 1 and 2 threads) came out the same. On an earlier VM strict mode alone had sufficed.

The quantised forms' linears do not use MKL (their kernels' rows are independent by construction).
`blas_is_row_invariant` probes both rules at start-up.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package init imports this module and must not import torch
    import torch

MKL_CBWR = "MKL_CBWR"
# AUTO: the fastest code path for this CPU; STRICT: the same sums whatever the threads and alignment.
STRICT_REPRODUCIBLE = "AUTO,STRICT"
# The fewest rows, and output columns, of a float product whose rows are summed in the general order.
MIN_ROWS = 4
MIN_COLUMNS = 64


def reproducible_blas() -> None:
    os.environ.setdefault(MKL_CBWR, STRICT_REPRODUCIBLE)


def at_least_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [rows, features] padded with zero rows to MIN_ROWS (the caller keeps its first rows)."""
    import torch

    rows = x.shape[0]
    return x if rows >= MIN_ROWS else torch.constant_pad_nd(x, (0, 0, 0, MIN_ROWS - rows))


def blas_is_row_invariant() -> bool:
    """Whether a row of a float matrix product of MIN_ROWS rows comes out the same among 32 rows,
    and a product of MIN_COLUMNS columns the same as the first columns of a wider one."""
    import torch  # here, not at module level: the package init must not import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 576, generator=generator)
    rows = torch.randn(32, 576, generator=generator)
    same_rows = torch.equal(F.linear(rows[:MIN_ROWS], weight), F.linear(rows, weight)[:MIN_ROWS])
    same_columns = torch.equal(F.linear(rows, weight[:MIN_COLUMNS]), F.linear(rows, weight)[:, :MIN_COLUMNS])
    return bool(same_rows and same_columns)
