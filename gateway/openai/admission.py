"""The dialect's own mirror of the session's chunk admission (gateway/limits.py), checked per event.

Why a mirror: one OpenAI event becomes several native chunks (an item's text in pieces, a response's
header). If the session refused one of them for its rate or queue, the conversation in the KV would
miss a piece of text and no later turn could be exact. So the dialect decides first, for the whole
event, with the same limits: an event that could not pass is refused whole, before anything changes,
with an `error` the client can retry as it was. The mirror is never looser than the session: its
bucket starts full no later and is read no later than the session's, and a chunk stays in flight
here until its answer is *encoded*, after the session has already settled it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.limits import MIN_RETRY_AFTER_MS, LimitValues
from gateway.openai import server_events as ev
from gateway.openai.errors import RealtimeProblem

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class DialectLimits:
    """What the dialect enforces per event, from the gateway's settings and the socket's key."""

    max_output_tokens: int  # the most a response may ask ("inf" means this)
    max_frame_bytes: int
    idle_timeout_s: float | None = None
    rate_limits: tuple[ev.RateLimit, ...] = ()


class EventAdmission:
    def __init__(self, values: LimitValues, clock: Clock = time.monotonic) -> None:
        self.values = values
        self._clock = clock
        self._level = float(values.chunk_burst)
        self._stamp = clock()
        self._in_flight: dict[int, tuple[int, bool]] = {}

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(
            float(self.values.chunk_burst), self._level + (now - self._stamp) * self.values.max_chunks_per_s
        )
        self._stamp = now

    def admit(self, chunks: Sequence[tuple[int, str, bool]], param: str) -> None:
        """Admit every chunk (seq, text, wants_output) of one event, or raise having charged nothing."""
        costs = [max(len(text), 1) for _, text, _ in chunks]
        if sum(costs) > self.values.max_queued_tokens or len(chunks) > self.values.chunk_burst:
            raise RealtimeProblem(
                f"{param}: {sum(costs)} characters in {len(chunks)} pieces is more than one event may "
                f"carry ({self.values.max_queued_tokens} characters, {self.values.chunk_burst} pieces)",
                param=param,
                code="string_above_max_length",
            )
        queued = sum(cost for cost, _ in self._in_flight.values())
        outputs = sum(1 for _, wants in self._in_flight.values() if wants)
        asks = sum(1 for _, _, wants in chunks if wants)
        if self._in_flight and (
            queued + sum(costs) > self.values.max_queued_tokens
            or outputs + asks > self.values.max_queued_outputs
        ):
            raise RealtimeProblem(
                f"the session is still taking in {queued} characters of earlier events: send this one "
                "again once they are done (conversation.item.done / response.done)",
                code="rate_limit_exceeded",
            )
        self._refill()
        if self._level < len(chunks):
            wait_ms = max(
                MIN_RETRY_AFTER_MS,
                math.ceil((len(chunks) - self._level) / self.values.max_chunks_per_s * 1000),
            )
            raise RealtimeProblem(
                f"more than {self.values.max_chunks_per_s:g} pieces per second: send this event "
                f"again in {wait_ms} ms",
                code="rate_limit_exceeded",
            )
        self._level -= len(chunks)
        for (seq, _, wants), cost in zip(chunks, costs, strict=True):
            self._in_flight[seq] = (cost, wants)

    def settle(self, seq: int) -> None:
        self._in_flight.pop(seq, None)
