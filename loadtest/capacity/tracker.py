"""Chunks in flight for one load-test session: sent -> answered (or refused, or never answered).

Sans-I/O and clock-free (the caller passes the times) so it is unit-tested without a server or
Locust. Each chunk resolves exactly once: its `output.done`, its error, or its timeout; anything
that arrives for a seq already resolved (an output replayed after a resume, say) is ignored.

A chunk refused with `retry_after_ms` is sent again, as the protocol says a client should, up to
`MAX_ATTEMPTS` times in all: `retry` moves it to the seq it is resent under, keeping its name and
its first send time, so Locust records one request whose time includes the waits. It is resent
under a new seq, not its own: a later chunk may already have been accepted, and seqs only grow.
"""

from __future__ import annotations

from dataclasses import dataclass

TIMEOUT_CODE = "timeout"
# Sends of one chunk at the most, the first included, before its refusal counts as a failure.
MAX_ATTEMPTS = 5


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
        # seq -> (request name, first send time in seconds, sends so far); insertion order is seq order.
        self._sent: dict[int, tuple[str, float, int]] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def sent(self, seq: int, name: str, at: float) -> None:
        if seq in self._sent:
            raise ValueError(f"seq {seq} is already in flight")
        self._sent[seq] = (name, at, 1)

    def can_retry(self, seq: int) -> bool:
        entry = self._sent.get(seq)
        return entry is not None and entry[2] < MAX_ATTEMPTS

    def retry(self, seq: int, new_seq: int) -> bool:
        """The refused chunk `seq` is resent as `new_seq`; False (nothing changed) when it has had
        its `MAX_ATTEMPTS` sends or is not in flight: then it fails with its code."""
        entry = self._sent.get(seq)
        if entry is None or entry[2] >= MAX_ATTEMPTS or new_seq in self._sent:
            return False
        del self._sent[seq]
        self._sent[new_seq] = (entry[0], entry[1], entry[2] + 1)
        return True

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
        late = [seq for seq, (_name, at, _sends) in self._sent.items() if now - at > timeout_s]
        return [outcome for seq in late if (outcome := self.failed(seq, TIMEOUT_CODE, now)) is not None]
