"""Load a Hugging Face checkpoint directory: config.json, *.safetensors, and tokenizer.json if present."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from worker.model.config import ModelConfig
from worker.model.weights import ModelWeights
from worker.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def load_hf_directory(
    path: Path, *, device: torch.device, dtype: torch.dtype
) -> tuple[ModelConfig, ModelWeights, Tokenizer | None]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    raw = json.loads(config_path.read_text())
    config = ModelConfig.from_hf(raw, name=path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    weights = ModelWeights.from_hf_state(config, state, dtype=dtype, device=device)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(
            path / "tokenizer.json", eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id
        )
    logger.info("loaded %s from %s (%d files)", config.name, path, len(files))
    return config, weights, tokenizer
