"""Out-of-band responses (`response.create` with `conversation: "none"`, issue #35): an answer over the
conversation (and, with `input`, items of its own) that adds nothing to the conversation.

How, with one KV sequence per session: an empty chunk that flushes first commits any text the
session held back, so the conversation ends on a token boundary there; the response's own input
and its generation prompt follow, rendered on a checkpoint of the conversation as a response would
be; once its `done` arrives the conversation goes back to the checkpoint and the session is rewound
to the flush chunk's end (`session.rewind {to_seq}`: its pages past it are freed, no forward pass).
So the response costs its own input and outputs, never a prefill of the conversation, and the next
item appends exactly as if it had never run. The rewind goes to the session before any input that
waited behind the response.

`input` is served when it begins with every conversation item, in order, as `item_reference`s (the
usual "the conversation so far, plus a question"): those items' KV is reused and only the rest is
rendered after them. Later references are copies of the items they name. An input that leaves
conversation items out is refused (`unsupported_value`): it would need the conversation's KV
rewound before those items and prefilled again after the response.

Assumption, stated: the flush before the response's input splits the text where the chat template
starts a message (ChatML's `<|im_start|>` is a special token, which a tokenizer splits on first), so
committing the held text there gives the tokens of the whole rendering.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.limits import ChunkCost
from gateway.openai import server_events as ev
from gateway.openai.client_events import ItemReference, NewItem, OutOfBand
from gateway.openai.conversation import Checkpoint, Conversation
from gateway.openai.errors import RealtimeProblem
from gateway.openai.flight import Flight, Sent
from gateway.openai.pending import PIECE_CHARS
from gateway.openai.responses import ActiveResponse
from shared.protocol.messages import InputChunk, SessionRewind

# Client events an out-of-band response does not send: nothing joins the conversation.
_CONVERSATION_EVENTS = frozenset({"conversation.item.added", "conversation.item.done"})


@dataclass(slots=True)
class OutOfBandRun:
    """An out-of-band response under way."""

    response: ActiveResponse
    checkpoint: Checkpoint  # the conversation as it was: restored when the response ends
    flush_seq: int  # the empty flushing chunk: the conversation's end, where the rewind goes back
    chunks: frozenset[int]  # the response's own chunks (its input pieces and its prompt)
    inputs: int = 0  # the tokens its chunks committed so far (its usage's own input)

    def rewind(self) -> SessionRewind:
        return SessionRewind(to_seq=self.flush_seq)


def start(
    flight: Flight,
    conversation: Conversation,
    oob: OutOfBand,
    *,
    limit: int,
    metadata: Mapping[str, str] | None,
    conversation_id: str,
) -> tuple[Sent, OutOfBandRun]:
    """The chunks and opening events of an out-of-band response; raises `RealtimeProblem` having
    changed nothing."""
    if flight.busy:
        raise RealtimeProblem(
            "an out-of-band response starts when no response runs: send it after response.done",
            code="conversation_already_has_active_response",
        )
    if not conversation.started:
        raise RealtimeProblem(
            "an out-of-band response needs the conversation to have started: add an item first",
            param="response.conversation",
            code="unsupported_value",
        )
    checkpoint = conversation.checkpoint()
    try:
        text = _render(conversation, oob)
        pieces = [text[i : i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)] or [""]
        flush_seq = flight.seq + 1
        seqs = list(range(flush_seq + 1, flush_seq + 1 + len(pieces)))
        costs = [ChunkCost(flush_seq, 0, False)]
        costs += [ChunkCost(s, len(p), s == seqs[-1]) for s, p in zip(seqs, pieces, strict=True)]
        flight.admit(costs, "response")
    except RealtimeProblem:
        conversation.rollback(checkpoint)
        raise
    flight.seq = seqs[-1]
    flight.conversation_seq = flush_seq  # the flush is the conversation's; what follows is not
    response = ActiveResponse(seqs[-1], limit, metadata)
    flight.response = response
    messages: list[InputChunk] = [InputChunk(flush_seq, text="", max_output_tokens=0, flush=True)]
    messages += [InputChunk(s, text=p, max_output_tokens=0) for s, p in zip(seqs[:-1], pieces, strict=False)]
    messages.append(InputChunk(seqs[-1], text=pieces[-1], max_output_tokens=limit))
    opening = without_conversation(response.opening(conversation_id, None))
    run = OutOfBandRun(response, checkpoint, flush_seq, frozenset(seqs))
    return (list(messages), opening), run


def without_conversation(events: list[ev.Event]) -> list[ev.Event]:
    """A response's events as an out-of-band one sends them: no conversation item, no conversation."""
    kept = [event for event in events if event.get("type") not in _CONVERSATION_EVENTS]
    for event in kept:
        resource = event.get("response")
        if isinstance(resource, dict):
            resource["conversation_id"] = None
    return kept


def _render(conversation: Conversation, oob: OutOfBand) -> str:
    """The response's input rendered after the conversation, then its generation prompt (on the
    conversation itself: the caller rolls it back to its checkpoint)."""
    text = ""
    for item in _own_items(conversation, oob):
        _added, piece = conversation.append(item, None)
        text += piece
    return text + conversation.begin_response()


def _own_items(conversation: Conversation, oob: OutOfBand) -> list[NewItem]:
    """The input's items after the conversation it begins with (none without `input`)."""
    if oob.input is None:
        return []
    items = conversation.items
    given = list(oob.input)
    for index, entry in enumerate(given):
        if isinstance(entry, ItemReference) and conversation.find(entry.item_id) is None:
            raise RealtimeProblem(
                f"no item {entry.item_id[:64]!r} in the conversation",
                param=f"response.input[{index}].id",
                code="item_not_found",
            )
    for index, item in enumerate(items):
        named = given[index] if index < len(given) else None
        if not isinstance(named, ItemReference) or named.item_id != item.item_id:
            raise RealtimeProblem(
                "response.input must begin with every conversation item, in order, as item_reference "
                "(then items of its own): an input that leaves conversation items out is not served",
                param=f"response.input[{index}]",
                code="unsupported_value",
            )
    own: list[NewItem] = []
    for index, entry in enumerate(given[len(items) :], start=len(items)):
        if isinstance(entry, ItemReference):
            found = conversation.find(entry.item_id)
            assert found is not None  # checked above
            if found.type != "message":  # a tool call or its output is no message to copy
                raise RealtimeProblem(
                    "response.input: a reference after the conversation's own items must name a message item",
                    param=f"response.input[{index}].id",
                    code="unsupported_value",
                )
            own.append(NewItem(None, found.role, found.text))
        else:
            own.append(NewItem(None, entry.role, entry.text))  # its id names nothing here
    return own
