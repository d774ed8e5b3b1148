"""A session's queue rule and the retry hint of its refusal: one rule, for the gateway and the engine.

Both bound a session's queue by what it costs, not by a count of chunks: input tokens, each chunk
counted as one at least (so even empty chunks cannot queue without bound), and chunks asking for
output. No-output chunks merge into one append on the worker, so a paste sent as twenty small
pieces costs about what it would sent whole. The gateway applies the rule to a session's chunks in
flight (admitted, not answered yet: gateway/limits.py, bounded by `max_queued_*`), the engine to the
turns pending behind a session's running turn (worker/engine/admission.py, `max_pending_*`). A
chunk with nothing ahead of it is never refused for the queue: its size has its own limits.

The refusal is `backpressure` (recoverable) and its `retry_after_ms` is one turn's time, since the
queue frees when the turn ahead ends: the turn time measured where there is one (the gateway keeps
an average per session), `DEFAULT_TURN_MS` where there is none (the engine).
"""

from __future__ import annotations

import math
from typing import Final

from shared.errors import Backpressure

# A retry hint is a promise about the future: never advise less than this, or clients spin.
MIN_RETRY_AFTER_MS: Final = 10
# About one turn's time, advised where none was measured.
DEFAULT_TURN_MS: Final = 100.0


def retry_after_ms(turn_ms: float = DEFAULT_TURN_MS) -> int:
    """The hint of a queue refusal: one turn's time (`turn_ms`), never below `MIN_RETRY_AFTER_MS`."""
    return max(MIN_RETRY_AFTER_MS, math.ceil(turn_ms))


def check_queue(
    ahead_tokens: int,
    ahead_outputs: int,
    *,
    tokens: int,
    outputs: int,
    tokens_limit: int,
    outputs_limit: int,
    turn_ms: float = DEFAULT_TURN_MS,
) -> None:
    """Raise `Backpressure`, unless chunks costing `tokens` (each counted as one at least), `outputs`
    of them asking for output, fit behind what is ahead of them: `ahead_tokens` input tokens (0:
    nothing ahead, always admitted) and `ahead_outputs` chunks asking for output."""
    if ahead_tokens and (
        ahead_tokens + tokens > tokens_limit or (outputs and ahead_outputs + outputs > outputs_limit)
    ):
        raise Backpressure(
            f"{ahead_tokens} input tokens and {ahead_outputs} turns asking for output are still running "
            f"or waiting ahead (limits {tokens_limit} and {outputs_limit})",
            retry_after_ms=retry_after_ms(turn_ms),
        )
