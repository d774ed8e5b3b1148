"""A session's context window: how long its sequence may grow, and what `truncate` keeps.

Pure functions of the session's config and the engine's own limit (the model's context, capped by
the KV pool), so the policy reads in one place: under `error` nothing is ever dropped (admission
refuses the chunk instead, worker/engine/admission.py); under `truncate` the first
`keep_prefix_tokens` (a system prompt) and the most recent tokens stay, and the window is
re-prefilled.
"""

from __future__ import annotations

from shared.errors import ContextFull, InvalidMessage
from shared.protocol.messages import OpenConfig


def session_limit(config: OpenConfig, engine_limit: int) -> int:
    """The longest sequence this session may reach."""
    if config.max_context_tokens is None:
        return engine_limit
    return min(config.max_context_tokens, engine_limit)


def opening_history(history: list[int], config: OpenConfig, limit: int) -> list[int]:
    """The history a session opens (or is restored) with; raises when it cannot fit under `error`."""
    if config.keep_prefix_tokens >= limit:
        raise InvalidMessage(
            f"keep_prefix_tokens {config.keep_prefix_tokens} leaves no room in a context of {limit}"
        )
    if len(history) <= limit:
        return history
    if config.context_policy == "error":
        raise ContextFull(f"history of {len(history)} tokens exceeds the context of {limit}")
    return (
        history[: config.keep_prefix_tokens] + history[len(history) - (limit - config.keep_prefix_tokens) :]
    )


def window(tokens: list[int], config: OpenConfig, limit: int, grows_by: int) -> list[int]:
    """The history to keep so `grows_by` more tokens fit; `tokens` itself (the same list) if all fit."""
    if len(tokens) + grows_by <= limit:
        return tokens
    keep = config.keep_prefix_tokens
    recent = limit - keep - grows_by
    return tokens[:keep] + (tokens[len(tokens) - recent :] if recent > 0 else [])
