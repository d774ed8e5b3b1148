"""Attention backends behind one interface: their registry, and the choice among them at start.

A backend is a file in this package implementing `AttentionBackend` (base.py) and one line in
`BACKENDS` below (as mini-sglang registers its attention backends). An entry names where its class
lives, not the class, so a backend's module is imported only when it is chosen; the package it
needs is looked up without importing it (`import flashinfer` has broken on CPU-only torch), so on
the CPU `auto` never imports flashinfer.

The choice (`choose_backend`):
- `torch` is the reference (`REFERENCE`): it serves as it is, and every other backend is held
  against it.
- Another backend by name serves only after it agreed with the torch reference on a check batch
  (self_check.py); a missing package or a failed check refuses it: the worker does not start and
  says why.
- `auto` takes the first entry, in the table's order, that accelerates the device (`auto_on`), whose
  package is installed and that can serve here (`AttentionBackend.unavailable`: the `cpu` kernel
  needs its extension built and AVX2), and checks it the same way; a failed check logs a warning and
  serves with the torch reference, and no such entry (CUDA without the `gpu` extra, a CPU without
  AVX2) is torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass
from typing import Final

from worker.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from worker.attention.kv_pool import KVPool
from worker.attention.self_check import compare_with_torch
from worker.attention.torch_backend import TorchAttention

__all__ = [
    "AUTO",
    "BACKENDS",
    "BACKEND_NAMES",
    "REFERENCE",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "Backend",
    "BackendRefused",
    "TorchAttention",
    "choose_backend",
    "decide",
    "paged_attention",
]

logger = logging.getLogger(__name__)


class BackendRefused(ValueError):
    """The asked-for backend cannot serve here; the message says why (the worker exits with it)."""


@dataclass(frozen=True)
class Backend:
    """One registered attention backend, described without importing it."""

    name: str  # `--attention <name>`; equal to its class's `name` (a test holds them together)
    target: str  # "module:Class", imported only when the backend is chosen
    package: str | None = None  # a package it needs beyond torch, looked up without importing it
    install: str = ""  # how to get `package`, said when a worker asked for the backend lacks it
    auto_on: tuple[str, ...] = ()  # the device types on which `auto` prefers it to the reference

    def installed(self) -> bool:
        # find_spec does not import the package: importing flashinfer on a CPU-only torch has broken before.
        package = self.package
        return package is None or package in sys.modules or importlib.util.find_spec(package) is not None

    def load(self) -> type[AttentionBackend]:
        module, _, attribute = self.target.partition(":")
        backend: type[AttentionBackend] = getattr(importlib.import_module(module), attribute)
        return backend


# Every backend a worker can serve with; `auto` prefers them in this order. Add a backend here.
BACKENDS: Final = {
    backend.name: backend
    for backend in (
        Backend("torch", "worker.attention.torch_backend:TorchAttention"),
        Backend("cpu", "worker.attention.cpu_backend:CpuAttention", auto_on=("cpu",)),
        Backend(
            "flashinfer",
            "worker.attention.flashinfer_backend:FlashInferAttention",
            package="flashinfer",
            install="the `gpu` extra: pip install 'microturn[gpu]'",
            auto_on=("cuda",),
        ),
    )
}
AUTO: Final = "auto"
# The backend every other one is checked against (self_check.py) and `auto` falls back to.
REFERENCE: Final = TorchAttention.name
BACKEND_NAMES: Final = (AUTO, *BACKENDS)


def _refused(asked: str, problem: str) -> BackendRefused:
    return BackendRefused(f"--attention {asked} cannot serve here: {problem}")


def _reference(asked: str, shape: AttentionShape, fallback_from: str | None = None) -> type[AttentionBackend]:
    """The torch reference where it can serve `shape`; else a refusal (saying, for `auto`, what it
    fell back from)."""
    problem = TorchAttention.unavailable(shape)
    if problem is not None:
        if fallback_from is not None:
            problem = f"{fallback_from}, and {REFERENCE} cannot serve this pool: {problem}"
        raise _refused(asked, problem)
    return TorchAttention


def decide(
    asked: str, candidate: type[AttentionBackend], problem: str | None, shape: AttentionShape
) -> type[AttentionBackend]:
    """`candidate` if its check passed (`problem` is None); else torch under `auto`, a refusal otherwise."""
    if problem is None:
        return candidate
    if asked == AUTO:
        fallback = _reference(asked, shape, f"{candidate.name} failed its start-up check ({problem})")
        logger.warning(
            "%s failed its start-up check, serving with the %s backend: %s",
            candidate.name,
            REFERENCE,
            problem,
        )
        return fallback
    raise _refused(asked, problem)


def choose_backend(name: str, shape: AttentionShape) -> type[AttentionBackend]:
    """The backend a model runner uses for `--attention name` with this model and pool."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == AUTO:
        for entry in BACKENDS.values():
            if shape.device.type not in entry.auto_on or not entry.installed():
                continue
            candidate = entry.load()
            reason = candidate.unavailable(shape)
            if reason is None:
                return decide(name, candidate, compare_with_torch(candidate, shape), shape)
            logger.info("attention backend %s passed over: %s", entry.name, reason)
        return _reference(name, shape, f"no backend that accelerates {shape.device.type} serves here")
    entry = BACKENDS[name]
    if entry.name == REFERENCE:
        return _reference(name, shape)
    if not entry.installed():
        raise _refused(name, f"{entry.package} is not installed ({entry.install})")
    candidate = entry.load()
    reason = candidate.unavailable(shape)
    if reason is not None:
        raise _refused(name, reason)
    return decide(name, candidate, compare_with_torch(candidate, shape), shape)


def paged_attention(name: str, shape: AttentionShape, *, num_layers: int, num_pages: int) -> AttentionBackend:
    """The backend `--attention name` chooses for `shape`, over a KV pool of its own: `num_pages` pages
    of the shape's page size, in its KV form and the backend's layout (a model runner's, a
    benchmark's)."""
    backend = choose_backend(name, shape)
    pool = KVPool(
        num_layers=num_layers,
        num_pages=num_pages,
        page_size=shape.page_size,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.pool_dtype,
        device=shape.device,
        layout=backend.kv_layout,
        int8_keys=shape.int8_keys,
        int8_values=shape.int8_values,
    )
    return backend(
        pool,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
    )
