"""A session's turns as the gateway counts them: in flight, undurable, finished, and their limits.

Why apart from machine.py: this is the per-chunk bookkeeping (the hot path), with no phase in it;
the machine decides when a chunk may be admitted or is held, and this keeps what follows from it:
`Turns` the whole of it, `UndurableTurns` the part a restoring worker needs from the gateway.

Invariants: a chunk is in `in_flight` (and charged to `limits`) from its admission until its
`done` or `error`; it is in `undurable` until its turn is delivered and durable (below);
`finished_seq` only grows, and every done up to it has been queued for the client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from gateway.limits import LimitValues, SessionLimits
from shared.errors import BadSequence
from shared.protocol.link import LinkChunk, LinkDelta, LinkDone, LinkOpened, UndurableTurn
from shared.protocol.messages import InputChunk

# `Turns.last_seq` before any chunk: below every seq.
NO_CHUNK: Final = -1


class Turns:
    def __init__(self, limits: LimitValues, clock: Callable[[], float]) -> None:
        self.limits = SessionLimits(limits, clock)
        self.in_flight: dict[int, float] = {}  # seq -> arrival time, for every chunk not yet answered
        self.undurable = UndurableTurns()
        self.finished_seq: int | None = None
        self.last_seq = NO_CHUNK  # the highest seq admitted: where an edit sent now stands among the chunks
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
        self.last_seq = max(self.last_seq, msg.seq)
        self.undurable.add(frame, sent=sent)

    @property
    def first_in_flight(self) -> int | None:
        """The lowest seq not answered yet (seqs are admitted in increasing order), or None."""
        return next(iter(self.in_flight), None)

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


@dataclass(slots=True)
class _Entry:
    chunk: LinkChunk
    output: tuple[int, ...] | None = None
    sent: bool = True  # False while held: it reaches the (next) worker after its restore
    deltas: int = 0  # deltas already forwarded to the client


class UndurableTurns:
    """What a restoring worker needs that Redis may lack: the session's undurable turns.

    Exactly-once turns across a worker crash (docs/failover.md): the worker appends each turn to the
    token log in Redis shortly *after* its `done` went out, and reports on its frames the last seq it
    knows is durable (`durable_seq`). Until then the turn exists only in the worker's memory, and in
    this tail: every chunk forwarded (or held while the session moves), with the output the client
    already got for it. On restore the tail goes to the new worker, which appends delivered turns as
    history and re-runs the rest.

    Invariants:
    - Entries are in seq order (chunks are forwarded in the order they arrive, seqs increase).
    - An entry leaves when its chunk was refused (an `error` with its seq: it never entered the
      session) or when it is delivered *and* durable. So the tail is bounded by the chunks in flight
      plus those of the last ~20 ms flush interval: the per-chunk cost is a dict insert and a pop.
    - A `done` for a seq that was already delivered is a duplicate (a re-run the client already had
      an answer for) and is dropped; so are deltas a re-run repeats.
    """

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, chunk: LinkChunk, *, sent: bool) -> None:
        self._entries[chunk.chunk.seq] = _Entry(chunk, sent=sent)

    def refused(self, seq: int) -> None:
        """The worker refused the chunk (an error with its seq): it is not part of the session."""
        self._entries.pop(seq, None)

    def delivered(self, frame: LinkDone) -> bool:
        """Record the chunk's output; False when the client already had a `done` for it."""
        entry = self._entries.get(frame.done.seq)
        if entry is None:
            return True  # not ours to judge (e.g. dones an attach replays)
        if entry.output is not None:
            return False
        entry.output = frame.done.tokens
        self.durable(frame.durable_seq)
        return True

    def delta_is_new(self, frame: LinkDelta) -> bool:
        delta = frame.delta
        entry = self._entries.get(delta.seq)
        if entry is None:
            return True
        if entry.output is not None or delta.index < entry.deltas:
            return False
        entry.deltas = delta.index + 1
        return True

    def durable(self, seq: int | None) -> None:
        """The worker's log holds every turn up to `seq`: forget those the client has answers for."""
        if seq is None:
            return
        while self._entries:
            first_seq, first = next(iter(self._entries.items()))
            if first_seq > seq or first.output is None:
                return
            del self._entries[first_seq]

    def snapshot(self, upto: int | None) -> tuple[UndurableTurn, ...]:
        """The tail up to seq `upto` (None: all of it), for a `restore` frame; those entries count
        as sent from now on. Chunks above `upto` wait behind an edit (edits.py): they go after it."""
        kept = [e for seq, e in self._entries.items() if upto is None or seq <= upto]
        for entry in kept:
            entry.sent = True
        return tuple(UndurableTurn(e.chunk.chunk, e.output) for e in kept)

    def take_unsent(self, upto: int | None) -> list[LinkChunk]:
        """Chunks held (while the session moved, or behind an edit) up to seq `upto` (None: all),
        in seq order; marked sent."""
        unsent = [e for seq, e in self._entries.items() if not e.sent and (upto is None or seq <= upto)]
        for entry in unsent:
            entry.sent = True
        return [e.chunk for e in unsent]
