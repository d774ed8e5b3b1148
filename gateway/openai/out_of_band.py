"""Out-of-band responses (`response.create` with `conversation: "none"`, issue #35): an answer over the
conversation, or over exactly the items of its `input`, that adds nothing to the conversation.

How, with one KV sequence per session, by what `input` begins with:
- **the whole conversation** (no `input`, or `input` starting with every conversation item in order
  as `item_reference`s: the usual "the conversation so far, plus a question"): an empty chunk that
  flushes first commits any text the session held back, so the conversation ends on a token
  boundary there; the response's own items and its generation prompt follow, rendered after the
  conversation as a response would be; once its `done` arrives the session is rewound to the flush
  chunk's end (`session.rewind {to_seq}`: the pages past it are freed, no forward pass). It costs
  its own input and outputs, never a prefill of the conversation.
- **the conversation's first k items only** (k may be 0: an `input` of other items, or of items
  picked out of the conversation): the session is rewound to right before item k+1 (resend.py), the
  response's own items are rendered after the first k and answered, then the session is rewound
  there again and the conversation's items from k+1 on are sent again (resend.py) before any input
  that waited. It costs its own input and outputs plus a prefill of the conversation after its
  first k items (docs/design.md says why this and not a fork of the session).

Either way the conversation afterwards is the one the client built, in the KV exactly as the
template renders it; every step is a native rewind or chunk, so the token log holds it and a
restored session continues from it. The items it sends again are admitted with the response (one
event, one admission): an out-of-band response whose input and resend exceed what one event may
carry is refused, having changed nothing. References after the first k are copies of the items
they name, tool items included: copies of one reply's items in a row are what is left of that reply
(the one assistant message they spell, conversation.py `message_of`), a call's output its tool
message. References that end inside a reply (its text, not its call) keep the conversation up to
before the reply: the reply's items referenced are then copies.

Assumption, stated: the flush before the response's input splits the text where the chat template
starts a message (ChatML's `<|im_start|>` is a special token, which a tokenizer splits on first), so
committing the held text there gives the tokens of the whole rendering.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import groupby

from gateway.limits import ChunkCost
from gateway.openai import server_events as ev
from gateway.openai.client_events import ItemReference, NewItem, OutOfBand
from gateway.openai.conversation import Checkpoint, Conversation, Item
from gateway.openai.errors import RealtimeProblem
from gateway.openai.flight import Flight, Sent
from gateway.openai.ids import item_id as new_item_id
from gateway.openai.pending import PIECE_CHARS
from gateway.openai.resend import Resend, before_item, messages_of, render_again
from gateway.openai.responses import ActiveResponse
from shared.protocol.messages import ClientMessage, InputChunk, SessionRewind

# Client events an out-of-band response does not send: nothing joins the conversation.
_CONVERSATION_EVENTS = frozenset({"conversation.item.added", "conversation.item.done"})


@dataclass(slots=True)
class OutOfBandRun:
    """An out-of-band response under way."""

    response: ActiveResponse
    after: Checkpoint  # the conversation once it ends (as it was, or as sent again)
    chunks: frozenset[int]  # the response's own chunks (its flush, its input pieces, its prompt)
    flush_seq: int | None  # over the whole conversation: the flush chunk, where the rewind goes back
    restore: Resend | None  # over its first k items: the items sent again once it ends ...
    restore_seq: int  # ... from this seq on (admitted with it)
    inputs: int = 0  # the tokens its chunks committed so far (its usage's own input)

    def ending(self, flight: Flight) -> list[ClientMessage]:
        """What puts the session back under the conversation once the response ended or failed."""
        if self.restore is None:
            assert self.flush_seq is not None
            return [SessionRewind(to_seq=self.flush_seq)]
        return self.restore.messages(flight, self.restore_seq)


def start(
    flight: Flight,
    conversation: Conversation,
    oob: OutOfBand,
    *,
    limit: int,
    metadata: Mapping[str, str] | None,
    conversation_id: str,
    first_seq: int | None = None,
) -> tuple[Sent, OutOfBandRun]:
    """The requests and opening events of an out-of-band response, with seqs from `first_seq`
    (None: the next ones). Over the conversation's first k items only, it begins with a rewind: the
    caller sends it only when the session is idle. Raises `RealtimeProblem` having changed nothing."""
    if not conversation.started:
        raise RealtimeProblem(
            "an out-of-band response needs the conversation to have started: add an item first",
            param="response.conversation",
            code="unsupported_value",
        )
    kept, own = _plan(conversation, oob)
    checkpoint = conversation.checkpoint()
    first = flight.seq + 1 if first_seq is None else first_seq
    try:
        restore, after = None, checkpoint
        if kept < len(conversation.items):
            out = conversation.items[kept]
            before = before_item(flight, conversation, out.item_id, "response.input")
            later = conversation.back_to(conversation.marks[out.item_id])
            at_divergence = conversation.checkpoint()
            restore = Resend(before, render_again(conversation, later))
            after = conversation.checkpoint()
            conversation.rollback(at_divergence)
        text = _render(conversation, own)
        pieces = [text[i : i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)] or [""]
        flush_seq = first if restore is None else None
        own_first = first if flush_seq is None else flush_seq + 1
        seqs = list(range(own_first, own_first + len(pieces)))
        costs = [] if flush_seq is None else [ChunkCost(flush_seq, 0, False)]
        costs += [ChunkCost(s, len(p), s == seqs[-1]) for s, p in zip(seqs, pieces, strict=True)]
        restore_seq = seqs[-1] + 1
        if restore is not None:
            costs += restore.costs(restore_seq)
        flight.admit(costs, "response")
    finally:
        conversation.rollback(checkpoint)  # the client's conversation meanwhile, and on a refusal
    if first_seq is None:
        flight.seq = seqs[-1] + (restore.count if restore is not None else 0)
    response = ActiveResponse(seqs[-1], limit, metadata)
    flight.response = response
    messages: list[ClientMessage] = []
    if restore is None:
        assert flush_seq is not None
        flight.conversation_seq = flush_seq  # the flush is the conversation's; what follows is not
        messages.append(InputChunk(flush_seq, text="", max_output_tokens=0, flush=True))
    else:
        flight.conversation_seq = restore.before  # what follows the rewind is not the conversation's
        messages.append(restore.rewind)
    messages += [InputChunk(s, text=p, max_output_tokens=0) for s, p in zip(seqs[:-1], pieces, strict=False)]
    messages.append(InputChunk(seqs[-1], text=pieces[-1], max_output_tokens=limit))
    opening = without_conversation(response.opening(conversation_id, None))
    run = OutOfBandRun(response, after, frozenset(seqs), flush_seq, restore, restore_seq)
    return (messages, opening), run


def appends(conversation: Conversation, oob: OutOfBand) -> bool:
    """True when the response is over the whole conversation (it only appends, then rewinds);
    raises `RealtimeProblem` for an input it cannot serve."""
    return _plan(conversation, oob)[0] == len(conversation.items)


def without_conversation(events: list[ev.Event]) -> list[ev.Event]:
    """A response's events as an out-of-band one sends them: no conversation item, no conversation."""
    kept = [event for event in events if event.get("type") not in _CONVERSATION_EVENTS]
    for event in kept:
        resource = event.get("response")
        if isinstance(resource, dict):
            resource["conversation_id"] = None
    return kept


def _render(conversation: Conversation, own: list[NewItem | Item]) -> str:
    """The response's own items rendered after the conversation as it stands, then its generation
    prompt (on the conversation itself: the caller rolls it back)."""
    # Copies join as the messages they are (a reply's in a row as one), in order with the new ones:
    # each group of `own` is all copies or all new items (the filters below only tell mypy which).
    text = ""
    for _, entries in groupby(own, key=lambda entry: isinstance(entry, Item)):
        run = list(entries)
        copies = [entry for entry in run if isinstance(entry, Item)]
        for message in messages_of(copies):
            text += conversation.rejoin(message)
        for new in (entry for entry in run if isinstance(entry, NewItem)):
            text += conversation.append(new, None)[1]
    return text + conversation.begin_response()


def _plan(conversation: Conversation, oob: OutOfBand) -> tuple[int, list[NewItem | Item]]:
    """How many conversation items the input begins with (in order, as references), and its items
    after them (copies, with ids of their own, of the items referenced); changes nothing."""
    items = conversation.items
    if oob.input is None:
        return len(items), []
    given = list(oob.input)
    for index, entry in enumerate(given):
        if isinstance(entry, ItemReference) and conversation.find(entry.item_id) is None:
            raise RealtimeProblem(
                f"no item {entry.item_id[:64]!r} in the conversation",
                param=f"response.input[{index}].id",
                code="item_not_found",
            )
    kept = 0
    while (
        kept < min(len(items), len(given))
        and isinstance(given[kept], ItemReference)
        and given[kept].item_id == items[kept].item_id
    ):
        kept += 1
    reply = items[kept].reply_id if 0 < kept < len(items) else None
    while reply is not None and kept and items[kept - 1].reply_id == reply:
        kept -= 1  # the references end inside a reply: what they give of it is copies
    own: list[NewItem | Item] = []
    for entry in given[kept:]:
        if isinstance(entry, ItemReference):
            found = conversation.find(entry.item_id)
            assert found is not None  # checked above
            own.append(replace(found, item_id=new_item_id()))
        else:
            own.append(NewItem(None, entry.role, entry.text))  # its id names nothing here
    return kept, own
