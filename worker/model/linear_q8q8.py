"""8-bit weights as GGUF's Q8_0 stores them (groups of 32 int8 values with a float16 scale), multiplied
by integer dot products against activations quantised per row and group of 32 to int8, with a
second int8 level in a group that holds an outlier (`q8_linear` in worker/model/block_dot.c;
linear_q4q8.py says why).

`--weights int8` serves every matrix through it where the kernels run (worker/model/weight_form.py):
a stored Q8_0 matrix as it is, anything else quantised into Q8_0 groups at load, where `torch._int_mm`
is a near-scalar loop on AVX2. Not exact against the float path (the activations are quantised). A
row's result depends on that row alone, summed in one fixed order at any row or thread count.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from worker.model.block_dot import GROUP, TILE, BlockDotLinear, pad_to_tiles
from worker.model.stored import StoredTensor

# A group of 32 int8 values is 8 chunks of 4, one 32-bit lane per row in the kernel's vectors.
_CHUNKS = GROUP // 4


class Q8Q8Linear(BlockDotLinear):
    """packed: [tiles, groups, 8 chunks, 8 rows, 4] int8, the stored values with 8 rows interleaved;
    scales: [tiles, groups, 8] float16, d of each of the tile's 8 rows."""

    KERNEL = "q8_linear"

    @classmethod
    def from_stored(cls, stored: StoredTensor, bias: torch.Tensor | None) -> Q8Q8Linear:
        """Q8_0 blocks: their int8 values and float16 scales as stored."""
        if stored.kind != gguf.GGMLQuantizationType.Q8_0:
            raise ValueError(f"no q8 x q8 kernel takes {stored.kind.name} blocks")
        rows, cols = stored.shape
        blocks = stored.blocks.reshape(rows, cols // GROUP, -1)
        d = stored.block_float16(0)
        values = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
        return cls._pack(values, d, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Q8Q8Linear:
        """A float matrix quantised into symmetric groups of 32 with float16 scales (Q8_0's rule)."""
        rows, cols = weight.shape
        if cols % GROUP:
            raise ValueError(f"q8 groups need an input width that is a multiple of {GROUP}, not {cols}")
        groups = weight.float().reshape(rows, cols // GROUP, GROUP)
        # As gguf's own quantiser: q = x * (1 / d) rounded half away from zero, with d in float32,
        # then d stored as float16.
        d = groups.abs().amax(-1) / 127
        inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        scaled = groups * inverse[..., None]
        values = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int8)
        return cls._pack(values, d.half(), bias)

    @classmethod
    def _pack(cls, values: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None) -> Q8Q8Linear:
        """values [rows, groups, 32] int8, d [rows, groups] float16: w = d * q."""
        rows, groups, _ = values.shape
        tiles, (values, d) = pad_to_tiles(values, d)
        # [tiles, 8 rows, groups, 8 chunks, 4] -> [tiles, groups, 8 chunks, 8 rows, 4]
        packed = values.reshape(tiles, TILE, groups, _CHUNKS, 4).permute(0, 2, 3, 1, 4).contiguous()
        scales = d.reshape(tiles, TILE, groups).permute(0, 2, 1).contiguous()
        return cls(packed, scales, rows, bias)
