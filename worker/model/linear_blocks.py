"""Weights held in GGUF-style groups of 32 (Q4_0, Q4_1, Q8_0) and multiplied weight-only on CUDA.

The CUDA forms of `--weights int4|int8` (worker/model/weight_form.py). A GGUF matrix stored as one
of these types is held with its stored bits (nibbles or int8 values, float16 scales and minimums),
only split into separate aligned arrays, so the product uses the file's values exactly
(worker/model/weight_only_kernel.py). Anything else is quantised at load into the same layouts:
Q4_1's rule (a float16 scale and minimum per group) for int4, Q8_0's (a float16 scale per group,
symmetric) for int8. The activations are not quantised: the kernel computes in float32 over the
exactly dequantised weights, so the only loss is the weights' own quantisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from worker.model.linear import Linear
from worker.model.stored import StoredTensor
from worker.model.weight_only_kernel import DEFAULT_METHOD, GROUP, BlockKind, Method, weight_only_linear

Q = gguf.GGMLQuantizationType
# The stored types held as stored, and their float16 fields' byte offsets within a block.
_STORED_KINDS = {Q.Q4_0: BlockKind.Q4_0, Q.Q4_1: BlockKind.Q4_1, Q.Q8_0: BlockKind.Q8_0}
BLOCK_STORED_TYPES = frozenset(_STORED_KINDS)
_Q4_LEVELS = 15
_Q8_LEVELS = 127


@dataclass(frozen=True, eq=False)
class BlockLinear(Linear):
    kind: BlockKind
    values: torch.Tensor  # [out, in / 2] uint8 (Q4_*: GGUF's nibble order) or [out, in] int8 (Q8_0)
    scales: torch.Tensor  # [out, in / 32] float16: d
    mins: torch.Tensor | None  # [out, in / 32] float16: Q4_1's m
    bias: torch.Tensor | None  # [out] in the model's dtype
    method: Method = DEFAULT_METHOD  # how the kernel multiplies a tile (the same for every call)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return weight_only_linear(x, self.kind, self.values, self.scales, self.mins, self.bias, self.method)

    @property
    def num_bytes(self) -> int:
        parts = [self.values, self.scales, self.mins, self.bias]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @property
    def out_features(self) -> int:
        return int(self.scales.shape[0])

    @classmethod
    def from_stored(
        cls, stored: StoredTensor, bias: torch.Tensor | None, device: torch.device
    ) -> BlockLinear:
        """Q4_0, Q4_1 or Q8_0 blocks with their stored bits, moved to `device`."""
        if stored.kind not in _STORED_KINDS:
            raise ValueError(f"no weight-only kernel takes {stored.kind.name} blocks as stored")
        rows, cols = stored.shape
        blocks = stored.blocks.reshape(rows, cols // GROUP, -1)

        def half(offset: int) -> torch.Tensor:  # a float16 field of every block, [rows, groups]
            field = np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0]
            return torch.from_numpy(np.ascontiguousarray(field)).to(device)

        def rest(offset: int, dtype: type[np.generic]) -> torch.Tensor:  # the values, [rows, ...]
            values = np.ascontiguousarray(blocks[..., offset:]).view(dtype).reshape(rows, -1)
            return torch.from_numpy(values).to(device)

        if stored.kind == Q.Q4_1:
            return cls(BlockKind.Q4_1, rest(4, np.uint8), half(0), half(2), bias)
        if stored.kind == Q.Q4_0:
            return cls(BlockKind.Q4_0, rest(2, np.uint8), half(0), None, bias)
        return cls(BlockKind.Q8_0, rest(2, np.int8), half(0), None, bias)

    @classmethod
    def q4_1_from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> BlockLinear:
        """Asymmetric groups of 32 by Q4_1's rule, computed on the weight's device."""
        groups = _groups(weight)
        low = groups.amin(-1)
        scale = ((groups.amax(-1) - low) / _Q4_LEVELS).half()
        low16 = low.half()
        q = _round_to(groups - low16.float()[..., None], scale, 0, _Q4_LEVELS).to(torch.uint8)
        # GGUF's nibble order: byte j holds value j (low nibble) and value j + 16 (high nibble).
        packed = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)
        return cls(BlockKind.Q4_1, packed.reshape(weight.shape[0], -1), scale, low16, bias)

    @classmethod
    def q8_0_from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> BlockLinear:
        """Symmetric int8 groups of 32 by Q8_0's rule, computed on the weight's device."""
        groups = _groups(weight)
        scale = (groups.abs().amax(-1) / _Q8_LEVELS).half()
        q = _round_to(groups, scale, -_Q8_LEVELS, _Q8_LEVELS).to(torch.int8)
        return cls(BlockKind.Q8_0, q.reshape(weight.shape), scale, None, bias)


def _groups(weight: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"groups of {GROUP} need an input width that is a multiple of it, not {cols}")
    return weight.float().reshape(rows, cols // GROUP, GROUP)


def _round_to(values: torch.Tensor, scale: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """values / scale (the float16 scale as stored) rounded into [low, high]; a zero scale gives 0."""
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = torch.round(values / safe[..., None]).clamp(low, high)
    return torch.where(scale[..., None] > 0, q, torch.zeros_like(q))
