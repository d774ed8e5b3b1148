"""Typed, validated configuration of the engine and of one session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.errors import InvalidMessage

ContextPolicy = Literal["error", "truncate"]


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "auto"
    # KV capacity in tokens; None sizes the pool from free GPU memory (CUDA) or a fixed default (CPU).
    kv_tokens: int | None = None
    kv_memory_fraction: float = 0.85
    page_size: int = 16
    # One forward step feeds at most this many tokens; longer appends continue in later steps.
    max_batch_tokens: int = 2048
    max_batch_rows: int = 256
    max_sessions: int = 1024
    max_chunk_tokens: int = 1024
    # A session's queue (chunks behind its running turn) is bounded by what it costs, not by a
    # count of chunks: queued no-output chunks merge into one append, so pieces are cheap.
    max_queued_tokens: int = 2048
    max_queued_outputs: int = 8
    max_output_tokens_limit: int = 1024
    seed: int = 1234
    # Baseline only (`microturn bench --capacity`): after every turn a session drops its KV and keeps
    # its tokens, so each turn recomputes the whole history, as a server without sessions does.
    no_session: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.max_batch_tokens < 1 or self.max_batch_rows < 1:
            raise ValueError("page_size, max_batch_tokens and max_batch_rows must be positive")
        if self.kv_tokens is not None and self.kv_tokens < self.page_size:
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
