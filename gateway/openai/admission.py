"""How one OpenAI event is admitted: whole, under the session's one admission rule, before anything
changes.

Why whole: one event becomes several native chunks (an item's text in pieces, a response's header).
Were one of them refused after the others ran, the conversation in the KV would miss a piece of
text and no later turn could be exact. So the dialect admits all of an event's chunks at once with
the session's own `SessionLimits` (gateway/limits.py; built once by the session machine, the same
object that admits native chunks), marked as admitted ahead: the machine lets them pass without
charging them twice. A refusal is an `error` the client can retry as it was (`rate_limit_exceeded`,
with the native refusal's `retry_after_ms` in its message), and nothing has changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.limits import ChunkCost, SessionLimits
from gateway.openai import server_events as ev
from gateway.openai.errors import RealtimeProblem
from shared.errors import Backpressure, ChunkTooLarge, RateLimited


@dataclass(frozen=True, slots=True)
class DialectLimits:
    """What the dialect enforces per event, from the gateway's settings and the socket's key."""

    max_output_tokens: int  # the most a response may ask ("inf" means this)
    max_frame_bytes: int
    idle_timeout_s: float | None = None
    rate_limits: tuple[ev.RateLimit, ...] = ()


def admit_event(rule: SessionLimits, chunks: Sequence[ChunkCost], param: str) -> None:
    """Admit every chunk of one event, or raise `RealtimeProblem` having charged nothing."""
    total = sum(c.cost for c in chunks)
    if total > rule.values.max_queued_tokens:
        raise RealtimeProblem(
            f"{param}: {total} characters is more than one event may carry "
            f"({rule.values.max_queued_tokens} characters)",
            param=param,
            code="string_above_max_length",
        )
    try:
        rule.admit(chunks, ahead=True)
    except ChunkTooLarge as exc:
        raise RealtimeProblem(
            f"{param}: {exc.message}", param=param, code="string_above_max_length"
        ) from None
    except Backpressure as exc:
        raise RealtimeProblem(
            f"the session is still taking in earlier events ({exc.message}): retry this event in "
            f"{exc.retry_after_ms} ms, or once they are done (conversation.item.done / response.done)",
            code="rate_limit_exceeded",
        ) from None
    except RateLimited as exc:
        raise RealtimeProblem(
            f"{exc.message}: retry this event in {exc.retry_after_ms} ms", code="rate_limit_exceeded"
        ) from None
