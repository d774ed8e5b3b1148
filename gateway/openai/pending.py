"""Client input that arrives while a response runs: queued, already admitted, joined when it ends.

Why queue in the dialect and not send at once: an item joins the conversation *after* the running
response's reply, and the text it appends depends on how that reply ended (the template's end
marker is owed unless the model sampled it itself; conversation.py). So the item waits here until
the response is done, then joins: `conversation.item.added` goes out and its chunks run. A
`response.create` behind it waits too and starts right after. OpenAI's server accepts input during
a response the same way; for an interaction model it is the point: the user keeps talking while
the model answers.

Bounded like native chunks, by the one admission rule (gateway/limits.py): each queued event is
admitted when it arrives, under seqs reserved for it then, so a client that queues too much gets
the same retryable refusal a native client gets for too many chunks in flight, and an event that
was accepted is never refused later for its rate or the queue.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final, TypeAlias

from gateway.limits import ChunkCost
from gateway.openai.client_events import ItemDelete, NewItem, ResponseCreate
from gateway.openai.responses import ActiveResponse

# Characters per native text chunk: well under the worker's 512-token chunk limit for any text.
PIECE_CHARS: Final = 256
# What the chat template adds around an item's content (ChatML: `<|im_start|>user\n`, the end
# marker owed by the previous message): counted when an item is admitted before it is rendered.
TEMPLATE_CHARS: Final = 64


@dataclass(frozen=True, slots=True)
class QueuedItem:
    event_id: str | None
    item: NewItem  # its id is fixed when queued, so later items may name it as previous_item_id
    previous_item_id: str | None
    seqs: tuple[int, ...]  # reserved and admitted: its text goes out in exactly this many pieces


@dataclass(frozen=True, slots=True)
class QueuedResponse:
    event_id: str | None
    response: ActiveResponse  # its ids are fixed when queued


@dataclass(frozen=True, slots=True)
class QueuedEdit:
    """A `conversation.item.delete` or an out-of-band `response.create` that arrived while something
    was in flight (issue #35): it runs once everything before it is done and the session is idle
    (its rewind must cancel no turn), under seqs from `first_seq` (a block of the session's chunk
    burst reserved when it queued, so input queued behind it keeps increasing seqs). It is admitted
    when it runs: what it sends depends on the conversation then."""

    event_id: str | None
    event: ItemDelete | ResponseCreate
    first_seq: int
    seqs: tuple[int, ...] = ()  # nothing admitted while it waits


Queued: TypeAlias = QueuedItem | QueuedResponse | QueuedEdit


def split(text: str, count: int) -> list[str]:
    """`text` in exactly `count` consecutive pieces of near-equal length (some may be empty)."""
    size = max(1, math.ceil(len(text) / count))
    return [text[i * size : (i + 1) * size] for i in range(count)]


def item_costs(first_seq: int, content_chars: int) -> list[ChunkCost]:
    """The chunks a queued item will be sent as, with what each costs the session's queue."""
    total = content_chars + TEMPLATE_CHARS
    count = max(1, math.ceil(total / PIECE_CHARS))
    each = math.ceil(total / count)
    return [ChunkCost(first_seq + i, each, False) for i in range(count)]


class PendingInput:
    """The queue, in arrival order, and the id the last item will have once all of it has joined."""

    def __init__(self) -> None:
        self._queue: deque[Queued] = deque()
        self.last_item_id: str | None = None  # meaningful only while the queue is not empty
        self.item_ids: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def head(self) -> Queued | None:
        return self._queue[0] if self._queue else None

    def put(self, entry: Queued) -> None:
        self._queue.append(entry)
        if isinstance(entry, QueuedEdit):
            if len(self._queue) == 1:  # joins nothing: the last item is the conversation's (or the reply's)
                self.last_item_id = None
            return
        if isinstance(entry, QueuedItem):
            assert entry.item.item_id is not None
            self.last_item_id = entry.item.item_id
            self.item_ids.add(entry.item.item_id)
        else:
            self.last_item_id = entry.response.item_id

    @property
    def reply_ids(self) -> set[str]:
        """The item ids of the queued responses' replies."""
        return {entry.response.item_id for entry in self._queue if isinstance(entry, QueuedResponse)}

    def pop(self) -> Queued:
        entry = self._queue.popleft()
        if isinstance(entry, QueuedItem):
            self.item_ids.discard(entry.item.item_id or "")
        return entry

    def clear(self) -> list[Queued]:
        dropped = list(self._queue)
        self._queue.clear()
        self.item_ids.clear()
        return dropped
