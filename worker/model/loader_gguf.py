"""Load a llama.cpp GGUF file (Llama or Qwen2 architecture) into the engine's weights and tokenizer.

Quantised matrices are handed over in their stored blocks (`StoredTensor`), float ones as tensors;
the weight form (`--weights`, worker/model/weight_form.py) then decides per matrix whether it is
dequantised (`float`: whatever `gguf.quants` can decode) or served quantised. The tensors are
renamed to Hugging Face's Llama names and handed to `ModelWeights.from_hf_state`, the single
assembly path shared with the safetensors loader. llama.cpp's converter stores Llama's q/k rows
permuted for its interleaved RoPE; our forward uses HF's rotate-half RoPE, so that permutation is
undone here, on the stored rows.
"""

from __future__ import annotations

import logging
import math
import re
import time
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np
import numpy.typing as npt
import torch

from worker.model.config import Llama3RopeScaling, ModelConfig
from worker.model.rope import inverse_frequencies
from worker.model.stored import StoredTensor
from worker.model.weight_form import Source, resolve_weight_form
from worker.model.weights import ModelWeights
from worker.tokenizer.gguf import field_value, special_token_ids, tokenizer_from_gguf
from worker.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Architectures whose llama.cpp converter permutes q/k rows (LlamaModel.permute); Qwen2 is stored as in HF.
_PERMUTED_QK_ARCHS = frozenset({"llama"})
_SUPPORTED_ARCHS = frozenset({"llama", "qwen2"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
# Llama 3.x's native context; only used to spell out the scaling, the frequencies do not depend on it.
_DEFAULT_ORIGINAL_CONTEXT = 8192

FloatArray = npt.NDArray[np.float32]
_Item = TypeVar("_Item", bound=np.generic)


# Types handed over as dense tensors: nothing to gain from keeping their bytes.
_DENSE_TYPES = frozenset(
    {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
)


def load_gguf(
    path: Path, *, device: torch.device, dtype: torch.dtype, name: str, weights: str = "float"
) -> tuple[ModelConfig, ModelWeights, Tokenizer]:
    started = time.perf_counter()
    reader = gguf.GGUFReader(path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    arch = _architecture(reader)
    config = config_from_gguf(reader, tensors, name=name)
    tokenizer = tokenizer_from_gguf(reader)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}"
        )
    state = _hf_state(config, tensors, permuted_qk=arch in _PERMUTED_QK_ARCHS, dtype=dtype)
    stored_types = frozenset(t.kind for t in state.values() if isinstance(t, StoredTensor))
    form = resolve_weight_form(weights, device=device, dtype=dtype, stored_types=stored_types)
    model_weights = ModelWeights.from_hf_state(config, state, dtype=dtype, device=device, form=form)
    logger.info(
        "loaded %s from %s: %d tensors in %.2f s",
        config.name,
        path.name,
        len(tensors),
        time.perf_counter() - started,
    )
    return config, model_weights, tokenizer


def _architecture(reader: gguf.GGUFReader) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_SUPPORTED_ARCHS))}"
        )
    return str(arch)


def config_from_gguf(
    reader: gguf.GGUFReader, tensors: dict[str, gguf.ReaderTensor], *, name: str
) -> ModelConfig:
    arch = _architecture(reader)

    # A key with no default is required; per-layer arrays (as in OpenELM) have no place in ModelConfig.
    def get(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None and default is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):
            raise ValueError(f"{arch}.{key} varies per layer, which is not supported")
        return default if value is None else value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = (
        int(get("attention.key_length", 0)) or int(get("rope.dimension_count", 0)) or hidden // num_heads
    )
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary embedding ({rotary_dim} of {head_dim} dims) is not supported")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError("GGUF file has no token_embd.weight")
    vocab_size = int(get("vocab_size", 0)) or int(embed.shape[-1])  # GGUF shape: [hidden, vocab]
    rope_theta = _decimal_f32(get("rope.freq_base", 10000.0))
    bos, eos = special_token_ids(reader)
    return ModelConfig(
        name=name,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_decimal_f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=_rope_scaling(reader, arch, tensors, head_dim=head_dim, theta=rope_theta),
        bos_token_id=bos,
        eos_token_ids=eos,
    )


def _decimal_f32(value: float) -> float:
    """GGUF stores float32: recover the decimal the converter was given (1e-05, not 9.99999975e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(
    reader: gguf.GGUFReader, arch: str, tensors: dict[str, gguf.ReaderTensor], *, head_dim: int, theta: float
) -> Llama3RopeScaling | None:
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r}: only Llama-3 frequency factors are")
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    if kind is None and factor not in (None, 0.0, 1.0):
        raise ValueError(f"GGUF sets {arch}.rope.scaling.factor={factor} without a scaling type")
    freqs = tensors.get(_ROPE_FREQS)
    if freqs is None:
        return None
    # llama.cpp's converter writes Llama 3.1's scaling only as per-frequency divisors (rope_freqs).
    divisors = _dequantize(freqs).reshape(-1).astype(np.float64)
    original = (
        field_value(reader, f"{arch}.rope.scaling.original_context_length") or _DEFAULT_ORIGINAL_CONTEXT
    )
    return llama3_scaling_from_divisors(
        divisors, head_dim=head_dim, theta=theta, original_context=int(original)
    )


def llama3_scaling_from_divisors(
    divisors: npt.NDArray[np.float64], *, head_dim: int, theta: float, original_context: int
) -> Llama3RopeScaling | None:
    """The Llama-3 scaling whose inverse frequencies are `base / divisors`, verified to reproduce them.

    Long wavelengths are divided by `factor`, short ones by 1; in between, the smoothing weight
    s = (original_context / wavelen - low) / (high - low) is affine in the base frequency, so two
    or more in-between divisors determine (low, high) once `original_context` is fixed.
    """
    if divisors.shape != (head_dim // 2,):
        raise ValueError(f"{_ROPE_FREQS} has {divisors.size} entries, expected {head_dim // 2}")
    if np.allclose(divisors, 1.0):
        return None
    base = inverse_frequencies(head_dim, theta, None).numpy()
    factor = float(divisors.max())
    between = (divisors > 1.0 + 1e-6) & (divisors < factor * (1.0 - 1e-6))
    if between.sum() < 2:
        raise ValueError(
            f"cannot infer Llama-3 rope scaling from {_ROPE_FREQS}: too few interpolated frequencies"
        )
    smooth = (1.0 / divisors[between] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(base[between], smooth, 1)
    # smooth = original_context / (2π (high - low)) * inv_freq - low / (high - low)
    span = original_context / (2 * math.pi * slope)
    low = -intercept * span
    scaling = Llama3RopeScaling(
        factor=factor, low_freq_factor=float(low), high_freq_factor=float(low + span),
        original_max_position_embeddings=original_context,
    )  # fmt: skip
    rebuilt = inverse_frequencies(head_dim, theta, scaling).numpy()
    if not np.allclose(rebuilt, base / divisors, rtol=1e-4, atol=0.0):
        raise ValueError(f"{_ROPE_FREQS} does not follow Llama-3 rope scaling, the only kind supported")
    logger.info("GGUF rope scaling inferred from %s: %s", _ROPE_FREQS, scaling)
    return scaling


def _dequantize(tensor: gguf.ReaderTensor) -> FloatArray:
    """float32 in the HF (row-major torch) shape: GGUF lists dimensions innermost first."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    # F32 comes back as a read-only view of the memory-mapped file: copy that one so torch may own it.
    return np.require(values, dtype=np.float32, requirements=["C", "W"]).reshape(shape)


def unpermute_qk(w: npt.NDArray[_Item], n_head: int) -> npt.NDArray[_Item]:
    """Inverse of llama.cpp's `permute`: per head, rows interleaved (re0, im0, re1, ...) back to halves."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _hf_state(
    config: ModelConfig, tensors: dict[str, gguf.ReaderTensor], *, permuted_qk: bool, dtype: torch.dtype
) -> dict[str, Source]:
    """Dense tensors for float types (cast to `dtype`), stored blocks for the quantised matrices."""
    state: dict[str, Source] = {}
    for gguf_name, tensor in tensors.items():
        if gguf_name == _ROPE_FREQS:
            continue  # folded into config.rope_scaling
        name = _hf_name(gguf_name)
        heads = None
        if permuted_qk and ".q_proj." in name:
            heads = config.num_heads
        elif permuted_qk and ".k_proj." in name:
            heads = config.num_kv_heads
        if tensor.tensor_type in _DENSE_TYPES or len(tensor.shape) != 2:
            values = _dequantize(tensor)
            if heads is not None:
                values = unpermute_qk(values, heads)
            # Cast per tensor so a large model never holds all of its weights in float32 at once.
            state[name] = torch.from_numpy(values).to(dtype)
            continue
        stored = StoredTensor(tensor.tensor_type, tensor.data, int(tensor.shape[0]))
        if heads is not None:  # the same row permutation, on the stored rows
            stored = stored.permute_rows(unpermute_qk(np.arange(stored.shape[0]), heads))
        state[name] = stored
    return state
