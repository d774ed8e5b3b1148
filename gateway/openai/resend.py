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

A session whose instructions are its kept prefix (truncation on) opens with a chunk of its own that
ends where they end (dialect.py `_open`), so going back to before its first item is a rewind to
that chunk: the kept prefix is never rewound into.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.limits import ChunkCost
from gateway.openai.client_events import NewItem
from gateway.openai.conversation import Conversation, Item
from gateway.openai.errors import RealtimeProblem
from gateway.openai.flight import Flight
from gateway.openai.pending import PIECE_CHARS
from shared.protocol.messages import ClientMessage, InputChunk, SessionRewind


@dataclass(frozen=True, slots=True)
class Resend:
    """A rewind to before an item, then the items that follow it, sent again."""

    before: int | None  # the last conversation chunk before the first item (None: the session's start)
    items: tuple[tuple[str, tuple[str, ...]], ...]  # each item sent again: its id, its text in pieces

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


def before_item(flight: Flight, conversation: Conversation, item_id: str, param: str) -> int | None:
    """The conversation chunk right before item `item_id` (None: the session's start); raises
    `item_not_found` for an item the conversation has no chunk record of."""
    if (
        conversation.find(item_id) is None
        or item_id not in conversation.marks
        or item_id not in flight.before_seq
    ):
        raise RealtimeProblem(
            f"no item {item_id[:64]!r} in the conversation", param=param, code="item_not_found"
        )
    return flight.before_seq[item_id]


def refuse_tool_items(items: Sequence[Item], what: str, param: str) -> None:
    """A tool call and its reply's text are one assistant message (tools.py), and sending a call or
    its output again is not built: an edit that would have to is refused, changing nothing."""
    if any(item.type != "message" for item in items):
        raise RealtimeProblem(
            f"{what}: tool calls or their outputs would have to be sent again, which is not built yet",
            param=param,
            code="unsupported_value",
        )


def render_again(
    conversation: Conversation, later: Sequence[Item]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`later` appended again to the conversation (after `Conversation.back_to`), each with its id
    and status: their text, in pieces. Raises `RealtimeProblem` (the caller rolls back)."""
    again: list[tuple[str, tuple[str, ...]]] = []
    for follower in later:
        added, text = conversation.append(NewItem(follower.item_id, follower.role, follower.text), None)
        added.status = follower.status
        again.append(
            (added.item_id, tuple(text[at : at + PIECE_CHARS] for at in range(0, len(text), PIECE_CHARS)))
        )
    return tuple(again)
