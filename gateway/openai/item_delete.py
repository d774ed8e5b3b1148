"""`conversation.item.delete` of any item (issue #35): the conversation goes on exactly as if it had
been sent without the item.

How: the session goes back to right before the item and the items after it are sent again
(resend.py); `conversation.item.deleted` goes out when the last of them is in (at the session's
`session.rewound` when none follows). The first item of a session whose instructions are its kept
prefix goes back to the chunk the session opened with, which ends where the instructions end.

It runs when the session is idle (no response, no chunk unanswered, no rewind unanswered): a rewind
cancels the session's turns, and a delete must cancel none. A delete that arrives while anything
is in flight waits for it, in order with the input around it (pending.py `QueuedEdit`; the dialect
runs it).

Tool items (#36) are deleted as any other, and sent again as resend.py says. Deleting one item of
a reply that called a tool (its text, or its call) deletes that item only: the session goes back to
before the reply, and what is left of it is sent again as the assistant message its remaining
items spell (the call's markup without its text, or the text without the call), which is the
reply's text as generated less the deleted item's part. Deleting a call whose output is in the
conversation keeps the output, sent again as the same tool message (its call id then names no
call).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.openai.conversation import Conversation
from gateway.openai.errors import RealtimeProblem
from gateway.openai.flight import Flight
from gateway.openai.resend import Resend, before_item, chunk_key, render_again
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
    before = before_item(flight, conversation, item_id, "item_id")
    item, mark = conversation.find(item_id), conversation.marks.get(item_id)
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
        # A reply's item goes back to before the reply: its other items are sent again too.
        resend = Resend(before, render_again(conversation, [i for i in later if i.item_id != item_id]))
        flight.admit(resend.costs(first), "item_id")
    except RealtimeProblem:
        conversation.rollback(checkpoint)
        raise
    flight.before_seq.pop(chunk_key(item), None)  # a reply's items left join again under it
    messages = resend.messages(flight, first)
    if first_seq is None:
        flight.seq += resend.count
    return messages, Deleting(item_id, first + resend.count - 1 if resend.count else None)
