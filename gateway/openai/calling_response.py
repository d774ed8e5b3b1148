"""A response that may call a tool: its text and its call, each its own output item, as they stream.

Why apart from `ActiveResponse`: a response without tools opens its one message item at once, as
before. With tools the output's shape is known only as it streams (call_parser.py): a message item
opens at the first visible text, a `function_call` item at the call's name, and each closes when
the next begins or the response ends, so `output_index` counts the items in the order they came
(OpenAI's order: text, then the call). The conversation keeps the reply as generated (the call's
text included, the KV holds it); the client sees the items (`shown`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from gateway.openai import server_events as ev
from gateway.openai.call_parser import ArgumentsDelta, CallEnded, CallParser, CallStarted, Piece, Text
from gateway.openai.conversation import Item
from gateway.openai.ids import call_id as new_call_id
from gateway.openai.ids import item_id as new_item_id
from gateway.openai.responses import ActiveResponse, ItemStatus, Outcome
from shared.protocol.messages import OutputDelta


@dataclass(slots=True)
class _Output:
    """One output item as it streams: a message (`call_id` None) or a call."""

    item_id: str
    index: int
    previous_item_id: str | None
    text: list[str] = field(default_factory=list)  # a message's text, a call's arguments
    call_id: str | None = None
    name: str = ""
    status: ItemStatus | None = None  # set once closed

    def event(self, status: ItemStatus | None = None) -> ev.Event:
        shown = status or self.status or "in_progress"
        if self.call_id is None:
            return ev.message_item(self.item_id, "assistant", "".join(self.text), shown)
        return ev.function_call_item(self.item_id, self.call_id, self.name, "".join(self.text), shown)

    def item(self) -> Item:
        status = self.status or "completed"
        if self.call_id is None:
            return Item(self.item_id, "assistant", "".join(self.text), status)
        return Item(
            self.item_id,
            "assistant",
            "",
            status,
            type="function_call",
            call_id=self.call_id,
            name=self.name,
            arguments="".join(self.text),
        )


@dataclass(slots=True)
class CallingResponse(ActiveResponse):
    parser: CallParser = field(default_factory=CallParser)
    outputs: list[_Output] = field(default_factory=list)
    previous_item_id: str | None = None

    @property
    def call_ids(self) -> frozenset[str]:
        """The calls this response has made so far (their outputs may be sent while it runs)."""
        return frozenset(o.call_id for o in self.outputs if o.call_id is not None and o.status)

    def opening(self, conversation_id: str, previous_item_id: str | None) -> list[ev.Event]:
        self.previous_item_id = previous_item_id
        return [ev.response_created(self._resource(conversation_id, "in_progress"))]

    def on_delta(self, delta: OutputDelta, stop_ids: Collection[int]) -> list[ev.Event]:
        self.last_token_text = delta.text
        if delta.token in stop_ids or not delta.text:
            return []
        self.deltas.append(delta.text)
        return self._events(self.parser.feed(delta.text))

    def closing(
        self, conversation_id: str, outcome: Outcome, usage: ev.Usage, previous_item_id: str | None
    ) -> list[ev.Event]:
        events = self._events(self.parser.finish())
        if self.outputs and self.outputs[-1].status is None:
            events += self._close(self.outputs[-1], outcome.item_status)
        resp = self._resource(
            conversation_id,
            outcome.status,
            output=[o.event() for o in self.outputs],
            usage=usage,
            reason=outcome.reason,
        )
        return [*events, ev.response_done(resp)]

    def shown(self) -> list[Item]:
        """The items the conversation records for this response (its reply is one message to the
        model; to the client it is these)."""
        return [o.item() for o in self.outputs]

    def _events(self, pieces: list[Piece]) -> list[ev.Event]:
        events: list[ev.Event] = []
        for piece in pieces:
            current = self.outputs[-1] if self.outputs and self.outputs[-1].status is None else None
            if isinstance(piece, Text):
                if not piece.text:
                    continue
                if current is None or current.call_id is not None:
                    current = self._open(None, "")
                    item = current.event()
                    events += [
                        ev.output_item_added(self.response_id, item, current.index),
                        ev.item_added(item, current.previous_item_id),
                        ev.content_part_added(self.response_id, current.item_id, current.index),
                    ]
                current.text.append(piece.text)
                events.append(ev.text_delta(self.response_id, current.item_id, piece.text, current.index))
            elif isinstance(piece, CallStarted):
                if current is not None:
                    events += self._close(current, "completed")
                call = self._open(new_call_id(), piece.name)
                item = call.event()
                events += [
                    ev.output_item_added(self.response_id, item, call.index),
                    ev.item_added(item, call.previous_item_id),
                ]
            elif isinstance(piece, ArgumentsDelta) and current is not None and current.call_id is not None:
                current.text.append(piece.text)
                events.append(
                    ev.arguments_delta(
                        self.response_id, current.item_id, current.index, current.call_id, piece.text
                    )
                )
            elif isinstance(piece, CallEnded) and current is not None:
                events += self._close(current, "completed" if piece.complete else "incomplete")
        return events

    def _open(self, call_id: str | None, name: str) -> _Output:
        previous = self.outputs[-1].item_id if self.outputs else self.previous_item_id
        # The response's own item id goes to its first item (the one a queued item names as its
        # previous when the response is a single call or a single message).
        item_id = self.item_id if not self.outputs else new_item_id()
        output = _Output(item_id, len(self.outputs), previous, call_id=call_id, name=name)
        self.outputs.append(output)
        return output

    def _close(self, output: _Output, status: ItemStatus) -> list[ev.Event]:
        output.status = status
        item = output.event()
        text = "".join(output.text)
        if output.call_id is None:
            opened = [
                ev.text_done(self.response_id, output.item_id, text, output.index),
                ev.content_part_done(self.response_id, output.item_id, text, output.index),
            ]
        else:
            opened = [
                ev.arguments_done(
                    self.response_id,
                    output.item_id,
                    output.index,
                    output.call_id,
                    name=output.name,
                    arguments=text,
                )
            ]
        return [
            *opened,
            ev.output_item_done(self.response_id, item, output.index),
            ev.item_done(item, output.previous_item_id),
        ]
