"""The decoder forward as the C kernels' calls by address, with nothing of torch between them but SiLU:
for a quantised form on the CPU where every piece of a layer runs natively (the block dot-product
kernels, worker/model/block_dot.py; the native row ops, row_ops_native.py; the `cpu` attention kernel,
worker/attention/cpu_backend.py).

Why: a SmolLM2 decode step is ~9 kernel calls a layer, 30 layers, and each call through its tensor
wrapper (views, allocations, dtype and stride checks, `data_ptr`s) cost 5-19 us of host time. Here a
forward allocates its buffers once, takes every address once, and each layer is the kernels' calls
with ints: a decode step 0.75-0.89x the op-by-op one's time, ~2 ms less (Xeon VM, docs/benchmarks.md,
"The decoder layer by address").

The promise holds by construction: the same kernels on the same inputs in the same order as
`LlamaModel.forward_op_by_op`, so the same bits (tests/worker/test_native_forward.py compares the two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention.cpu_backend import CpuAttention
from worker.model.block_dot import BlockDotLinear
from worker.model.config import ModelConfig
from worker.model.rope import RotaryEmbedding
from worker.model.row_ops import RowOps
from worker.model.row_ops_native import NativeRowOps
from worker.model.weights import ModelWeights

_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class _Layer:
    """One layer's matrices and the addresses of its norms' weights (the next norm is the next layer's
    input norm, or the final norm after the last layer)."""

    qkv: BlockDotLinear
    o_proj: BlockDotLinear
    gate_up: BlockDotLinear
    down: BlockDotLinear
    post_attention_norm_at: int
    next_norm_at: int


class NativeForward:
    """`LlamaModel.forward` for a model whose every layer runs natively; built by `build`."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, row_ops: NativeRowOps) -> None:
        self.config = config
        self.weights = weights
        self.row_ops = row_ops
        norms = [layer.input_norm for layer in weights.layers[1:]] + [weights.final_norm]
        # The weights' tensors are never replaced, so their addresses hold for the model's life.
        self.layers = tuple(
            _Layer(
                qkv=_block(layer.qkv),
                o_proj=_block(layer.o_proj),
                gate_up=_block(layer.gate_up),
                down=_block(layer.down),
                post_attention_norm_at=layer.post_attention_norm.data_ptr(),
                next_norm_at=norm.data_ptr(),
            )
            for layer, norm in zip(weights.layers, norms, strict=True)
        )

    @classmethod
    def build(cls, config: ModelConfig, weights: ModelWeights, row_ops: RowOps) -> NativeForward | None:
        """The native forward where every piece of every layer runs natively, else None (the model
        keeps its op-by-op forward): the native row ops, float32 contiguous norms, and block matrices
        with no bias whose tiles hold exactly the residual's and the SiLU's columns."""
        if not isinstance(row_ops, NativeRowOps):
            return None
        hidden, intermediate = config.hidden_size, config.intermediate_size
        for layer in weights.layers:
            matrices = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            if not all(isinstance(m, BlockDotLinear) and m.bias is None for m in matrices):
                return None
            widths = tuple(_block(m).padded_features for m in matrices[1:])
            if widths != (hidden, 2 * intermediate, hidden):
                return None
        norms = [weights.final_norm]
        for layer in weights.layers:
            norms += [layer.input_norm, layer.post_attention_norm]
        if not all(n.dtype == torch.float32 and n.is_contiguous() for n in norms):
            return None
        return cls(config, weights, row_ops)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attention: CpuAttention
    ) -> torch.Tensor:
        """Final-normed hidden states [tokens, hidden]; writes every layer's KV for these tokens."""
        c = self.config
        ops = self.row_ops
        tokens = input_ids.shape[0]
        threads = torch.get_num_threads()
        hidden, intermediate = c.hidden_size, c.intermediate_size
        heads, kv_heads, head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        cos, sin = (table.reshape(tokens, head_dim).float().contiguous() for table in rope.tables(positions))
        # The residual stream: a new tensor (the embedding's contract), written in place.
        x = self.weights.embed(input_ids).float().contiguous()
        h = ops.norm(x, self.weights.layers[0].input_norm)
        qkv_width = self.layers[0].qkv.padded_features
        qkv = torch.empty(tokens, qkv_width)
        attended = torch.empty(tokens, heads * head_dim)
        o_out = torch.empty(tokens, hidden)
        gate_up = torch.empty(tokens, 2 * intermediate)
        act = torch.empty(tokens, intermediate)
        down_out = torch.empty(tokens, hidden)
        x_at, h_at, qkv_at, attended_at = x.data_ptr(), h.data_ptr(), qkv.data_ptr(), attended.data_ptr()
        o_at, gate_up_at, act_at = o_out.data_ptr(), gate_up.data_ptr(), act.data_ptr()
        down_at = down_out.data_ptr()
        cos_at, sin_at = cos.data_ptr(), sin.data_ptr()
        # q, k and v side by side in each row of the fused projection's output, qkv_width floats apart.
        k_at = qkv_at + heads * head_dim * _FLOAT32_BYTES
        v_at = k_at + kv_heads * head_dim * _FLOAT32_BYTES
        qkv_rows = (qkv_at, qkv_width, k_at, qkv_width, v_at, qkv_width)
        for index, layer in enumerate(self.layers):
            layer.qkv.multiply(h_at, tokens, hidden, qkv_at, threads)
            ops.rotate_at(qkv_at, tokens, qkv_width, cos_at, sin_at)
            attention.attend_at(index, qkv_rows, tokens, attended_at, threads)
            layer.o_proj.multiply(attended_at, tokens, heads * head_dim, o_at, threads)
            ops.add_norm_at(x_at, o_at, layer.post_attention_norm_at, h_at, rows=tokens, cols=hidden)
            layer.gate_up.multiply(h_at, tokens, hidden, gate_up_at, threads)
            ops.silu_mul(gate_up, out=act)
            layer.down.multiply(act_at, tokens, intermediate, down_at, threads)
            ops.add_norm_at(x_at, down_at, layer.next_norm_at, h_at, rows=tokens, cols=hidden)
        return h


def _block(linear: object) -> BlockDotLinear:
    assert isinstance(linear, BlockDotLinear), "build() checked every matrix"
    return linear
