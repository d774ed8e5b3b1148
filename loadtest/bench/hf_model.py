"""Our fused weights back into a transformers `LlamaForCausalLM`, for the `hf` mode and its test.

The comparison is only fair with the very same weights, so rather than load the checkpoint a
second way this un-fuses what the engine holds: qkv rows split back into q/k/v, gate_up into
gate/up. transformers is imported here, lazily: the runtime never depends on it.
Qwen2-style q/k/v biases map onto Llama's `attention_bias`, which also gives o_proj a bias; that
one is set to zero, so the architecture stays Qwen2's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from worker.model.config import ModelConfig
from worker.model.embedding import FloatEmbedding
from worker.model.linear import FloatLinear, Linear
from worker.model.loader import LoadedModel

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger(__name__)


def hf_config(config: ModelConfig) -> LlamaConfig:
    from transformers import LlamaConfig

    # Passed through a dict: transformers 5 takes rope_theta as a legacy keyword its signature omits.
    options: dict[str, Any] = {"rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        scaling = config.rope_scaling
        options["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        mlp_bias=False,
        **options,
    )


def _rows(fused: torch.Tensor, *sizes: int) -> list[torch.Tensor]:
    """Consecutive row blocks of a fused tensor (views, no copies)."""
    if sum(sizes) != fused.shape[0]:
        raise ValueError(f"fused tensor has {fused.shape[0]} rows, expected {sum(sizes)}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [fused[start : start + size] for start, size in zip(starts, sizes, strict=True)]


def _dense(linear: Linear) -> FloatLinear:
    if not isinstance(linear, FloatLinear):
        raise ValueError("a transformers copy needs the float weight form (load with weights='float')")
    return linear


def hf_state_dict(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """The weights in Hugging Face Llama naming (the inverse of `ModelWeights.from_hf_state`)."""
    c, w = loaded.config, loaded.weights
    if not isinstance(w.embed, FloatEmbedding):
        raise ValueError("a transformers copy needs the float weight form (load with weights='float')")
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    state = {
        "model.embed_tokens.weight": w.embed.table,
        "model.norm.weight": w.final_norm,
        "lm_head.weight": _dense(w.lm_head).weight,
    }
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        qkv = _dense(layer.qkv)
        q, k, v = _rows(qkv.weight, q_rows, kv_rows, kv_rows)
        gate, up = _rows(_dense(layer.gate_up).weight, c.intermediate_size, c.intermediate_size)
        state |= {
            p + "input_layernorm.weight": layer.input_norm,
            p + "post_attention_layernorm.weight": layer.post_attention_norm,
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": _dense(layer.o_proj).weight,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": _dense(layer.down).weight,
        }
        if qkv.bias is not None:
            q_bias, k_bias, v_bias = _rows(qkv.bias, q_rows, kv_rows, kv_rows)
            state |= {
                p + "self_attn.q_proj.bias": q_bias,
                p + "self_attn.k_proj.bias": k_bias,
                p + "self_attn.v_proj.bias": v_bias,
                p + "self_attn.o_proj.bias": q_bias.new_zeros(c.hidden_size),
            }
    return state


def to_hf_llama(loaded: LoadedModel) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` in eval mode on the weights' device and dtype, holding copies of them."""
    from transformers import LlamaForCausalLM

    reference = loaded.weights.final_norm
    # Built on the weights' device: its random initialisation, which load_state_dict overwrites, takes
    # seconds there and minutes on the host for an 8B shape (seen on the H200: the hf run never started).
    with torch.device(reference.device):
        model = LlamaForCausalLM(hf_config(loaded.config))
    # strict: a name the converter forgot (or one transformers renamed) fails here, not as noise. With
    # tied embeddings lm_head and embed are one parameter and both names carry the same tensor.
    model.load_state_dict(hf_state_dict(loaded), strict=True)
    # nn.Module.to moves in place; transformers' override adds only quantization guards.
    torch.nn.Module.to(model, device=reference.device, dtype=reference.dtype)
    model.train(False)  # eval(); transformers' stubs leave eval untyped
    logger.info(
        "transformers copy of %s built (%s, %s)", loaded.config.name, reference.device, reference.dtype
    )
    return model
