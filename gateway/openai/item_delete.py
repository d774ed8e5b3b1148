"""`conversation.item.delete` of any item (issue #35): the conversation goes on exactly as if it had
been sent without the item.

How, with one KV sequence per session: the session is rewound to the last conversation chunk before
the item (`session.rewind {to_seq}`: the KV up to the item's first token stays, the held-back text
it had then too; the pages after it are freed with no forward pass), and the items after it are
rendered again after the items before it and sent as chunks that ask for no output (the engine
feeds a long append in budgeted pieces, as a window's cut, so other sessions do not wait).
`conversation.item.deleted` goes out when the last of them is in (at once when none follows).
A reply after the deleted item is sent again as the assistant message the template renders (what
the model would be given for that conversation whole).

Served when nothing is in flight (no response, no queued input, no item's chunks unanswered, no
other delete): otherwise the client is told to wait (`conversation_already_has_active_response`).
Deleting the first item of a session whose instructions are its kept prefix (truncation on) is
refused (`unsupported_value`): the session would have to be rewound inside its kept prefix. So is
deleting a tool call, or an item followed by tool calls or their outputs (#36's items: re-sending
them is not built yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.limits import ChunkCost
from gateway.openai.client_events import NewItem
from gateway.openai.conversation import Conversation
from gateway.openai.errors import RealtimeProblem
from gateway.openai.flight import Flight
from gateway.openai.pending import PIECE_CHARS
from shared.protocol.messages import ClientMessage, InputChunk, SessionRewind


@dataclass(frozen=True, slots=True)
class Deleting:
    """A delete under way: `conversation.item.deleted` goes out once chunk `last_seq` is done
    (None: at the session's `session.rewound`)."""

    item_id: str
    last_seq: int | None


def delete(
    flight: Flight, conversation: Conversation, item_id: str, *, kept_prefix: bool
) -> tuple[list[ClientMessage], Deleting]:
    """The requests that delete `item_id`; raises `RealtimeProblem` having changed nothing."""
    if flight.busy or flight.item_chunks:
        raise RealtimeProblem(
            "conversation.item.delete waits for what is in flight: send it after response.done and "
            "conversation.item.done",
            code="conversation_already_has_active_response",
        )
    item = conversation.find(item_id)
    mark = conversation.marks.get(item_id)
    before = flight.before_seq.get(item_id)
    if item is None or mark is None or before is None:
        raise RealtimeProblem(
            f"no item {item_id[:64]!r} in the conversation", param="item_id", code="item_not_found"
        )
    if before == 0 and kept_prefix:
        raise RealtimeProblem(
            "conversation.item.delete: the first item shares its chunk with the instructions, which "
            "truncation keeps as the session's prefix; it cannot be deleted",
            param="item_id",
            code="unsupported_value",
        )
    # A tool call and its reply's text are one assistant message (tools.py), and re-sending a call
    # or its output is not built yet: a delete that would have to is refused, changing nothing.
    if item.type == "function_call" or any(i.type != "message" for i in conversation.items[mark.items + 1 :]):
        raise RealtimeProblem(
            "conversation.item.delete: a tool call, or an item with tool calls or their outputs "
            "after it, cannot be deleted yet",
            param="item_id",
            code="unsupported_value",
        )
    checkpoint = conversation.checkpoint()
    later = conversation.back_to(mark)
    per_item: list[tuple[str, list[str]]] = []  # each later item's id and its text again, in pieces
    try:
        for follower in later[1:]:
            again, text = conversation.append(NewItem(follower.item_id, follower.role, follower.text), None)
            again.status = follower.status
            per_item.append(
                (again.item_id, [text[at : at + PIECE_CHARS] for at in range(0, len(text), PIECE_CHARS)])
            )
        count = sum(len(pieces) for _i, pieces in per_item)
        first = flight.seq + 1
        costs, seq = [], first
        for _i, pieces in per_item:
            for piece in pieces:
                costs.append(ChunkCost(seq, len(piece), False))
                seq += 1
        flight.admit(costs, "item_id")
    except RealtimeProblem:
        conversation.rollback(checkpoint)
        raise
    messages: list[ClientMessage] = [
        SessionRewind(keep_tokens=0) if before == 0 else SessionRewind(to_seq=before)
    ]
    flight.before_seq.pop(item_id, None)
    flight.conversation_seq = before
    seq = first
    for again_id, pieces in per_item:
        for piece in pieces:
            messages.append(InputChunk(seq, text=piece, max_output_tokens=0))
            seq += 1
        if pieces:
            flight.joined(again_id, seq - 1)
    flight.seq += count
    return messages, Deleting(item_id, flight.seq if count else None)
