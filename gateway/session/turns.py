"""A session's turns as the gateway counts them: in flight, undurable, finished, and their limits.

Why apart from machine.py: this is the per-chunk bookkeeping (the hot path), with no phase in it;
the machine decides when a chunk may be admitted or is held, and this keeps what follows from it.

Invariants: a chunk is in `in_flight` (and charged to `limits`) from its admission until its
`done` or `error`; it is in `undurable` until its turn is delivered and durable (undurable.py);
`finished_seq` only grows, and every done up to it has been queued for the client.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.limits import LimitValues, SessionLimits
from gateway.session.undurable import UndurableTurns
from shared.errors import BadSequence
from shared.protocol.link import LinkChunk, LinkDone, LinkOpened
from shared.protocol.messages import InputChunk


class Turns:
    def __init__(self, limits: LimitValues, clock: Callable[[], float]) -> None:
        self.limits = SessionLimits(limits, clock)
        self.in_flight: dict[int, float] = {}  # seq -> arrival time, for every chunk not yet answered
        self.undurable = UndurableTurns()
        self.finished_seq: int | None = None
        self._length = 0  # the session's length after its last done: a turn's tokens are its growth

    def check_seq(self, msg: InputChunk) -> None:
        """Refuse a seq that is running or already finished; changes nothing."""
        if msg.seq in self.in_flight:
            raise BadSequence(f"seq {msg.seq} is already running")
        finished = self.finished_seq
        if finished is not None and msg.seq <= finished:
            # The worker would refuse it too, but forwarding it would replace the turn's undurable
            # entry (its delivered output) with a chunk to run: a restore would answer it twice.
            raise BadSequence(f"seq {msg.seq} is not above the last finished seq {finished}")

    def admit(
        self, msg: InputChunk, *, wants_output: bool, received: float, frame: LinkChunk, sent: bool
    ) -> None:
        """Charge the chunk's limits (or raise, changing nothing), then count it in flight."""
        self.limits.admit_chunk(
            msg.seq,
            tokens=None if msg.tokens is None else len(msg.tokens),
            text_chars=len(msg.text or ""),
            wants_output=wants_output,
        )
        # In flight before the send: the done can arrive while the send is still draining.
        self.in_flight[msg.seq] = received
        self.undurable.add(frame, sent=sent)

    def opened(self, frame: LinkOpened) -> None:
        self.finished_seq, self._length = frame.finished_seq, frame.length

    def done(self, frame: LinkDone) -> tuple[float | None, int] | None:
        """A turn's done: (its chunk's arrival, the tokens it added); None for a repeated done."""
        done = frame.done
        if not self.undurable.delivered(frame):
            return None
        started = self.in_flight.pop(done.seq, None)
        self.limits.settle(done.seq)
        if self.finished_seq is None or done.seq > self.finished_seq:
            self.finished_seq = done.seq
        # In + out: the growth of the session (at least its outputs, should truncation shrink it).
        grown, self._length = max(frame.length - self._length, len(done.tokens)), frame.length
        return started, grown

    def refused(self, seq: int) -> None:
        """The worker refused the chunk: it never entered the session."""
        self.in_flight.pop(seq, None)
        self.limits.settle(seq)
        self.undurable.refused(seq)
