"""`conversation.item.delete` of any item (issue #35): the conversation goes on exactly as if it had
been sent without the item.

How: the session goes back to right before the item and the items after it are sent again
(resend.py); `conversation.item.deleted` goes out when the last of them is in (at the session's
`session.rewound` when none follows). The first item of a session whose instructions are its kept
prefix goes back to the chunk the session opened with, which ends where the instructions end.

It runs when the session is idle (no response, no chunk unanswered, no rewind unanswered): a rewind
cancels the session's turns, and a delete must cancel none. A delete that arrives while anything
is in flight waits for it, in order with the input around it (pending.py `QueuedEdit`; the dialect
runs it). Deleting a tool call, or an item followed by tool calls or their outputs, is refused
(#36's items: sending them again is not built yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.openai.conversation import Conversation
from gateway.openai.errors import RealtimeProblem
from gateway.openai.flight import Flight
from gateway.openai.resend import Resend, before_item, refuse_tool_items, render_again
from shared.protocol.messages import ClientMessage


@dataclass(frozen=True, slots=True)
class Deleting:
    """A delete under way: `conversation.item.deleted` goes out once chunk `last_seq` is done
    (None: at the session's `session.rewound`)."""

    item_id: str
    last_seq: int | None


def delete(
    flight: Flight,
    conversation: Conversation,
    item_id: str,
    *,
    kept_prefix: bool,
    first_seq: int | None = None,
) -> tuple[list[ClientMessage], Deleting]:
    """The requests that delete `item_id`, with seqs from `first_seq` (None: the next ones); the
    caller sends them only when the session is idle. Raises `RealtimeProblem` having changed
    nothing."""
    item, mark = conversation.find(item_id), conversation.marks.get(item_id)
    if item is not None and mark is not None:  # a tool item is refused as such, before its chunk is looked up
        refuse_tool_items(
            [item, *conversation.items[mark.items + 1 :]], "conversation.item.delete", "item_id"
        )
    before = before_item(flight, conversation, item_id, "item_id")
    assert item is not None and mark is not None  # before_item checked both
    if before is None and kept_prefix:  # the session did not open with its marker chunk
        raise RealtimeProblem(
            "conversation.item.delete: the first item shares its chunk with the instructions, which "
            "truncation keeps as the session's prefix; it cannot be deleted",
            param="item_id",
            code="unsupported_value",
        )
    checkpoint = conversation.checkpoint()
    later = conversation.back_to(mark)
    first = flight.seq + 1 if first_seq is None else first_seq
    try:
        resend = Resend(before, render_again(conversation, later[1:]))
        flight.admit(resend.costs(first), "item_id")
    except RealtimeProblem:
        conversation.rollback(checkpoint)
        raise
    flight.before_seq.pop(item_id, None)
    messages = resend.messages(flight, first)
    if first_seq is None:
        flight.seq += resend.count
    return messages, Deleting(item_id, first + resend.count - 1 if resend.count else None)
