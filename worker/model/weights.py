"""Model weights in the layout the forward pass wants: q/k/v and gate/up fused into one matmul each.

Every loader produces a state dict in Hugging Face's Llama naming and hands it to
`ModelWeights.from_hf_state`, so the fusing and the checks live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model.config import ModelConfig


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate rows first
    down: torch.Tensor


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # the same storage as `embed` when embeddings are tied

    @classmethod
    def from_hf_state(
        cls,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> ModelWeights:
        def take(name: str) -> torch.Tensor:
            try:
                tensor = state[name]
            except KeyError:
                raise ValueError(f"checkpoint has no tensor {name!r}") from None
            return tensor.to(device=device, dtype=dtype).contiguous()

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            qkv = torch.cat(
                [take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight")]
            )
            expected_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
            if qkv.shape != (expected_rows, config.hidden_size):
                raise ValueError(
                    f"layer {i}: fused qkv has shape {tuple(qkv.shape)}, "
                    f"expected {expected_rows}x{config.hidden_size}"
                )
            bias = None
            if config.attention_bias:
                bias = torch.cat(
                    [take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias")]
                )
            mlp = p + "mlp."
            layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=qkv,
                    qkv_bias=bias,
                    o_proj=take(attn + "o_proj.weight"),
                    post_attention_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]),
                    down=take(mlp + "down_proj.weight"),
                )
            )
        embed = take("model.embed_tokens.weight")
        if embed.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"embedding has shape {tuple(embed.shape)}, expected {config.vocab_size}x{config.hidden_size}"
            )
        tied = config.tie_word_embeddings or "lm_head.weight" not in state
        return cls(
            embed=embed,
            layers=tuple(layers),
            final_norm=take("model.norm.weight"),
            lm_head=embed if tied else take("lm_head.weight"),
        )

    def _tensors(self) -> list[torch.Tensor]:
        tensors = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [
                layer.input_norm,
                layer.qkv,
                layer.o_proj,
                layer.post_attention_norm,
                layer.gate_up,
                layer.down,
            ]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
        return tensors

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def bytes_read_per_step(self) -> int:
        """The bytes a forward step reads whole, whatever its batch: every weight but an untied
        embedding table, of which a step gathers only its tokens' rows (the memory-bandwidth floor)."""
        untied_embed = self.embed.numel() * self.embed.element_size() if self.lm_head is not self.embed else 0
        return self.num_bytes() - untied_embed
