"""Attention backends behind one interface; flashinfer is imported only when asked for on CUDA."""

from __future__ import annotations

import importlib.util

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata
from worker.attention.torch_backend import TorchAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttention", "backend_class", "resolve_backend_name"]

BACKEND_NAMES = ("auto", "torch", "flashinfer")


def flashinfer_available() -> bool:
    # find_spec does not import the package: importing flashinfer on a CPU-only torch has broken before.
    return importlib.util.find_spec("flashinfer") is not None


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and flashinfer_available() else "torch"
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer backend needs a CUDA device")
    return name


def backend_class(name: str) -> type[AttentionBackend]:
    if name == "torch":
        return TorchAttention
    raise ValueError(f"unknown attention backend {name!r}")
