"""Typed, validated configuration of the engine.

A session's options are not here: they are the client's `session.open` config, `OpenConfig`
(shared/protocol/messages.py), one definition from the client to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.settings import KV_DTYPES, ON_OFF, WEIGHT_FORMS, EngineSettings, copy_fields
from worker.model.presets import TINY_SEED


@dataclass(frozen=True)
class EngineConfig(EngineSettings):
    """The worker's engine settings (their defaults are `EngineSettings`') and what only the engine sets.

    `kv_tokens` 0 sizes the pool from free GPU memory (CUDA) or a fixed default (CPU);
    `host_kv_tokens` -1 sizes the host tier from available host memory, 0 turns it off
    (worker/engine/memory/sizing.py).
    """

    max_batch_rows: int = 256
    # The seed of random-weight presets (`tiny`): the same weights in every process.
    seed: int = TINY_SEED

    @classmethod
    def from_settings(cls, settings: EngineSettings, **engine_only: Any) -> EngineConfig:
        """The one conversion from settings (the worker's, `chat`'s) to the engine's config."""
        return copy_fields(cls, settings, **engine_only)

    def __post_init__(self) -> None:
        sizes = (self.page_size, self.max_batch_tokens, self.max_batch_rows)
        if min(*sizes, self.max_append_piece_tokens, self.max_warm_piece_tokens) < 1:
            raise ValueError(
                "page_size, max_batch_tokens, max_batch_rows, max_append_piece_tokens and "
                "max_warm_piece_tokens must be positive"
            )
        if self.kv_tokens < 0 or 0 < self.kv_tokens < self.page_size:
            raise ValueError(f"kv_tokens {self.kv_tokens} is below one page of {self.page_size}")
        if self.cpu_single_thread_max_tokens < 0:
            raise ValueError("cpu_single_thread_max_tokens must be 0 or more")
        if self.max_pending_tokens < 1 or self.max_pending_outputs < 1:
            raise ValueError("max_pending_tokens and max_pending_outputs must be positive")
        if self.host_kv_tokens < -1 or 0 < self.host_kv_tokens < self.page_size:
            raise ValueError(
                f"host_kv_tokens {self.host_kv_tokens}: 0 (off), -1 (sized from host memory) or one page "
                f"of {self.page_size} tokens at least"
            )
        if self.weights not in WEIGHT_FORMS:
            raise ValueError(f"weights {self.weights!r} is not one of {', '.join(WEIGHT_FORMS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if self.prefix_cache not in ON_OFF:
            raise ValueError(f"prefix_cache: {self.prefix_cache!r} is not one of {', '.join(ON_OFF)}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError("kv_memory_fraction must be in (0, 1]")
