"""Chunks in flight for one load-test session: sent -> answered (or refused, or never answered).

Sans-I/O and clock-free (the caller passes the times) so it is unit-tested without a server or
Locust. Each chunk resolves exactly once: its `output.done`, its error, or its timeout; anything
that arrives for a seq already resolved (an output replayed after a resume, say) is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

TIMEOUT_CODE = "timeout"


@dataclass(frozen=True)
class Outcome:
    """One chunk as Locust records it; `error` is the protocol's error code, None on success."""

    name: str
    seq: int
    response_time_ms: float
    error: str | None = None
    response_length: int = 0


class InFlight:
    def __init__(self) -> None:
        # seq -> (request name, send time in seconds); insertion order is seq order.
        self._sent: dict[int, tuple[str, float]] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def sent(self, seq: int, name: str, at: float) -> None:
        if seq in self._sent:
            raise ValueError(f"seq {seq} is already in flight")
        self._sent[seq] = (name, at)

    def done(self, seq: int, at: float, length: int = 0) -> Outcome | None:
        entry = self._sent.pop(seq, None)
        if entry is None:
            return None
        return Outcome(entry[0], seq, (at - entry[1]) * 1000.0, None, length)

    def failed(self, seq: int, code: str, at: float) -> Outcome | None:
        entry = self._sent.pop(seq, None)
        if entry is None:
            return None
        return Outcome(entry[0], seq, (at - entry[1]) * 1000.0, code)

    def expire(self, now: float, timeout_s: float) -> list[Outcome]:
        """Resolve as `timeout` every chunk sent more than `timeout_s` before `now`."""
        late = [seq for seq, (_name, at) in self._sent.items() if now - at > timeout_s]
        return [outcome for seq in late if (outcome := self.failed(seq, TIMEOUT_CODE, now)) is not None]
