"""The decoder's row-wise ops between its matrices: the RMS norms with the residual adds before them,
the rotary embedding of q and k, SiLU(gate) x up (torch's in both). One interface, two
implementations:

- `TorchRowOps` (here): torch's ops, the `float` form's, on which its parity with transformers rests
  (`F.rms_norm` equals transformers' composite bit for bit), and every form's on CUDA;
- `NativeRowOps` (row_ops_native.py): the norms and the rotation as one C call each
  (worker/model/row_ops.c), for the quantised forms on a CPU with AVX2, where torch's dispatch of
  these small ops cost ~10-20% of a decode step.

Both keep the engine's promise: a row's outputs depend on that row alone, computed the same way
whatever the step's shape (torch's reductions here are shape-independent: worker/numerics.py).
The model picks one at load (worker/model/llama.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig
from worker.model.rope import apply_rotary

# Views of one step's q, k and v, [tokens, heads, head_dim] each.
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class RowOps(ABC):
    config: ModelConfig

    @abstractmethod
    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rms_norm(x) * weight, [tokens, hidden]."""

    @abstractmethod
    def add_norm(
        self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, rms_norm(x + y) * weight). `x` is the forward's own residual stream: it may be
        written in place (and is then the first tensor returned)."""

    @abstractmethod
    def rotate(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> QKV:
        """q and k rotated for their positions, and v, from the fused projection's output [tokens,
        columns]; cos and signed_sin are the rows' tables (rope.py's `tables`). `qkv` may be
        written in place: q, k and v may be views of it."""

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up of the fused projection's output [tokens, 2 * intermediate] (gate first):
        torch's in both implementations. A C form (a Cephes-style exp, within 2.0 float32 eps where
        torch's is within 1.4) saved ~0.1 ms a SmolLM2 step and left int4 further from the float
        path than torch's SiLU did (docs/benchmarks.md, "The decoder's row ops in C")."""
        gate, up = gate_up.chunk(2, dim=-1)
        if out is not None:  # the same products, into the caller's tensor
            return torch.mul(F.silu(gate), up, out=out)
        return F.silu(gate) * up

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the fused projection's output [tokens, columns]: q and k together [tokens,
        heads + kv_heads, head_dim] (the vectors the rotation turns), and v [tokens, kv_heads,
        head_dim]."""
        c = self.config
        tokens = qkv.shape[0]
        q_and_k = (c.num_heads + c.num_kv_heads) * c.head_dim
        qk = qkv.narrow(1, 0, q_and_k).view(tokens, c.num_heads + c.num_kv_heads, c.head_dim)
        v = qkv.narrow(1, q_and_k, c.num_kv_heads * c.head_dim).view(tokens, c.num_kv_heads, c.head_dim)
        return qk, v

    def heads(self, qk: torch.Tensor, v: torch.Tensor) -> QKV:
        """q and k as views of `qk` [tokens, heads + kv_heads, head_dim], with v."""
        c = self.config
        return qk.narrow(1, 0, c.num_heads), qk.narrow(1, c.num_heads, c.num_kv_heads), v


@dataclass(frozen=True)
class TorchRowOps(RowOps):
    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.config.hidden_size,), weight, self.config.rms_norm_eps)

    def add_norm(
        self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + y
        return x, self.norm(x, weight)

    def rotate(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> QKV:
        qk, v = self.split(qkv)
        return self.heads(apply_rotary(qk, cos, signed_sin), v)
