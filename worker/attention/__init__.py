"""Attention backends behind one interface, and the choice among them at start.

flashinfer is imported only when it is asked for (`--attention flashinfer`) or when `auto` runs on
CUDA with the package installed; on the CPU `auto` is the torch backend and never imports it.
A flashinfer backend is used only after it agreed with the torch reference on a check batch
(self_check.py): under `auto` a failed check logs a warning and serves with torch, under
`flashinfer` the worker refuses to start and says why.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Final

from worker.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from worker.attention.flashinfer_backend import FlashInferAttention
from worker.attention.self_check import compare_with_torch
from worker.attention.torch_backend import TorchAttention

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "BackendRefused",
    "TorchAttention",
    "choose_backend",
    "decide",
]

logger = logging.getLogger(__name__)

BACKEND_NAMES: Final = ("auto", "torch", "flashinfer")


class BackendRefused(ValueError):
    """The asked-for backend cannot serve here; the message says why (the worker exits with it)."""


def flashinfer_available() -> bool:
    # find_spec does not import the package: importing flashinfer on a CPU-only torch has broken before.
    return "flashinfer" in sys.modules or importlib.util.find_spec("flashinfer") is not None


def decide(name: str, problem: str | None) -> type[AttentionBackend]:
    """flashinfer if its check passed (`problem` is None); else torch under `auto`, a refusal otherwise."""
    if problem is None:
        return FlashInferAttention
    if name == "auto":
        logger.warning("flashinfer failed its start-up check, serving with the torch backend: %s", problem)
        return TorchAttention
    raise BackendRefused(f"--attention flashinfer cannot serve here: {problem}")


def choose_backend(name: str, shape: AttentionShape) -> type[AttentionBackend]:
    """The backend a model runner uses for `--attention name` with this model and pool."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "torch" or (name == "auto" and (shape.device.type != "cuda" or not flashinfer_available())):
        return TorchAttention
    if not flashinfer_available():
        return decide(name, "flashinfer is not installed (the `gpu` extra: pip install 'microturn[gpu]')")
    return decide(name, compare_with_torch(FlashInferAttention, shape))
