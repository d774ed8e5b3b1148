"""A session's rewinds and cancels not yet through to its worker, in order with its chunks.

Why the gateway keeps them: a rewind (`session.rewind`, `output.cancel` keeping k outputs) edits
the history the chunks around it run on, so it must reach the worker in the client's order, and
survive the worker: the same rule as a chunk's (docs/failover.md, exactly-once turns). Until its
`session.rewound` (or its refusal) arrives it may or may not be applied and logged there; a
session that moves meanwhile sends it again to its next worker, which is safe because a rewind
names a length (`to_seq`, `keep_tokens`, k outputs of a turn) and applying it twice in a row
changes nothing. The client gets exactly one answer: the next worker's.

The rules, per session (machine.py applies them):
- A rewind goes to the worker once every chunk sent before it has been sent, and holds every chunk
  and edit sent after it until it is answered: so at most one rewind is at the worker, and chunks
  never run on the history before a rewind the client sent first (nor after a later one).
- A plain cancel (no k) awaits no answer: it goes in its turn, and the queue moves on.
- After a move, a rewind waits for the turns before it to be answered on the new worker before it
  goes again: on the old worker it cancelled them where they stood, the new worker re-runs them to
  their end (the restore, exactly once), and a length counted in their outputs (`keep_tokens`, k
  outputs) must be there when the rewind applies. The history it leaves is the same. A cancel
  keeping k outputs of a turn that was still running goes as what it meant there, once that turn
  is answered: `keep_tokens` up to its k-th output (its outputs start at its `done`'s length less
  its outputs), which also cancels the turns queued behind it, as it did on the old worker (sent
  as itself, it would be refused: the re-run turn is no longer the session's last).
- While the session moves, edits wait here as chunks do, and go right after the restore.

Cost: nothing on the chunk path while no edit is pending: the machine reads `count`, a plain
attribute (no call into this module: tests/system/test_chunk_path.py measures the files a chunk runs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass
from typing import TypeAlias

from shared.protocol.link import LinkCancel, LinkRewind
from shared.protocol.messages import SessionRewind

Edit: TypeAlias = LinkRewind | LinkCancel


def awaits_answer(frame: Edit) -> bool:
    """A rewind, or a cancel keeping k outputs: answered by `rewound` or a refusal with no seq."""
    return isinstance(frame, LinkRewind) or frame.keep_output_tokens is not None


@dataclass(slots=True)
class _Pending:
    frame: Edit
    after: int  # the last chunk seq admitted before it (turns.py `NO_CHUNK`: none); later ones wait
    sent: bool = False  # at the worker, its answer awaited
    settle_first: bool = False  # sent again after a move: the turns before it are answered first
    # A cancel keeping k outputs of a turn the move caught running: sent once that turn is
    # answered, as `keep_tokens` (`turn_done`).
    until_done: int | None = None


class PendingEdits:
    """The edits in order; only the first may be at the worker."""

    def __init__(self) -> None:
        self._queue: deque[_Pending] = deque()
        self.count = 0  # the edits pending (kept equal to the queue's length; read, never written, outside)

    def add(self, frame: Edit, after: int) -> None:
        self._queue.append(_Pending(frame, after))
        self.count = len(self._queue)

    @property
    def boundary(self) -> int | None:
        """Chunks above this seq wait behind the first edit (None: nothing waits)."""
        return self._queue[0].after if self._queue else None

    @property
    def awaited(self) -> bool:
        """The first edit is at the worker, its answer awaited."""
        return bool(self._queue) and self._queue[0].sent

    def next_to_send(self, first_in_flight: int | None) -> Edit | None:
        """The first edit, when it may go now (`first_in_flight`: the lowest seq not answered, None
        when every chunk is); a plain cancel leaves the queue as it goes, a rewind stays until
        `answered`."""
        if not self._queue:
            return None
        head = self._queue[0]
        if head.sent or head.until_done is not None:
            return None
        if head.settle_first and first_in_flight is not None and first_in_flight <= head.after:
            return None
        if awaits_answer(head.frame):
            head.sent = True
        else:
            self._queue.popleft()
            self.count = len(self._queue)
        return head.frame

    def answered(self) -> None:
        """The worker answered the first edit (`rewound`, or its refusal)."""
        if self._queue and self._queue[0].sent:
            self._queue.popleft()
            self.count = len(self._queue)

    def moved(self, in_flight: Container[int]) -> None:
        """The session left its worker with the chunks `in_flight` unanswered: every edit goes again
        to the next one (a rewind after the turns before it are answered there)."""
        for pending in self._queue:
            frame = pending.frame
            pending.sent = False
            pending.settle_first = awaits_answer(frame)
            if isinstance(frame, LinkCancel) and awaits_answer(frame) and frame.seq in in_flight:
                pending.until_done = frame.seq

    def turn_done(self, seq: int, length: int, outputs: int) -> None:
        """Turn `seq` is answered (the session's `length` after it, `outputs` of it): a cancel that
        waited for it becomes the rewind it meant (`moved`)."""
        for pending in self._queue:
            frame = pending.frame
            if pending.until_done != seq or not isinstance(frame, LinkCancel):
                continue
            pending.until_done, pending.settle_first = None, False
            kept = frame.keep_output_tokens
            if kept is not None and outputs > 0 and kept <= outputs:
                pending.frame = LinkRewind(frame.sid, SessionRewind(keep_tokens=length - outputs + kept))
            # Else it goes as itself, and the worker judges it: with no outputs (a chunk folded into
            # a later append has that append's length) k must be 0; k above the outputs is refused.

    def turn_refused(self, seq: int) -> None:
        """Turn `seq` was refused (it never entered the session): a cancel that waited for it goes
        as itself, for the worker to judge."""
        self.turn_done(seq, 0, 0)
