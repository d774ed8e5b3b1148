"""Typed, validated configuration of the engine and of one session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shared.errors import InvalidMessage
from shared.settings import EngineSettings, copy_fields
from worker.model.presets import TINY_SEED

ContextPolicy = Literal["error", "truncate"]


@dataclass(frozen=True)
class EngineConfig(EngineSettings):
    """The worker's engine settings (their defaults are `EngineSettings`') and what only the engine sets.

    `kv_tokens` 0 sizes the pool from free GPU memory (CUDA) or a fixed default (CPU).
    """

    max_batch_rows: int = 256
    # The seed of random-weight presets (`tiny`): the same weights in every process.
    seed: int = TINY_SEED

    @classmethod
    def from_settings(cls, settings: EngineSettings, **engine_only: Any) -> EngineConfig:
        """The one conversion from settings (the worker's, `chat`'s) to the engine's config."""
        return copy_fields(cls, settings, **engine_only)

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.max_batch_tokens < 1 or self.max_batch_rows < 1:
            raise ValueError("page_size, max_batch_tokens and max_batch_rows must be positive")
        if self.kv_tokens < 0 or 0 < self.kv_tokens < self.page_size:
            raise ValueError(f"kv_tokens {self.kv_tokens} is below one page of {self.page_size}")
        if self.max_queued_tokens < 1 or self.max_queued_outputs < 1:
            raise ValueError("max_queued_tokens and max_queued_outputs must be positive")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError("kv_memory_fraction must be in (0, 1]")


@dataclass(frozen=True)
class SessionConfig:
    max_output_tokens: int = 0
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: bool = False
    idle_timeout_s: float | None = None
    max_context_tokens: int | None = None
    context_policy: ContextPolicy = "error"
    # With `truncate`: how many of the first tokens (a system prompt) always stay in the window.
    keep_prefix_tokens: int = 0
    # None stops at the model's EOS tokens; an explicit tuple (possibly empty) replaces them.
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_output_tokens < 0:
            raise InvalidMessage("max_output_tokens must be >= 0")
        if self.temperature < 0:
            raise InvalidMessage("temperature must be >= 0")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidMessage("top_k must be >= 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidMessage("top_p must be in (0, 1]")
        if self.idle_timeout_s is not None and self.idle_timeout_s <= 0:
            raise InvalidMessage("idle_timeout_s must be > 0")
        if self.max_context_tokens is not None and self.max_context_tokens < 1:
            raise InvalidMessage("max_context_tokens must be >= 1")
        if self.context_policy not in ("error", "truncate"):
            raise InvalidMessage("context_policy must be 'error' or 'truncate'")
        if self.keep_prefix_tokens < 0:
            raise InvalidMessage("keep_prefix_tokens must be >= 0")
