"""4-bit weights as GGUF's Q4_0/Q4_1 store them, multiplied by integer dot products against activations
quantised per row and group of 32 to int8, with a second int8 level in a group that holds an
outlier (`q4_linear` in worker/model/block_dot.c).

llama.cpp multiplies the same file against one int8 level (its Q8_1); on SmolLM2 that level and the
4-bit weights together lost the answer to "What is the capital of France?", which the second level
in outlier groups keeps (block_dot.c, `OUTLIER_RATIO`; docs/benchmarks.md, "Weight forms"). The
weights are the stored nibbles and float16 scales exactly; the activations are not, so the product
is not exact against the float path, and its greedy agreement with the float path is measured
against llama.cpp's. A row's result depends on that row alone, summed in one fixed order at any row
or thread count, so a session's tokens are the same batched or alone, streamed or sent whole.

The `int4` form uses it where the kernels run (worker/model/block_dot.py); elsewhere torch's packed
int4 kernel (linear_int4.py).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from worker.model.block_dot import GROUP, TILE, BlockDotLinear, pad_to_tiles
from worker.model.stored import StoredTensor

# Stored nibble bytes per group: byte i holds value i (low nibble) and value i + 16 (high nibble).
_NIBBLE_BYTES = GROUP // 2


class Q4Q8Linear(BlockDotLinear):
    """packed: [tiles, groups, 4, 8, 4] uint8, the stored nibble bytes with 8 rows interleaved;
    scales: [tiles, groups, 2, 8] float16, d then m of each of the tile's 8 rows."""

    KERNEL = "q4_linear"

    @classmethod
    def from_stored(cls, stored: StoredTensor, bias: torch.Tensor | None) -> Q4Q8Linear:
        """Q4_0 or Q4_1 blocks: their nibbles and float16 scales as stored (Q4_0's m is -8 d, exact)."""
        rows, cols = stored.shape
        blocks = stored.blocks.reshape(rows, cols // GROUP, -1)
        d = stored.block_float16(0)
        if stored.kind == gguf.GGMLQuantizationType.Q4_1:
            m = stored.block_float16(2)
            nibbles = blocks[..., 4:]
        elif stored.kind == gguf.GGMLQuantizationType.Q4_0:
            m = d * -8  # a power of two: exact in float16
            nibbles = blocks[..., 2:]
        else:
            raise ValueError(f"no q4 x q8 kernel takes {stored.kind.name} blocks")
        return cls._pack(torch.from_numpy(np.ascontiguousarray(nibbles)), d, m, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Q4Q8Linear:
        """A float matrix quantised into asymmetric groups of 32 with float16 scales (Q4_1's rule)."""
        rows, cols = weight.shape
        if cols % GROUP:
            raise ValueError(f"int4 needs an input width that is a multiple of {GROUP}, not {cols}")
        groups = weight.float().reshape(rows, cols // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        d = ((high - low) / 15).half()
        m = low.half()
        safe = torch.where(d > 0, d.float(), torch.ones_like(low))
        q = torch.round((groups - m.float()[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
        nibbles = q[..., :_NIBBLE_BYTES] | (q[..., _NIBBLE_BYTES:] << 4)
        return cls._pack(nibbles.contiguous(), d, m, bias)

    @classmethod
    def _pack(
        cls, nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None
    ) -> Q4Q8Linear:
        """nibbles [rows, groups, 16] uint8 as stored, d and m [rows, groups] float16: w = d * q + m."""
        rows, groups, _ = nibbles.shape
        tiles, (nibbles, d, m) = pad_to_tiles(nibbles, d, m)
        # [tiles, 8 rows, groups, 4 vectors, 4 bytes] -> [tiles, groups, 4 vectors, 8 rows, 4 bytes]
        packed = nibbles.reshape(tiles, TILE, groups, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
        per_tile = [t.reshape(tiles, TILE, groups).permute(0, 2, 1) for t in (d, m)]
        scales = torch.stack(per_tile, dim=2).contiguous()
        return cls(packed, scales, rows, bias)
