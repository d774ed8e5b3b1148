"""The decoder's norms and rotation as one C call each (worker/model/row_ops.c, the `_row_ops`
extension pip builds), for the quantised forms on a CPU with AVX2 and FMA: the `RowOps` interface
(worker/model/row_ops.py) over float32 contiguous rows.

Each call hands the extension its tensors' addresses; the outputs are allocated here, the residual
stream and the fused projection's output are written in place (the interface allows it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model.row_ops import QKV, RowOps
from worker.native import load_extension

# OPS is None where they do not run, and UNAVAILABLE_REASON says why (empty where they run).
OPS, UNAVAILABLE_REASON = load_extension("worker.model._row_ops", needs="AVX2 or FMA")


def native_row_ops_available() -> bool:
    return OPS is not None


def _float32_rows(x: torch.Tensor) -> torch.Tensor:
    """x as float32 rows of contiguous values (any row stride is copied away)."""
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


@dataclass(frozen=True)
class NativeRowOps(RowOps):
    def __post_init__(self) -> None:
        assert OPS is not None, "NativeRowOps is built only where the row ops run"

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x, weight = _float32_rows(x), _float32_rows(weight)
        out = torch.empty_like(x)
        self.add_norm_at(x.data_ptr(), 0, weight.data_ptr(), out.data_ptr(), rows=x.shape[0], cols=x.shape[1])
        return out

    def add_norm(
        self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, weight = _float32_rows(x), _float32_rows(y), _float32_rows(weight)
        out = torch.empty_like(x)
        self.add_norm_at(
            x.data_ptr(), y.data_ptr(), weight.data_ptr(), out.data_ptr(), rows=x.shape[0], cols=x.shape[1]
        )
        return x, out

    def rotate(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> QKV:
        qkv = _float32_rows(qkv)
        cos, signed_sin = _float32_rows(cos), _float32_rows(signed_sin)
        self.rotate_at(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], cos.data_ptr(), signed_sin.data_ptr())
        return self.heads(*self.split(qkv))

    def add_norm_at(
        self, x_at: int, add_at: int, weight_at: int, out_at: int, *, rows: int, cols: int
    ) -> None:
        """add_norm by address, the caller's float32 contiguous [rows, cols] tensors: x += add (none
        where add_at is 0), out = rms_norm(x) * weight."""
        assert OPS is not None
        OPS.add_rms_norm(x_at, add_at, weight_at, self.config.rms_norm_eps, out_at, rows, cols)

    def rotate_at(self, qkv_at: int, rows: int, row_stride: int, cos_at: int, sin_at: int) -> None:
        """rotate by address, in place: rows of the fused projection `row_stride` floats apart, the
        tables [rows, head_dim] float32 contiguous."""
        assert OPS is not None
        c = self.config
        OPS.rotate(qkv_at, rows, row_stride, c.num_heads + c.num_kv_heads, c.head_dim, cos_at, sin_at)
