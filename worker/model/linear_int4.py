"""4-bit weights in groups of 32 along the input, multiplied by torch's packed int4 CPU kernel: the
`int4` form where the q4 x q8 kernel (linear_q4q8.py) does not run (no AVX2, or the extension unbuilt).

`aten._weight_int4pack_mm_for_cpu` computes `x @ ((q - 8) * scale + zero).T` per group of 32 input
values, which is exactly the shape of GGUF's Q4_0 (`d * (q - 8)`: zero 0) and Q4_1 (`d * q + m`:
zero `m + 8 d`) blocks, so those are served from their stored nibbles without requantising them.
Its vectorised path takes bfloat16 activations and bfloat16 scales only (its float32 path is a
scalar loop, ~30x slower on AVX-512), so the product is not exact: the stored float16 `d` and `m`
are rounded to bfloat16, and so are the activations. Float checkpoints are quantised at load into
the same asymmetric groups (Q4_1's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from worker.model.linear import Linear
from worker.model.stored import StoredTensor

GROUP = 32
# The GGUF types this kernel takes as stored.
INT4_STORED_TYPES = frozenset({gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1})
# The packing's inner tile count along K; 1 fits every K that is a multiple of the group.
_INNER_K_TILES = 1


@dataclass(frozen=True, eq=False)
class Int4Linear(Linear):
    packed: torch.Tensor  # the kernel's packed nibbles, [out, in / 2] uint8
    scale_and_zero: torch.Tensor  # [in / 32, out, 2] bfloat16
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        product: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP, self.scale_and_zero
        )
        y = product.to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.packed.numel() + self.scale_and_zero.numel() * 2 + extra

    @property
    def out_features(self) -> int:
        return int(self.scale_and_zero.shape[1])

    @classmethod
    def from_stored(cls, stored: StoredTensor, bias: torch.Tensor | None) -> Int4Linear:
        """Q4_0 or Q4_1 blocks, their nibbles taken as stored."""
        if stored.kind not in INT4_STORED_TYPES:
            raise ValueError(f"no int4 kernel takes {stored.kind.name} blocks")
        rows, cols = stored.shape
        blocks = stored.blocks.reshape(rows, cols // GROUP, -1)
        d = stored.block_float16(0).float()
        if stored.kind == gguf.GGMLQuantizationType.Q4_1:
            m = stored.block_float16(2).float()
            nibbles = blocks[..., 4:]
            zero = m + 8 * d
        else:
            nibbles = blocks[..., 2:]
            zero = torch.zeros_like(d)
        packed_bytes = torch.from_numpy(np.ascontiguousarray(nibbles))  # [rows, groups, 16]
        # Within a block the low nibbles are values 0..15 and the high nibbles values 16..31.
        q = torch.cat([packed_bytes & 0x0F, packed_bytes >> 4], dim=-1).reshape(rows, cols)
        return cls._pack(q.to(torch.int32), d, zero, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int4Linear:
        """A float matrix quantised into asymmetric groups of 32 (Q4_1's rule)."""
        rows, cols = weight.shape
        if cols % GROUP:
            raise ValueError(f"int4 needs an input width that is a multiple of {GROUP}, not {cols}")
        groups = weight.float().reshape(rows, cols // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = (high - low) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((groups - low[..., None]) / safe[..., None]).clamp(0, 15).reshape(rows, cols)
        return cls._pack(q.to(torch.int32), scale, low + 8 * scale, bias)

    @classmethod
    def _pack(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None
    ) -> Int4Linear:
        """q [out, in] in 0..15; scale and zero [out, in / 32]: w = (q - 8) * scale + zero."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
        scale_and_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        return cls(packed, scale_and_zero.to(torch.bfloat16), bias)
