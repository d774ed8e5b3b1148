"""The Python client's retries of refused chunks (`retry_after_ms`), Sans-I/O.

Why in the client: every refusal that carries `retry_after_ms` (`rate_limited`, `backpressure`,
`capacity_exhausted`, `worker_unavailable` when no worker or store can take it) leaves the session
exactly as it was, its seq included, so the right reaction is always the same: wait that long and
send the same chunk again with the same seq. Doing it here means neither users of the client nor
the load tests handle it by hand. Bounded (`attempts` resends per chunk, each wait capped) and off with
`RetryPolicy(attempts=0)`.

Order: a chunk is resent when its own turn is awaited (`turn`, `wait_done`). A client that
pipelines chunks and awaits them in seq order resends them in seq order too, which is what the
worker needs (it refuses the chunks queued behind a refused one as well).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from shared.protocol.messages import Error, InputChunk

logger = logging.getLogger(__name__)

# Chunks remembered for a resend; older ones (never awaited) are forgotten first.
MAX_REMEMBERED: Final = 1024


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    # Resends of one chunk after refusals; 0 turns retrying off (the refusal raises at once).
    attempts: int = 5
    # A single wait never exceeds this, whatever `retry_after_ms` says.
    max_wait_s: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.max_wait_s < 0:
            raise ValueError("attempts and max_wait_s must be >= 0")


NO_RETRY: Final = RetryPolicy(attempts=0)


class ChunkRetries:
    """The chunks sent and not yet answered, and how many times each was resent."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._sent: OrderedDict[int, tuple[InputChunk, int]] = OrderedDict()

    def sent(self, chunk: InputChunk) -> None:
        if self.policy.attempts == 0:
            return
        tries = self._sent.get(chunk.seq, (chunk, 0))[1]
        self._sent[chunk.seq] = (chunk, tries)
        self._sent.move_to_end(chunk.seq)
        while len(self._sent) > MAX_REMEMBERED:
            self._sent.popitem(last=False)

    def answered(self, seq: int) -> None:
        self._sent.pop(seq, None)

    def delay_for(self, error: Error) -> float | None:
        """Seconds to wait before resending the chunk `error` refused, or None: give up (raise)."""
        if error.fatal or error.retry_after_ms is None or error.seq is None:
            return None
        entry = self._sent.get(error.seq)
        if entry is None or entry[1] >= self.policy.attempts:
            return None
        return min(error.retry_after_ms / 1000.0, self.policy.max_wait_s)

    def resend(self, seq: int) -> InputChunk:
        chunk, tries = self._sent[seq]
        self._sent[seq] = (chunk, tries + 1)
        logger.debug("resending chunk %d (attempt %d)", seq, tries + 1)
        return chunk
