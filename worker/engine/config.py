"""Typed, validated configuration of the engine.

A session's options are not here: they are the client's `session.open` config, `OpenConfig`
(shared/protocol/messages.py), one definition from the client to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


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
