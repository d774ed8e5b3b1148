"""Going back to before an item and sending what followed again (issue #35): what a
`conversation.item.delete` is made of, and what puts the conversation back after an out-of-band
response over other items than the conversation's.

Why this way, with one KV sequence per session: tokens leave the middle of a history only by
rewinding the session to right before them and appending what followed again. The rewind goes to
the last conversation chunk before the item (`session.rewind {to_seq}`: the KV up to the item's
first token stays, and so does the text the session held back there; the pages after it are freed
with no forward pass), or to the session's start (`keep_tokens: 0`) when nothing of the
conversation came before it. The items after it are rendered again after the items before it (a
reply as the assistant message the template renders: what the model is given for that conversation
whole) and sent as chunks that ask for no output; the engine prefills them in budgeted pieces, as a
window's cut, so other sessions do not wait.

Tool items are sent again as what they are to the model (conversation.py `message_of`): the items
left of a reply that called a tool as its one assistant message (the reply as generated while all
of them are left; its text alone once its call is deleted, its call alone once its text is), a
call's output as its tool message, also once its call is deleted (the call's id then names no call:
a second output for it is refused). Items keep their ids, call ids and statuses. A reply's items
go back to where the reply began, so deleting one of them goes back to before the whole reply.

A session whose instructions are its kept prefix (truncation on) opens with a chunk of its own that
ends where they end (dialect.py `_open`), so going back to before its first item is a rewind to
that chunk: the kept prefix is never rewound into.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.limits import ChunkCost
from gateway.openai.conversation import Conversation, Item
from gateway.openai.errors import RealtimeProblem
from gateway.openai.flight import Flight
from gateway.openai.pending import PIECE_CHARS
from shared.protocol.messages import ClientMessage, InputChunk, SessionRewind


@dataclass(frozen=True, slots=True)
class Resend:
    """A rewind to before an item, then the items that follow it, sent again."""

    before: int | None  # the last conversation chunk before the first item (None: the session's start)
    # Each message sent again: its key (`chunk_key`), its text in pieces.
    items: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def count(self) -> int:
        """The chunks it sends."""
        return sum(len(pieces) for _id, pieces in self.items)

    @property
    def rewind(self) -> SessionRewind:
        return SessionRewind(keep_tokens=0) if self.before is None else SessionRewind(to_seq=self.before)

    def costs(self, first_seq: int) -> list[ChunkCost]:
        """What its chunks, from `first_seq` on, cost the session's queue (admitted with its event)."""
        pieces = [piece for _id, item_pieces in self.items for piece in item_pieces]
        return [ChunkCost(first_seq + i, len(piece), False) for i, piece in enumerate(pieces)]

    def messages(self, flight: Flight, first_seq: int) -> list[ClientMessage]:
        """The rewind and the chunks, from `first_seq` on; the items join the conversation's chunks
        (`Flight.before_seq`) as they are sent again."""
        messages: list[ClientMessage] = [self.rewind]
        flight.conversation_seq = self.before
        seq = first_seq
        for item_id, pieces in self.items:
            for piece in pieces:
                messages.append(InputChunk(seq, text=piece, max_output_tokens=0))
                seq += 1
            if pieces:
                flight.joined(item_id, seq - 1)
        return messages


def chunk_key(item: Item) -> str:
    """The key of the chunks `item` is in (`Flight.before_seq`): its reply's (a reply's chunk is
    recorded under the id of its first item, which the reply's items keep as `reply_id`), else its
    own id."""
    return item.reply_id or item.item_id


def before_item(flight: Flight, conversation: Conversation, item_id: str, param: str) -> int | None:
    """The conversation chunk right before item `item_id` (for a reply's item: before the reply;
    None: the session's start); raises `item_not_found` for an item the conversation has no chunk
    record of."""
    item = conversation.find(item_id)
    if item is None or item_id not in conversation.marks or chunk_key(item) not in flight.before_seq:
        raise RealtimeProblem(
            f"no item {item_id[:64]!r} in the conversation", param=param, code="item_not_found"
        )
    return flight.before_seq[chunk_key(item)]


def messages_of(items: Sequence[Item]) -> list[list[Item]]:
    """`items` as the messages they are to the model: each run of one reply's items together, each
    client item alone."""
    messages: list[list[Item]] = []
    for item in items:
        if messages and item.reply_id is not None and messages[-1][0].reply_id == item.reply_id:
            messages[-1].append(item)
        else:
            messages.append([item])
    return messages


def render_again(
    conversation: Conversation, later: Sequence[Item]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`later` joining the conversation again (after `Conversation.back_to`), as they were: each
    message's key and its text, in pieces. Raises `RealtimeProblem` (the caller rolls back)."""
    again: list[tuple[str, tuple[str, ...]]] = []
    for message in messages_of(later):
        text = conversation.rejoin(message)
        pieces = tuple(text[at : at + PIECE_CHARS] for at in range(0, len(text), PIECE_CHARS))
        again.append((chunk_key(message[0]), pieces))
    return tuple(again)
