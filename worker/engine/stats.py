"""What the engine reports about itself (`Engine.stats()`, the worker's `/metrics` and `/v1/stats`)."""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.memory.manager import MemoryStats


@dataclass(frozen=True)
class EngineStats:
    sessions: int
    active_sessions: int
    queued_turns: int
    pages_total: int
    pages_used: int
    pages_free: int
    page_size: int
    kv_tokens_total: int
    kv_tokens_free: int
    steps: int
    turns_completed: int
    tokens_forwarded: int
    # KV dropped under pressure (the host tier was full too, or off): `memory.drops`.
    kv_evictions: int
    # The attention backend the model runner chose at start (`torch` or `flashinfer`).
    attention_backend: str
    # Both KV tiers: pages, offloads and restores (count, bytes, seconds), recomputes.
    memory: MemoryStats

    @classmethod
    def of(
        cls,
        memory: MemoryStats,
        *,
        sessions: int,
        active_sessions: int,
        queued_turns: int,
        page_size: int,
        steps: int,
        turns_completed: int,
        tokens_forwarded: int,
        attention_backend: str,
    ) -> EngineStats:
        """The engine's figures, with the device pool's derived from `memory`."""
        free = memory.device_pages_total - memory.device_pages_used
        return cls(
            sessions=sessions,
            active_sessions=active_sessions,
            queued_turns=queued_turns,
            pages_total=memory.device_pages_total,
            pages_used=memory.device_pages_used,
            pages_free=free,
            page_size=page_size,
            kv_tokens_total=memory.device_pages_total * page_size,
            kv_tokens_free=free * page_size,
            steps=steps,
            turns_completed=turns_completed,
            tokens_forwarded=tokens_forwarded,
            kv_evictions=memory.drops,
            attention_backend=attention_backend,
            memory=memory,
        )
