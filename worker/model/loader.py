"""Resolve a model spec (preset name, HF directory, or .gguf file) to config, weights and tokenizer."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.settings import DEFAULT_MODEL
from worker.model.config import ModelConfig
from worker.model.presets import SHAPES, TINY_SEED, random_weights, smollm2_gguf_path, tiny_tokenizer
from worker.model.weight_form import resolve_weight_form
from worker.model.weights import ModelWeights
from worker.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The one preset that loads real weights, and the default model of every command.
SMOLLM2_PRESET = DEFAULT_MODEL
PRESETS = (*SHAPES, SMOLLM2_PRESET)


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer | None


def load_model(
    spec: str, *, device: torch.device, dtype: torch.dtype, seed: int = TINY_SEED, weights: str = "float"
) -> LoadedModel:
    """`weights` is the requested weight form (`--weights`, worker/model/weight_form.py)."""
    started = time.perf_counter()
    if spec in SHAPES:
        config = SHAPES[spec]
        form = resolve_weight_form(weights, device=device, dtype=dtype, stored_types=frozenset())
        loaded = LoadedModel(
            config,
            random_weights(config, seed=seed, device=device, dtype=dtype, form=form),
            tiny_tokenizer(config),
        )
    elif spec == SMOLLM2_PRESET:
        loaded = _load_gguf(
            smollm2_gguf_path(), device=device, dtype=dtype, name=SMOLLM2_PRESET, weights=weights
        )
    else:
        path = Path(spec)
        if path.is_dir():
            from worker.model.loader_hf import load_hf_directory

            loaded = LoadedModel(*load_hf_directory(path, device=device, dtype=dtype, weights=weights))
        elif path.suffix == ".gguf" and path.is_file():
            loaded = _load_gguf(path, device=device, dtype=dtype, name=path.stem, weights=weights)
        else:
            raise FileNotFoundError(
                f"model {spec!r} is neither a preset ({', '.join(PRESETS)}), "
                "an HF directory, nor a .gguf file"
            )
    logger.info("model %s ready on %s in %.2f s", loaded.config.name, device, time.perf_counter() - started)
    logger.info(
        "weights: --weights %s serves %s; %.1f MiB resident, %.1f MiB read per step",
        weights,
        loaded.weights.kernels,
        loaded.weights.num_bytes() / 2**20,
        loaded.weights.bytes_read_per_step() / 2**20,
    )
    _report_chat_template(loaded)
    return loaded


def _report_chat_template(loaded: LoadedModel) -> None:
    """Whether a conversation streamed item by item into one session is the one the template means."""
    template = None if loaded.tokenizer is None else loaded.tokenizer.chat_template
    if template is None:
        logger.info("model %s has no chat template", loaded.config.name)
        return
    problem = template.check_extends()
    if problem is None:
        logger.info("chat template of %s: a longer conversation extends a shorter one", loaded.config.name)
    else:
        logger.warning("chat template of %s cannot be streamed turn by turn: %s", loaded.config.name, problem)


def _load_gguf(
    path: Path, *, device: torch.device, dtype: torch.dtype, name: str, weights: str
) -> LoadedModel:
    from worker.model.loader_gguf import load_gguf

    return LoadedModel(*load_gguf(path, device=device, dtype=dtype, name=name, weights=weights))
