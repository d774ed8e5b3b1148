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


# The backends this build carries. flashinfer's joins once it has run on a GPU (the GPU issue).
IMPLEMENTED: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` takes flashinfer on CUDA when it is built and installed, else the torch reference."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        on_cuda = device.type == "cuda" and "flashinfer" in IMPLEMENTED and flashinfer_available()
        return "flashinfer" if on_cuda else "torch"
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer backend needs a CUDA device")
    return name


def backend_class(name: str) -> type[AttentionBackend]:
    try:
        return IMPLEMENTED[name]
    except KeyError:
        raise ValueError(f"attention backend {name!r} is not available in this build") from None
