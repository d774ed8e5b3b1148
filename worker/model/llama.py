"""The Llama-family decoder forward (Llama, Qwen2 with q/k/v bias, SmolLM2) over a ragged token batch.

No nn.Module: the weights are plain tensors and `Linear`s (worker/model/linear.py, in the form
chosen at load), the ops between them a `RowOps` (worker/model/row_ops.py, chosen with the form),
and a step is one straight pass, so the per-layer Python overhead stays small. Attention (and the
KV writes) go through the backend given to `forward`; logits are computed only for the rows that
are sampled.
"""

from __future__ import annotations

import logging

import torch

from worker.attention.base import AttentionBackend
from worker.attention.cpu_backend import CpuAttention
from worker.model.config import ModelConfig
from worker.model.native_forward import NativeForward
from worker.model.rope import RotaryEmbedding
from worker.model.row_ops import RowOps, TorchRowOps
from worker.model.row_ops_native import UNAVAILABLE_REASON, NativeRowOps, native_row_ops_available
from worker.model.weights import ModelWeights

logger = logging.getLogger(__name__)


class LlamaModel:
    def __init__(
        self, config: ModelConfig, weights: ModelWeights, *, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.rope = RotaryEmbedding(config, dtype=dtype, device=device)
        self.row_ops = choose_row_ops(config, weights.form, device=device, dtype=dtype)
        # Every layer's kernels called by address where all of them run natively (native_forward.py).
        self.native = NativeForward.build(config, weights, self.row_ops)
        if self.native is not None:
            logger.info("forward: each layer's kernels by address (worker/model/native_forward.py)")

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        """Final-normed hidden states [tokens, hidden]; writes every layer's KV for these tokens."""
        if self.native is not None and isinstance(attention, CpuAttention):
            return self.native.forward(input_ids, positions, self.rope, attention)
        return self.forward_op_by_op(input_ids, positions, attention)

    @torch.inference_mode()
    def forward_op_by_op(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        """`forward` through each op's tensor interface: every form and backend's path, and the native
        one's reference (the same kernels in the same order, so the same bits)."""
        ops = self.row_ops
        layers = self.weights.layers
        tokens = input_ids.shape[0]
        cos, sin = self.rope.tables(positions)
        # The residual stream: a new tensor each forward (the embedding's contract), so the ops may
        # add into it in place.
        x = self.weights.embed(input_ids)
        h = ops.norm(x, layers[0].input_norm)
        for index, layer in enumerate(layers):
            q, k, v = ops.rotate(layer.qkv(h), cos, sin)
            attended = attention.forward(index, q, k, v)
            x, h = ops.add_norm(x, layer.o_proj(attended.view(tokens, -1)), layer.post_attention_norm)
            last = index + 1 == len(layers)
            next_norm = self.weights.final_norm if last else layers[index + 1].input_norm
            x, h = ops.add_norm(x, layer.down(ops.silu_mul(layer.gate_up(h))), next_norm)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] for the hidden states of the sampled positions only."""
        return self.weights.lm_head(hidden).float()


def choose_row_ops(config: ModelConfig, form: str, *, device: torch.device, dtype: torch.dtype) -> RowOps:
    """The native row ops for a quantised form on the CPU in float32, where they run; torch's
    otherwise. The `float` form always keeps torch's: its parity with transformers rests on their bits."""
    if form != "float" and device.type == "cpu" and dtype == torch.float32:
        if native_row_ops_available():
            logger.info("row ops: native (worker/model/row_ops.c)")
            return NativeRowOps(config)
        logger.info("row ops: torch's (%s)", UNAVAILABLE_REASON)
    return TorchRowOps(config)
