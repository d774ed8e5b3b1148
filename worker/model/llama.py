"""The Llama-family decoder forward (Llama, Qwen2 with q/k/v bias, SmolLM2) over a ragged token batch.

No nn.Module: the weights are plain tensors and `Linear`s (worker/model/linear.py, in the form
chosen at load) and a step is one straight pass, so the per-layer
Python overhead stays small. Attention (and the KV writes) go through the backend given to
`forward`; logits are computed only for the rows that are sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.rope import RotaryEmbedding, apply_rotary
from worker.model.weights import ModelWeights


class LlamaModel:
    def __init__(
        self, config: ModelConfig, weights: ModelWeights, *, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.rope = RotaryEmbedding(config, dtype=dtype, device=device)
        c = config
        # q and k are rotated together: the first (heads + kv_heads) * head_dim columns of qkv.
        self._rotated = (c.num_heads + c.num_kv_heads) * c.head_dim

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        """Final-normed hidden states [tokens, hidden]; writes every layer's KV for these tokens."""
        c = self.config
        eps = c.rms_norm_eps
        tokens = input_ids.shape[0]
        cos, sin = self.rope.tables(positions)
        x = self.weights.embed(input_ids)
        for index, layer in enumerate(self.weights.layers):
            h = F.rms_norm(x, (c.hidden_size,), layer.input_norm, eps)
            qkv = layer.qkv(h)
            qk = qkv.narrow(1, 0, self._rotated).view(tokens, c.num_heads + c.num_kv_heads, c.head_dim)
            qk = apply_rotary(qk, cos, sin)
            q, k = qk.narrow(1, 0, c.num_heads), qk.narrow(1, c.num_heads, c.num_kv_heads)
            v = qkv.narrow(1, self._rotated, c.num_kv_heads * c.head_dim)
            v = v.view(tokens, c.num_kv_heads, c.head_dim)
            attended = attention.forward(index, q, k, v)
            x = x + layer.o_proj(attended.view(tokens, -1))
            h = F.rms_norm(x, (c.hidden_size,), layer.post_attention_norm, eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return F.rms_norm(x, (c.hidden_size,), self.weights.final_norm, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] for the hidden states of the sampled positions only."""
        return self.weights.lm_head(hidden).float()
