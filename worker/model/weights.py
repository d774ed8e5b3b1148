"""Model weights in the layout the forward pass wants: q/k/v and gate/up fused into one matmul each.

Every loader produces a state dict in Hugging Face's Llama naming (dense tensors, or GGUF matrices
in their stored blocks) and hands it to `ModelWeights.from_hf_state`, so the fusing, the checks
and the choice of each matrix's form (worker/model/weight_form.py) live in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from worker.model.config import ModelConfig
from worker.model.embedding import Embedding, FloatEmbedding
from worker.model.linear import FloatLinear, Linear
from worker.model.weight_form import Source, WeightForm, as_float


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden], with Qwen2's bias
    o_proj: Linear
    post_attention_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]: gate rows first
    down: Linear

    def linears(self) -> tuple[Linear, ...]:
        return (self.qkv, self.o_proj, self.gate_up, self.down)


@dataclass(frozen=True)
class ModelWeights:
    embed: Embedding
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: Linear  # under `float` with tied embeddings, the same storage as `embed`'s table
    form: str  # the resolved weight form: float, int8 or int4
    kernels: str  # what multiplies them here (WeightForm.kernels), for the start-up line

    @classmethod
    def from_hf_state(
        cls,
        config: ModelConfig,
        state: Mapping[str, Source],
        *,
        dtype: torch.dtype,
        device: torch.device,
        form: WeightForm | None = None,
    ) -> ModelWeights:
        form = form or WeightForm("float", dtype, device)

        def source(name: str) -> Source:
            try:
                return state[name]
            except KeyError:
                raise ValueError(f"checkpoint has no tensor {name!r}") from None

        def take(name: str) -> torch.Tensor:
            return as_float(source(name)).to(device=device, dtype=dtype).contiguous()

        def rows(part: Source) -> int:
            return int(part.shape[0])

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            qkv_parts = [source(attn + f"{x}_proj.weight") for x in "qkv"]
            expected_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
            shape = (sum(rows(x) for x in qkv_parts), int(qkv_parts[0].shape[1]))
            if shape != (expected_rows, config.hidden_size):
                raise ValueError(
                    f"layer {i}: fused qkv has shape {shape}, expected {expected_rows}x{config.hidden_size}"
                )
            bias = None
            if config.attention_bias:
                bias = torch.cat([take(attn + f"{x}_proj.bias") for x in "qkv"])
            mlp = p + "mlp."
            layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=form.linear(qkv_parts, bias, what=f"layer {i} qkv"),
                    o_proj=form.linear([source(attn + "o_proj.weight")], None, what=f"layer {i} o_proj"),
                    post_attention_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=form.linear(
                        [source(mlp + "gate_proj.weight"), source(mlp + "up_proj.weight")],
                        None,
                        what=f"layer {i} gate_up",
                    ),
                    down=form.linear([source(mlp + "down_proj.weight")], None, what=f"layer {i} down"),
                )
            )
        embed_source = source("model.embed_tokens.weight")
        if tuple(embed_source.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"embedding has shape {tuple(embed_source.shape)}, "
                f"expected {config.vocab_size}x{config.hidden_size}"
            )
        embed = form.embedding(embed_source)
        tied = config.tie_word_embeddings or "lm_head.weight" not in state
        lm_head: Linear
        if tied and isinstance(embed, FloatEmbedding) and form.name == "float":
            lm_head = FloatLinear(embed.table)  # one table: the lookup and the projection share it
        else:
            head_source = embed_source if tied else source("lm_head.weight")
            lm_head = form.output_projection(head_source)
        return cls(
            embed=embed,
            layers=tuple(layers),
            final_norm=take("model.norm.weight"),
            lm_head=lm_head,
            form=form.name,
            kernels=form.kernels(),
        )

    def _tied(self) -> bool:
        """Whether the output projection reads the embedding's own storage (float, tied)."""
        return (
            isinstance(self.embed, FloatEmbedding)
            and isinstance(self.lm_head, FloatLinear)
            and self.lm_head.weight is self.embed.table
        )

    def _norm_bytes(self) -> int:
        norms = [self.final_norm]
        for layer in self.layers:
            norms += [layer.input_norm, layer.post_attention_norm]
        return sum(t.numel() * t.element_size() for t in norms)

    def num_bytes(self) -> int:
        """Every resident weight byte: the matrices in their form, the embedding, the norms."""
        return self.bytes_read_per_step() + (0 if self._tied() else self.embed.num_bytes)

    def bytes_read_per_step(self) -> int:
        """The bytes a forward step reads whole, whatever its batch: every matrix (the output
        projection included) and norm, but not an embedding table of its own, of which a step gathers
        only its tokens' rows (the memory-bandwidth floor)."""
        matrices = sum(linear.num_bytes for layer in self.layers for linear in layer.linears())
        return matrices + self.lm_head.num_bytes + self._norm_bytes()
