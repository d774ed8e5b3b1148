"""One response under way: its ids, the text generated so far, and the events that open and close it.

Why apart from the dialect: a response's own bookkeeping (which deltas are text, which token was
the stop token, how `finish` maps to OpenAI's status) does not depend on the conversation or the
session, and keeping it here leaves the dialect to route messages.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from gateway.openai import server_events as ev
from gateway.openai.conversation import Item
from gateway.openai.errors import RealtimeProblem
from gateway.openai.ids import item_id, response_id
from shared.protocol.messages import OutputDelta, OutputDone
from shared.protocol.response_format import ResponseFormat

ItemStatus = Literal["completed", "incomplete"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a response ended: its text (no stop token), the stop token's text if it ended on one."""

    reply: str
    stop_text: str | None
    status: ev.ResponseStatus
    reason: str | None

    @property
    def item_status(self) -> ItemStatus:
        return "completed" if self.status == "completed" else "incomplete"


@dataclass(slots=True)
class ActiveResponse:
    seq: int  # the native chunk that generates it
    max_output_tokens: int
    metadata: Mapping[str, str] | None
    # The grammar its output is held to (a tool call's, tools.py), sent with its chunk.
    response_format: ResponseFormat | None = None
    response_id: str = field(default_factory=response_id)
    item_id: str = field(default_factory=item_id)
    deltas: list[str] = field(default_factory=list)
    last_token_text: str | None = None

    def _resource(self, conversation_id: str, status: ev.ResponseStatus, **fields: object) -> ev.Event:
        return ev.response(
            self.response_id,
            conversation_id,
            status,
            max_output_tokens=self.max_output_tokens,
            metadata=self.metadata,
            **fields,  # type: ignore[arg-type]
        )

    @property
    def call_ids(self) -> frozenset[str]:
        """The tool calls it made so far (calling_response.py); none without tools."""
        return frozenset()

    def shown(self) -> list[Item] | None:
        """The items the conversation records for it; None: its one message item."""
        return None

    def opening(self, conversation_id: str, previous_item_id: str | None) -> list[ev.Event]:
        item = ev.message_item(self.item_id, "assistant", "", "in_progress")
        return [
            ev.response_created(self._resource(conversation_id, "in_progress")),
            ev.item_added(item, previous_item_id),
            ev.output_item_added(self.response_id, item),
            ev.content_part_added(self.response_id, self.item_id),
        ]

    def on_delta(self, delta: OutputDelta, stop_ids: Collection[int]) -> list[ev.Event]:
        self.last_token_text = delta.text
        if delta.token in stop_ids or not delta.text:
            return []  # a stop token ends the reply; it is not text
        self.deltas.append(delta.text)
        return [ev.text_delta(self.response_id, self.item_id, delta.text)]

    def outcome(self, done: OutputDone, stop_ids: Collection[int]) -> Outcome:
        stopped = done.finish == "stop" and bool(done.tokens) and done.tokens[-1] in stop_ids
        reply = "".join(self.deltas)
        if done.finish == "length":
            return Outcome(reply, None, "incomplete", "max_output_tokens")
        if done.finish == "cancelled":
            return Outcome(reply, None, "cancelled", "client_cancelled")
        return Outcome(reply, self.last_token_text if stopped else None, "completed", None)

    def closing(
        self, conversation_id: str, outcome: Outcome, usage: ev.Usage, previous_item_id: str | None
    ) -> list[ev.Event]:
        item = ev.message_item(self.item_id, "assistant", outcome.reply, outcome.item_status)
        resp = self._resource(
            conversation_id, outcome.status, output=[item], usage=usage, reason=outcome.reason
        )
        return [
            ev.text_done(self.response_id, self.item_id, outcome.reply),
            ev.content_part_done(self.response_id, self.item_id, outcome.reply),
            ev.output_item_done(self.response_id, item),
            ev.item_done(item, previous_item_id),
            ev.response_done(resp),
        ]

    def failed(self, conversation_id: str, problem: RealtimeProblem) -> list[ev.Event]:
        return [ev.error(problem), ev.response_done(self._resource(conversation_id, "failed", error=problem))]
