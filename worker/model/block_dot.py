"""The CPU's block dot-product kernels (worker/model/block_dot.c, the `_block_dot` extension pip builds)
and the one `Linear` over them: whether they run here, why not, and what every packed matrix shares.

They run on an x86 CPU with AVX2, FMA and F16C where the extension was built (it is optional: a
machine with no C compiler at install gets none). Where they do not, the `int4` and `int8` forms
fall back to torch's kernels (worker/model/weight_form.py).

Every matrix they take is packed in tiles of TILE output rows (zero rows complete the last tile,
their outputs dropped) over groups of GROUP input values; each kind packs its own blocks
(linear_q4q8.py, linear_q8q8.py) and names its kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from worker.model.linear import Linear
from worker.native import load_extension

# Input values per group: GGUF's legacy blocks, and the activations' quantisation groups.
GROUP = 32
# Output rows per tile: the kernels compute 8 output columns in one AVX2 register.
TILE = 8


# KERNELS is None where they do not run, and UNAVAILABLE_REASON says why (empty where they run).
KERNELS, UNAVAILABLE_REASON = load_extension("worker.model._block_dot", needs="AVX2, FMA or F16C")


def block_dot_available() -> bool:
    return KERNELS is not None


def block_dot_vnni() -> bool:
    """Whether the q4 kernel takes its AVX-512 VNNI path here (from 3 activation rows; the same bits)."""
    return KERNELS is not None and bool(KERNELS.vnni())


def pad_to_tiles(*per_row: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Tensors whose first axis is the matrix's rows, completed with zero rows to whole tiles; and
    the tile count."""
    rows = per_row[0].shape[0]
    pad = -rows % TILE
    padded = [torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t for t in per_row]
    return (rows + pad) // TILE, padded


@dataclass(frozen=True, eq=False)
class BlockDotLinear(Linear):
    """A matrix packed for one of the kernels; `KERNEL` names its function in the extension."""

    KERNEL: ClassVar[str]

    packed: torch.Tensor  # the kind's blocks, tile by tile (the kind's file gives the layout)
    scales: torch.Tensor  # float16, tile by tile
    rows: int  # out_features; the tiles may hold up to TILE - 1 zero rows past it
    bias: torch.Tensor | None
    # Fixed at construction, so a call asks torch only about its input: asking for these on every
    # call cost ~9 us against the kernel's ~2 us at a decode step's one row (121 calls a SmolLM2 step).
    _kernel: Callable[..., None] = field(init=False, repr=False)
    _packed_at: int = field(init=False, repr=False)
    _scales_at: int = field(init=False, repr=False)
    _padded: int = field(init=False, repr=False)  # output columns the tiles hold

    def __post_init__(self) -> None:
        assert KERNELS is not None, f"{type(self).__name__} is built only where the kernels run"
        # The frozen fields' tensors are never replaced or resized, so their addresses hold.
        object.__setattr__(self, "_kernel", getattr(KERNELS, self.KERNEL))
        object.__setattr__(self, "_packed_at", self.packed.data_ptr())
        object.__setattr__(self, "_scales_at", self.scales.data_ptr())
        object.__setattr__(self, "_padded", self.packed.shape[0] * TILE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        float32 = x.dtype == torch.float32
        source = x if float32 and x.is_contiguous() else x.float().contiguous()
        tokens, cols = source.shape
        y = torch.empty(tokens, self._padded, dtype=torch.float32)
        self.multiply(source.data_ptr(), tokens, cols, y.data_ptr(), torch.get_num_threads())
        out = y if self._padded == self.rows else y[:, : self.rows]
        if not float32:
            out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def multiply(self, x_at: int, tokens: int, cols: int, y_at: int, threads: int) -> None:
        """y = x @ W.T (no bias) by address, the caller's tensors: x [tokens, cols] float32 contiguous, y
        [tokens, padded_features] float32 contiguous (the tiles' zero rows give zero columns)."""
        self._kernel(x_at, tokens, cols, self._packed_at, self._scales_at, self._padded, y_at, threads)

    @property
    def padded_features(self) -> int:
        """The output columns the tiles hold: out_features, to a multiple of TILE."""
        return self._padded

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.packed.numel() + self.scales.numel() * 2 + extra

    @property
    def out_features(self) -> int:
        return self.rows
