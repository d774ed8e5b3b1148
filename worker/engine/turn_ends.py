"""Where each recent turn of a session ends in its sequence: what a rewind `to_seq` goes back to.

Each entry is seq -> (where the turn's outputs begin, where it ends, the session's held-back text
right after it), in the sequence's current positions: the `length` its `output.done` reported,
less the outputs (a chunk folded into a later append: its own input's end). Kept for the last
`MAX_TURN_ENDS` turns, so a session's bookkeeping does not grow with its life; a window cut moves
the entries of the turns it kept whole and drops the rest (that history is gone), and a rewind
drops the turns past its end. A restored session gets the entries of the turns its log still holds
as records (worker/server/restore.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from shared.settings import LOG_KEEP_RECORDS
from shared.store.log_format import Cut
from worker.tokenizer.incremental import EMPTY_TAIL, TextTail

# Turns whose ends a session remembers: the log's default `--log-keep-records`, the turns a
# compacted log still holds as records, so a restored session knows as many as its first worker.
MAX_TURN_ENDS: Final = LOG_KEEP_RECORDS


class TurnEnds:
    def __init__(self) -> None:
        self._spans: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._tails: dict[int, TextTail] = {}  # only the turns that left text held back

    def __len__(self) -> int:
        return len(self._spans)

    def items(self) -> list[tuple[int, int, int, TextTail]]:
        """(seq, outputs_start, end, tail) per remembered turn, oldest first (what a reopened
        session seeds)."""
        return [(seq, start, end, self.tail(seq)) for seq, (start, end) in self._spans.items()]

    def tail(self, seq: int) -> TextTail:
        """The text the session held back right after turn `seq` (a rewind to it restores it)."""
        return self._tails.get(seq, EMPTY_TAIL)

    def get(self, seq: int) -> tuple[int, int] | None:
        return self._spans.get(seq)

    @property
    def last_seq(self) -> int | None:
        return next(reversed(self._spans)) if self._spans else None

    def record(self, seq: int, outputs_start: int, end: int, tail: TextTail = EMPTY_TAIL) -> None:
        """Turn `seq` ended at `end`, its outputs from `outputs_start`, holding `tail` back (O(1):
        once per turn)."""
        self._spans[seq] = (outputs_start, end)
        self._spans.move_to_end(seq)
        if tail.text or tail.context:
            self._tails[seq] = tail
        else:
            self._tails.pop(seq, None)
        if len(self._spans) > MAX_TURN_ENDS:
            oldest, _ = self._spans.popitem(last=False)
            self._tails.pop(oldest, None)

    def after_cut(self, cut: Cut, length: int) -> None:
        """A window cut of a history of `length`: turns in its recent tokens move, the rest go."""
        first_kept = length - cut.recent
        shift = cut.keep - first_kept
        moved = [
            (seq, (start + shift, end + shift))
            for seq, (start, end) in self._spans.items()
            if cut.recent > 0 and start >= first_kept
        ]
        self._spans = OrderedDict(moved)
        self._tails = {seq: tail for seq, tail in self._tails.items() if seq in self._spans}

    def truncate(self, length: int) -> None:
        """A rewind to `length`: a turn it cut inside its outputs ends at `length`; later ones go."""
        kept: OrderedDict[int, tuple[int, int]] = OrderedDict()
        for seq, (start, end) in self._spans.items():
            if end <= length:
                kept[seq] = (start, end)
            elif start <= length:
                kept[seq] = (start, length)
        self._spans = kept
        self._tails = {seq: tail for seq, tail in self._tails.items() if seq in kept}
