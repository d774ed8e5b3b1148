"""A session's undurable turns on the gateway: what a restoring worker needs that Redis may lack.

Exactly-once turns across a worker crash (docs/failover.md): the worker appends each turn to the
token log in Redis shortly *after* its `done` went out, and reports on its frames the last seq it
knows is durable (`durable_seq`). Until then the turn exists only in the worker's memory, and in
this tail: every chunk forwarded (or held while the session moves), with the output the client
already got for it. On restore the tail goes to the new worker, which appends delivered turns as
history and re-runs the rest.

Invariants:
- Entries are in seq order (chunks are forwarded in the order they arrive, seqs increase).
- An entry leaves when its chunk was refused (an `error` with its seq: it never entered the
  session) or when it is delivered *and* durable. So the tail is bounded by the chunks in flight plus
  those of the last ~20 ms flush interval: the per-chunk cost is a dict insert and a pop.
- A `done` for a seq that was already delivered is a duplicate (a re-run the client already had an
  answer for) and is dropped; so are deltas a re-run repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol.link import LinkChunk, LinkDelta, LinkDone, UndurableTurn


@dataclass(slots=True)
class _Entry:
    chunk: LinkChunk
    output: tuple[int, ...] | None = None
    sent: bool = True  # False while held: it reaches the (next) worker after its restore
    deltas: int = 0  # deltas already forwarded to the client


class UndurableTurns:
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

    def snapshot(self) -> tuple[UndurableTurn, ...]:
        """The whole tail, for a `restore` frame; every entry counts as sent from now on."""
        for entry in self._entries.values():
            entry.sent = True
        return tuple(UndurableTurn(e.chunk.chunk, e.output) for e in self._entries.values())

    def take_unsent(self) -> list[LinkChunk]:
        """Chunks held since the restore frame was built, in seq order; marked sent."""
        unsent = [e for e in self._entries.values() if not e.sent]
        for entry in unsent:
            entry.sent = True
        return [e.chunk for e in unsent]
