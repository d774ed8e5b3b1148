"""Per-session admission limits of the gateway (docs/design.md section 7), pure and clock-injected.

Why at the gateway: a chunk the gateway refuses never reaches the link, so a client that floods or
sends oversized frames costs its own socket some CPU and nothing else; the worker's engine queue and
every other session on that worker stay untouched. The worker repeats the checks that need the
session (sequence, context), the gateway only does the ones it can decide alone.

Every check here raises a typed, recoverable `MicroturnError` *before* the session state changes:
`SessionLimits.admit` takes a batch of chunks (one native chunk, or every chunk one OpenAI event
becomes) and either mutates nothing and raises, or charges the token bucket for all of them, records
their costs as in flight and returns. It is the one admission rule of a session, whatever its
dialect: the session machine builds it once (gateway/session/turns.py) and a dialect that admits
whole events ahead of their chunks (gateway/openai/) uses that same object.
The in-flight queue is bounded by the session's one queue rule (shared/backpressure.py, which the
engine applies to its pending turns too), text counted by characters since only the worker tokenizes.
No I/O and no global clock: the clock is a parameter so the tests drive time by hand.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from shared.backpressure import DEFAULT_TURN_MS, MIN_RETRY_AFTER_MS, check_queue
from shared.errors import ChunkTooLarge, RateLimited
from shared.settings import GatewaySettings, copy_fields

Clock = Callable[[], float]


def check_frame_size(size: int, max_frame_bytes: int) -> None:
    """Refuse a frame larger than the limit before it is parsed (parsing is the cost being bounded).

    The code is `chunk_too_large`: chunks are the only client message that grows with the input, so
    that is what an oversized frame nearly always is, and it tells the client what to change.
    """
    if size > max_frame_bytes:
        raise ChunkTooLarge(f"frame of {size} bytes exceeds the limit of {max_frame_bytes} bytes")


def check_chunk_tokens(count: int, max_chunk_tokens: int) -> None:
    if count > max_chunk_tokens:
        raise ChunkTooLarge(f"chunk of {count} tokens exceeds the limit of {max_chunk_tokens} tokens")


class TokenBucket:
    """The classic token bucket: `rate` tokens per second, at most `burst` saved up.

    `try_take` either takes one token and returns None, or takes nothing and returns how many
    milliseconds until one token is there (the `retry_after_ms` of `rate_limited`).
    """

    __slots__ = ("_burst", "_clock", "_level", "_rate", "_stamp")

    def __init__(self, rate: float, burst: int, clock: Clock = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"need rate > 0 and burst >= 1, got rate={rate} burst={burst}")
        self._rate = rate
        self._burst = float(burst)
        self._clock = clock
        self._level = float(burst)  # a new session may burst at once
        self._stamp = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self._burst, self._level + (now - self._stamp) * self._rate)
        self._stamp = now

    def wait_ms(self) -> int | None:
        """Milliseconds until a token is available, or None when one is available now."""
        self._refill()
        if self._level >= 1.0:
            return None
        return max(MIN_RETRY_AFTER_MS, math.ceil((1.0 - self._level) / self._rate * 1000))

    def try_take(self, count: int = 1) -> int | None:
        """Take `count` tokens, or none and say how long until `count` are there (`count` <= burst)."""
        self._refill()
        if self._level >= count:
            self._level -= count
            return None
        return max(MIN_RETRY_AFTER_MS, math.ceil((count - self._level) / self._rate * 1000))


@dataclass(frozen=True, slots=True)
class ChunkCost:
    """What one chunk costs the session's queue: tokens, or text counted by characters."""

    seq: int
    cost: int
    wants_output: bool


@dataclass(frozen=True, slots=True)
class LimitValues:
    """The limits a session runs under; also what `session.opened` reports as `limits`."""

    max_frame_bytes: int
    max_chunk_tokens: int
    max_chunks_per_s: float
    chunk_burst: int
    max_queued_tokens: int
    max_queued_outputs: int

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> LimitValues:
        return copy_fields(cls, settings)  # each field is the gateway setting of the same name

    def as_map(self) -> dict[str, int | float]:
        return asdict(self)


class SessionLimits:
    """The mutable limit state of one client session: its token bucket, its turn-time estimate, and
    the cost of its chunks in flight (admitted, not yet answered by a done or an error)."""

    __slots__ = ("_ahead", "_bucket", "_in_flight", "_outputs", "_tokens", "_turn_ms", "values")

    def __init__(self, values: LimitValues, clock: Clock = time.monotonic) -> None:
        self.values = values
        self._bucket = TokenBucket(values.max_chunks_per_s, values.chunk_burst, clock)
        self._turn_ms = DEFAULT_TURN_MS
        # seq -> (cost in tokens, asks for output); `_tokens` and `_outputs` are their sums.
        self._in_flight: dict[int, tuple[int, bool]] = {}
        self._tokens = 0
        self._outputs = 0
        # Seqs admitted with their event (a dialect's `admit(..., ahead=True)`) whose chunks have not
        # reached `admit_chunk` yet: charged once, when the event was admitted.
        self._ahead: set[int] = set()

    @property
    def in_flight(self) -> int:
        """How many chunks are admitted and not yet settled."""
        return len(self._in_flight)

    def observe_turn(self, elapsed_ms: float) -> None:
        """Feed a finished turn's time (exponential average): it sizes the backpressure retry hint."""
        self._turn_ms = 0.8 * self._turn_ms + 0.2 * max(elapsed_ms, 0.0)

    def admit(self, chunks: Sequence[ChunkCost], *, ahead: bool = False) -> None:
        """Admit every chunk of `chunks` or none: checked whole, then charged whole.

        Order: size, then queue, then rate, so a refused batch never costs the client a rate token
        it could not use. A batch with nothing in flight ahead of it is never refused for the queue
        (its size has its own limits). `ahead`: the chunks will come through `admit_chunk` later
        (the session machine), which then lets them pass without charging them again.
        """
        if len(chunks) > self.values.chunk_burst:
            raise ChunkTooLarge(
                f"{len(chunks)} chunks at once can never fit the burst of {self.values.chunk_burst}"
            )
        cost = sum(max(c.cost, 1) for c in chunks)
        self._check(cost, sum(1 for c in chunks if c.wants_output), len(chunks))
        for chunk in chunks:
            self._charge(chunk.seq, max(chunk.cost, 1), chunk.wants_output)
            if ahead:
                self._ahead.add(chunk.seq)

    def admit_chunk(self, seq: int, *, tokens: int | None, text_chars: int, wants_output: bool) -> None:
        """Admit one chunk or raise; on success one bucket token is charged and its cost is in flight.

        `tokens` is a token chunk's length (None for text: the worker counts its tokens after
        tokenizing; `text_chars` stands in for them here). A chunk admitted ahead with its event
        passes: it was checked and charged then.
        """
        if seq in self._ahead:
            self._ahead.discard(seq)
            return
        if tokens is not None:
            check_chunk_tokens(tokens, self.values.max_chunk_tokens)
        # The per-chunk path: the same rule as `admit`, without building a batch for one chunk.
        cost = max(tokens if tokens is not None else text_chars, 1)
        self._check(cost, int(wants_output), 1)
        self._charge(seq, cost, wants_output)

    def _check(self, cost: int, asks: int, count: int) -> None:
        """Raise, having changed nothing, unless `count` chunks costing `cost` in all (`asks` of them
        asking for output) fit the queue and the rate; on success their rate tokens are taken. Queue
        first, so a refusal never costs a rate token."""
        check_queue(
            self._tokens,
            self._outputs,
            tokens=cost,
            outputs=asks,
            tokens_limit=self.values.max_queued_tokens,
            outputs_limit=self.values.max_queued_outputs,
            turn_ms=self._turn_ms,
        )
        wait = self._bucket.try_take(count)
        if wait is not None:
            raise RateLimited(
                f"more than {self.values.max_chunks_per_s:g} chunks per second "
                f"(burst {self.values.chunk_burst})",
                retry_after_ms=wait,
            )

    def _charge(self, seq: int, cost: int, wants_output: bool) -> None:
        self._in_flight[seq] = (cost, wants_output)
        self._tokens += cost
        self._outputs += wants_output

    def settle(self, seq: int) -> None:
        """The chunk `seq` was answered (done or error) or lost: its cost is no longer in flight."""
        self._ahead.discard(seq)
        cost = self._in_flight.pop(seq, None)
        if cost is not None:
            self._tokens -= cost[0]
            self._outputs -= cost[1]
