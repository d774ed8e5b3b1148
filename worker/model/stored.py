"""A weight matrix as a GGUF file stores it: quantised blocks along each row, never dequantised whole.

GGUF quantises a matrix row by row in blocks along the input dimension (32 values for the legacy
types, 256 for K-quants), so rows are independent: concatenating matrices along their rows, or
permuting rows, is the same operation on the block bytes as on the dequantised values. That lets
the loader fuse q/k/v and gate/up, and undo llama.cpp's q/k row permutation, on the stored bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import numpy.typing as npt
import torch


@dataclass(frozen=True)
class StoredTensor:
    """A [rows, cols] matrix in its stored GGUF blocks: `blocks` is [rows, bytes per row] of uint8."""

    kind: gguf.GGMLQuantizationType
    blocks: npt.NDArray[np.uint8]
    cols: int

    def __post_init__(self) -> None:
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[self.kind]
        if self.cols % block_values or self.blocks.shape[1] != self.cols // block_values * block_bytes:
            raise ValueError(
                f"{self.kind.name} rows of {self.cols} values take {self.cols // block_values} blocks of "
                f"{block_bytes} bytes, not {self.blocks.shape[1]} bytes"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.blocks.shape[0]), self.cols)

    @property
    def num_bytes(self) -> int:
        return int(self.blocks.nbytes)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], exactly as gguf's reference dequantiser computes it."""
        values = gguf.quants.dequantize(self.blocks, self.kind)
        return torch.from_numpy(np.require(values, dtype=np.float32, requirements=["C", "W"]))

    def dequantize_rows(self, rows: npt.NDArray[np.int64]) -> torch.Tensor:
        """float32 [len(rows), cols]: only these rows (an embedding lookup), exactly as `dequantize`."""
        values = gguf.quants.dequantize(self.blocks[rows], self.kind)
        return torch.from_numpy(np.require(values, dtype=np.float32, requirements=["C", "W"]))

    def block_float16(self, start: int) -> torch.Tensor:
        """[rows, blocks] float16: the field at byte `start` of every block (a scale `d`, an offset `m`)."""
        block_values, _ = gguf.GGML_QUANT_SIZES[self.kind]
        blocks = self.blocks.reshape(self.blocks.shape[0], self.cols // block_values, -1)
        return torch.from_numpy(blocks[..., start : start + 2].copy().view(np.float16))[..., 0]

    def permute_rows(self, order: npt.NDArray[np.int64]) -> StoredTensor:
        return StoredTensor(self.kind, np.ascontiguousarray(self.blocks[order]), self.cols)

    @staticmethod
    def cat(parts: Sequence[StoredTensor]) -> StoredTensor:
        """Stack matrices of one type and width along their rows (the fused projections)."""
        kinds = {part.kind for part in parts}
        cols = {part.cols for part in parts}
        if len(kinds) != 1 or len(cols) != 1:
            raise ValueError(f"cannot stack stored tensors of types {kinds} and widths {cols}")
        return StoredTensor(parts[0].kind, np.concatenate([part.blocks for part in parts]), parts[0].cols)
