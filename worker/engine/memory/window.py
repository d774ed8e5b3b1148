"""A session's context window: how long its sequence may grow, and where `truncate` cuts it.

Pure functions of the session's config and the engine's own limit (the model's context, capped by
the KV pool), so the policy reads in one place. Under `error` nothing is ever dropped (admission
refuses the chunk instead, worker/engine/admission.py). Under `truncate` the rule is per turn
(docs/protocol.md states it for clients):

    when a turn's input plus its max_output_tokens would take the history past the limit, before
    that turn the history becomes its first `keep_prefix_tokens` tokens followed by its most recent
    tokens, as many as fit in
        floor(retention_ratio x limit) - keep_prefix_tokens - (input + max_output_tokens)
    (none if that is not positive); the turn then runs exactly as if that window had been sent whole.

The rule depends only on the history's length, the turn and the config, so the engine, a restoring
worker replaying delivered turns (worker/server/restore.py) and a reader of the log
(shared/store/log_format.py records each cut as a `Cut`) all reach the same window. A ratio below 1
leaves room for many turns after each cut, so a session at its limit re-prefills its window rarely
instead of on every turn. The prefix's KV is kept across a cut; only the recent tokens are
re-prefilled (worker/engine/memory/manager.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

from shared.errors import ContextFull, InvalidMessage
from shared.protocol.messages import OpenConfig
from shared.store.log_format import Cut
from worker.engine.admission import commit_chunk
from worker.tokenizer.incremental import EMPTY_TAIL, IncrementalTokenizer


def session_limit(config: OpenConfig, engine_limit: int) -> int:
    """The longest sequence this session may reach."""
    if config.max_context_tokens is None:
        return engine_limit
    return min(config.max_context_tokens, engine_limit)


def opening_history(history: list[int], config: OpenConfig, limit: int) -> list[int]:
    """The history a session opens (or is restored) with; raises when it cannot fit under `error`.

    A history over the limit is cut as a turn of no tokens would cut it."""
    if config.keep_prefix_tokens >= limit:
        raise InvalidMessage(
            f"keep_prefix_tokens {config.keep_prefix_tokens} leaves no room in a context of {limit}"
        )
    if len(history) <= limit:
        return history
    if config.context_policy == "error":
        raise ContextFull(f"history of {len(history)} tokens exceeds the context of {limit}")
    cut = Cut(config.keep_prefix_tokens, _recent(config, limit, 0))
    return cut.apply(history)


def cut_before(length: int, grows_by: int, config: OpenConfig, limit: int) -> Cut | None:
    """The cut a turn adding `grows_by` tokens (input + max_output_tokens) to a history of `length`
    makes before it runs; None when it fits (or the policy never cuts)."""
    if config.context_policy != "truncate" or length + grows_by <= limit:
        return None
    keep = min(config.keep_prefix_tokens, length)
    recent = min(_recent(config, limit, grows_by), length - keep)
    return Cut(keep, recent)


def _recent(config: OpenConfig, limit: int, grows_by: int) -> int:
    return max(math.floor(config.retention_ratio * limit) - config.keep_prefix_tokens - grows_by, 0)


def resolve_prefix(config: OpenConfig, text: IncrementalTokenizer | None) -> tuple[OpenConfig, list[int]]:
    """The config the engine runs (`keep_prefix_tokens` counting `keep_prefix_text`'s tokens) and
    those tokens, committed whole as a text chunk that flushes would commit them. Pure: a worker
    restoring the session computes the same count from the same text."""
    if config.keep_prefix_text is None:
        return config, []
    tokens, _tail = commit_chunk(text, EMPTY_TAIL, text=config.keep_prefix_text, tokens=(), flush=True)
    return replace(config, keep_prefix_text=None, keep_prefix_tokens=len(tokens)), tokens
