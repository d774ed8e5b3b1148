"""Random Hugging Face checkpoints and a transformers reference forward, shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

VOCAB = 300
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def randomize(model: PreTrainedModel, seed: int) -> None:
    """Spread the weights (and make Qwen2's biases non-zero) so logits are far from ties."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.15 * noise)


def write_checkpoint(kind: str, directory: Path, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    model: PreTrainedModel
    if kind == "llama":
        llama3 = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        model = LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling=llama3, rope_theta=500000.0))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON))
    else:
        raise ValueError(kind)
    randomize(model, seed)
    model.save_pretrained(directory)
    return model.eval()


@torch.no_grad()
def reference_logprobs(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits over the whole sequence in one forward: [len, vocab]."""
    logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
