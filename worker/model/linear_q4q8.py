"""4-bit weights as GGUF's Q4_0/Q4_1 store them, multiplied by integer dot products against activations
quantised to int8 per row and group of 32 (worker/model/q4q8.c, the `_q4q8` extension).

This is how llama.cpp multiplies the same file (its Q4_1 x Q8_1 dot product): the weights are the
stored nibbles and float16 scales exactly, the activations are not, so the product is not exact
against the float path; its greedy agreement with the float path is measured against llama.cpp's
(docs/benchmarks.md, "Weight forms"). A row's result depends on that row alone, summed in one fixed
order at any row or thread count, so a session's tokens are the same batched or alone, streamed or
sent whole.

The `int4` form uses it on a CPU that runs it (AVX2, FMA, F16C) where the extension was built;
elsewhere torch's packed int4 kernel (linear_int4.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import gguf
import numpy as np
import torch

from worker.model.linear import Linear
from worker.model.stored import StoredTensor

logger = logging.getLogger(__name__)

GROUP = 32
# Output rows per tile: the kernel computes 8 output columns in one AVX2 register.
TILE = 8
# Stored nibble bytes per group: byte i holds value i (low nibble) and value i + 16 (high nibble).
_NIBBLE_BYTES = GROUP // 2


def _load_kernel() -> ModuleType | None:
    try:
        from worker.model import _q4q8  # type: ignore[attr-defined]  # built by pip from q4q8.c
    except ImportError:
        return None
    kernel: ModuleType = _q4q8
    return kernel if kernel.supported() else None


# None where the extension is missing or the CPU lacks AVX2/FMA/F16C.
_KERNEL = _load_kernel()


def q4q8_available() -> bool:
    return _KERNEL is not None


def q4q8_unavailable_reason() -> str:
    """Why the kernel is not used here, for the start-up line; empty when it is."""
    if _KERNEL is not None:
        return ""
    try:
        from worker.model import _q4q8  # type: ignore[attr-defined]  # noqa: F401
    except ImportError:
        return "the _q4q8 extension was not built (no C compiler at install?)"
    return "this CPU lacks AVX2, FMA or F16C"


@dataclass(frozen=True, eq=False)
class Q4Q8Linear(Linear):
    packed: torch.Tensor  # [tiles, groups, 4, 8, 4] uint8: the stored nibble bytes, 8 rows interleaved
    scales: torch.Tensor  # [tiles, groups, 2, 8] float16: d then m of each of the tile's 8 rows
    rows: int  # out_features; the tiles may hold up to 7 zero rows past it
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert _KERNEL is not None, "Q4Q8Linear is built only where the kernel runs"
        source = x.float().contiguous()
        tokens, cols = source.shape
        padded = self.packed.shape[0] * TILE
        y = torch.empty(tokens, padded, dtype=torch.float32)
        _KERNEL.linear(
            source.data_ptr(),
            tokens,
            cols,
            self.packed.data_ptr(),
            self.scales.data_ptr(),
            padded,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        out = (y if padded == self.rows else y[:, : self.rows]).to(x.dtype)
        return out if self.bias is None else out + self.bias

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.packed.numel() + self.scales.numel() * 2 + extra

    @property
    def out_features(self) -> int:
        return self.rows

    @classmethod
    def from_stored(cls, stored: StoredTensor, bias: torch.Tensor | None) -> Q4Q8Linear:
        """Q4_0 or Q4_1 blocks: their nibbles and float16 scales as stored (Q4_0's m is -8 d, exact)."""
        rows, cols = stored.shape
        blocks = stored.blocks.reshape(rows, cols // GROUP, -1)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16))[..., 0]
        if stored.kind == gguf.GGMLQuantizationType.Q4_1:
            m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16))[..., 0]
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
        pad = -rows % TILE
        if pad:  # zero rows complete the last tile; their outputs are dropped
            nibbles = torch.cat([nibbles, nibbles.new_zeros(pad, groups, _NIBBLE_BYTES)])
            d = torch.cat([d, d.new_zeros(pad, groups)])
            m = torch.cat([m, m.new_zeros(pad, groups)])
        tiles = (rows + pad) // TILE
        # [tiles, 8 rows, groups, 4 vectors, 4 bytes] -> [tiles, groups, 4 vectors, 8 rows, 4 bytes]
        packed = nibbles.reshape(tiles, TILE, groups, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
        per_tile = [t.reshape(tiles, TILE, groups).permute(0, 2, 1) for t in (d, m)]
        scales = torch.stack(per_tile, dim=2).contiguous()
        return cls(packed, scales, rows, bias)
