"""What one OpenAI socket has in flight with its session: the seqs it gave out, the item pieces and
the response not yet answered, and the input queued behind a running response (pending.py).

Why apart from the dialect: this is the bookkeeping of items and responses as native chunks, which
the dialect's two sides share (client events add to it, session messages settle it); the dialect
keeps the routing, the session settings and what each session message means to the client.

Invariants: seqs are given out in increasing order and handed to the session in that order (queued
input only while a response runs, released when it ends, before any later input can be decoded);
every chunk is admitted under the session's one rule before it exists, and settled from it when
answered or dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.limits import ChunkCost, SessionLimits
from gateway.openai import server_events as ev
from gateway.openai.admission import admit_event
from gateway.openai.client_events import ItemCreate, ItemDelete, NewItem, ResponseCreate
from gateway.openai.conversation import Conversation, Item
from gateway.openai.errors import RealtimeProblem
from gateway.openai.ids import item_id as new_item_id
from gateway.openai.pending import (
    PIECE_CHARS,
    TEMPLATE_CHARS,
    PendingInput,
    Queued,
    QueuedEdit,
    QueuedItem,
    QueuedResponse,
    item_costs,
    split,
)
from gateway.openai.responses import ActiveResponse
from shared.protocol.messages import ClientMessage, InputChunk, SessionRewind

# What an event sends: native requests for the session, and events for the client.
Sent = tuple[list[ClientMessage], list[ev.Event]]


class Flight:
    def __init__(self, conversation_id: str, usable: Callable[[], Conversation]) -> None:
        self._conversation_id = conversation_id
        self._usable = usable  # the conversation, or a RealtimeProblem if it can take no more
        self.rule: SessionLimits | None = None  # the session's admission rule, once attached
        self.seq = 0  # the last seq given out (sent, or reserved for queued input)
        self.sent_seq = 0  # the last seq handed to the session
        self.unanswered: set[int] = set()  # chunks handed to the session and not answered yet
        self.rewinds = 0  # rewinds handed to the session and not answered yet (the dialect answers)
        # seq -> (item id, is the item's last piece) for item chunks in flight.
        self.item_chunks: dict[int, tuple[str, bool]] = {}
        self.response: ActiveResponse | None = None
        self.pending = PendingInput()  # input that arrived while a response runs
        self._released: list[ClientMessage] = []  # its requests, once it may run
        # The last chunk that is part of the conversation (an item's, a response's, an out-of-band
        # response's flush, the open's marker), and for each item the last such chunk before it:
        # where deleting the item rewinds the session to (resend.py). None: the session's start.
        self.conversation_seq: int | None = None
        self.before_seq: dict[str, int | None] = {}

    @property
    def busy(self) -> bool:
        """A response runs (or input waits behind one, or an edit waits): new input queues."""
        return self.response is not None or bool(self.pending)

    @property
    def idle(self) -> bool:
        """No response runs, and every chunk and rewind handed to the session is answered: a rewind
        now cancels no turn (what an edit waits for)."""
        return self.response is None and not self.unanswered and not self.rewinds and not self._released

    def admit(self, chunks: Sequence[ChunkCost], param: str) -> None:
        assert self.rule is not None, "attach() comes before the first frame"
        admit_event(self.rule, chunks, param)

    def settle(self, seqs: Sequence[int]) -> None:
        for seq in seqs:
            self.unanswered.discard(seq)
            if self.rule is not None:
                self.rule.settle(seq)

    def note_sent(self, messages: Sequence[ClientMessage]) -> None:
        for message in messages:
            if isinstance(message, InputChunk):
                self.sent_seq = message.seq
                self.unanswered.add(message.seq)
            elif isinstance(message, SessionRewind):
                self.rewinds += 1

    def release(self, *messages: ClientMessage) -> None:
        """Requests for the session ahead of the input `join` releases next (the rewind and the
        items sent again that end an out-of-band response, out_of_band.py; a queued edit's)."""
        self._released += messages

    def take_released(self) -> tuple[ClientMessage, ...]:
        released, self._released = tuple(self._released), []
        self.note_sent(released)
        return released

    # ---- client events ------------------------------------------------------------------------

    def add_item(self, event: ItemCreate) -> Sent:
        """The item's chunks now, or nothing now when it queues behind a running response."""
        if self.busy:
            self._queue_item(event)
            return [], []
        conversation = self._usable()
        previous = conversation.last_item_id
        checkpoint = conversation.checkpoint()
        item, text = conversation.append(event.item, event.previous_item_id)
        pieces = [text[i : i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)] or [""]
        seqs = list(range(self.seq + 1, self.seq + 1 + len(pieces)))
        try:
            self.admit(
                [ChunkCost(s, len(p), False) for s, p in zip(seqs, pieces, strict=True)], "item.content"
            )
        except RealtimeProblem:
            conversation.rollback(checkpoint)
            raise
        self.seq = seqs[-1]
        added = ev.item_added(item.as_event(), previous)
        return self._item_chunks_for(item, seqs, pieces), [added]

    def add_response(self, event: ResponseCreate, make: Callable[[int], ActiveResponse]) -> Sent:
        """The response's chunk and opening events now, or nothing now when it queues; `make`
        builds the response for its seq (with or without tools, the dialect's choice)."""
        conversation = self._usable()
        if self.busy:  # it starts when what runs and what waits before it are done
            self.admit([ChunkCost(self.seq + 1, TEMPLATE_CHARS, True)], "response")
            self.seq += 1
            self.pending.put(QueuedResponse(event.event_id, make(self.seq)))
            return [], []
        checkpoint = conversation.checkpoint()
        header = conversation.begin_response()
        try:
            self.admit([ChunkCost(self.seq + 1, len(header), True)], "response")
        except RealtimeProblem:
            conversation.rollback(checkpoint)
            raise
        self.seq += 1
        response = make(self.seq)
        self.response = response
        self.joined(response.item_id, response.seq)
        opening = response.opening(self._conversation_id, conversation.last_item_id)
        return [_chunk(response, header)], opening

    def queue_edit(self, event: ItemDelete | ResponseCreate, block: int) -> None:
        """An edit that waits (pending.py `QueuedEdit`), with `block` seqs reserved for it."""
        self.pending.put(QueuedEdit(event.event_id, event, self.seq + 1))
        self.seq += block

    def _queue_item(self, event: ItemCreate) -> None:
        """Checked and admitted now, joined when the running response ends."""
        conversation = self._usable()
        wanted = event.item.item_id
        if wanted is not None and wanted in self.pending.item_ids:
            raise RealtimeProblem(
                f"item.id {wanted!r} already exists", param="item.id", code="duplicate_item_id"
            )
        last = self.pending.last_item_id if self.pending else None
        if last is None:
            last = self.response.item_id if self.response is not None else conversation.last_item_id
        calls = self.response.call_ids if self.response is not None else frozenset()
        conversation.check(event.item, event.previous_item_id, last, calls)
        costs = item_costs(self.seq + 1, len(event.item.text))
        self.admit(costs, "item.content")
        self.seq = costs[-1].seq
        item = NewItem(wanted or new_item_id(), event.item.role, event.item.text, event.item.call_id)
        self.pending.put(
            QueuedItem(event.event_id, item, event.previous_item_id, tuple(c.seq for c in costs))
        )

    def joined(self, item_id: str, last_seq: int) -> None:
        """Item `item_id` joins the conversation in chunks up to `last_seq`."""
        self.before_seq[item_id] = self.conversation_seq
        self.conversation_seq = last_seq

    def _item_chunks_for(self, item: Item, seqs: Sequence[int], pieces: Sequence[str]) -> list[ClientMessage]:
        self.joined(item.item_id, seqs[-1])
        for s in seqs:
            self.item_chunks[s] = (item.item_id, s == seqs[-1])
        return [InputChunk(s, text=p, max_output_tokens=0) for s, p in zip(seqs, pieces, strict=True)]

    # ---- when the running response ends ---------------------------------------------------------

    def join(self) -> list[ev.Event]:
        """Queued input joins, in order, up to the next response or edit (the dialect runs an edit,
        dialect.py `_advance`); its requests wait in `take_released`. An entry that can no longer
        join is an `error` naming its event."""
        events: list[ev.Event] = []
        while self.pending and self.response is None and not isinstance(self.pending.head, QueuedEdit):
            entry = self.pending.pop()
            assert not isinstance(entry, QueuedEdit)
            seqs = _seqs(entry)
            try:
                conversation = self._usable()
                if isinstance(entry, QueuedItem):
                    previous = conversation.last_item_id
                    item, text = conversation.append(entry.item, entry.previous_item_id)
                    self._released += self._item_chunks_for(item, seqs, split(text, len(seqs)))
                    events.append(ev.item_added(item.as_event(), previous))
                else:
                    response = entry.response
                    header = conversation.begin_response()
                    self.response = response
                    self.joined(response.item_id, response.seq)
                    events += response.opening(self._conversation_id, conversation.last_item_id)
                    self._released.append(_chunk(response, header))
            except RealtimeProblem as exc:
                self.settle(seqs)
                events.append(ev.error(exc, entry.event_id))
        return events

    def drop_queued(self) -> None:
        """The session underneath is gone (a failed open): the queue goes as if never sent."""
        for entry in self.pending.clear():
            self.settle(_seqs(entry))


def _seqs(entry: Queued) -> tuple[int, ...]:
    """The seqs admitted for a queued entry (an edit's are admitted only when it runs)."""
    return (entry.response.seq,) if isinstance(entry, QueuedResponse) else entry.seqs


def _chunk(response: ActiveResponse, header: str) -> InputChunk:
    """The chunk that generates `response`: its header, its length, its tool call's grammar."""
    return InputChunk(
        response.seq,
        text=header,
        max_output_tokens=response.max_output_tokens,
        response_format=response.response_format,
    )
