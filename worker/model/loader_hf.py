"""Load a Hugging Face checkpoint directory: config.json, *.safetensors, and tokenizer.json if present."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from shared.chat_template import ChatTemplate
from worker.model.config import ModelConfig
from worker.model.weight_form import resolve_weight_form
from worker.model.weights import ModelWeights
from worker.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _token_text(value: object) -> str:
    """A special token in tokenizer_config.json: a string, or an AddedToken map with `content`."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def hf_chat_template(path: Path) -> ChatTemplate | None:
    """The directory's default chat template (tokenizer_config.json, or chat_template.jinja)."""
    config_path = path / "tokenizer_config.json"
    raw = json.loads(config_path.read_text()) if config_path.is_file() else {}
    source = raw.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not source and (path / "chat_template.jinja").is_file():
        source = (path / "chat_template.jinja").read_text()
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, _token_text(raw.get("bos_token")), _token_text(raw.get("eos_token")))


def load_hf_directory(
    path: Path, *, device: torch.device, dtype: torch.dtype, weights: str = "float"
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
    form = resolve_weight_form(weights, device=device, dtype=dtype, stored_types=frozenset())
    model_weights = ModelWeights.from_hf_state(config, state, dtype=dtype, device=device, form=form)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(
            path / "tokenizer.json", eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id
        )
        tokenizer.chat_template = hf_chat_template(path)
    logger.info("loaded %s from %s (%d files)", config.name, path, len(files))
    return config, model_weights, tokenizer
