"""Builders of the server events the dialect sends, shaped as the GA Realtime API's (validated in
tests against openai-python's own pydantic types, `RealtimeServerEvent`).

Why plain dicts from one place: each event has one builder, so its shape is written once and the
dialect never spells a field name; every builder gives the event a fresh `event_id`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.openai.errors import RealtimeProblem
from gateway.openai.ids import event_id

Event = dict[str, Any]
ItemStatus = Literal["completed", "incomplete", "in_progress"]
ResponseStatus = Literal["completed", "cancelled", "failed", "incomplete", "in_progress"]


def frame(event: Event) -> str:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":"))


def _event(kind: str, **fields: Any) -> Event:
    return {"type": kind, "event_id": event_id(), **fields}


@dataclass(frozen=True, slots=True)
class SessionView:
    """The session as `session.created` / `session.updated` show it."""

    session_id: str
    model: str
    instructions: str
    max_output_tokens: int | None  # None: "inf"
    # The settings kept only to be echoed (gateway/openai/session_config.py `ECHOED_FIELDS`).
    echoed: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self, *, identified: bool = False) -> Event:
        """The SDK's session config (`session.created`); `identified` adds the `id` and `object` of
        the session resource (the `session` of a client secret)."""
        identity = {"object": "realtime.session", "id": self.session_id} if identified else {}
        return {
            "type": "realtime",
            **identity,
            "model": self.model,
            "output_modalities": ["text"],
            "instructions": self.instructions,
            "tools": [],
            "tool_choice": "auto",
            **self.echoed,
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
        }


def session_created(view: SessionView) -> Event:
    return _event("session.created", session=view.as_dict())


def session_updated(view: SessionView) -> Event:
    return _event("session.updated", session=view.as_dict())


def message_item(
    item_id: str, role: str, text: str, status: Literal["completed", "incomplete", "in_progress"]
) -> Event:
    part_type = "output_text" if role == "assistant" else "input_text"
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": role,
        "status": status,
        "content": [{"type": part_type, "text": text}],
    }


def function_call_item(
    item_id: str,
    call_id: str,
    name: str,
    arguments: str,
    status: Literal["completed", "incomplete", "in_progress"],
) -> Event:
    """A call the model made (OpenAI's `RealtimeConversationItemFunctionCall`)."""
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def function_call_output_item(item_id: str, call_id: str, output: str) -> Event:
    """A call's output the client added (`RealtimeConversationItemFunctionCallOutput`)."""
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "function_call_output",
        "status": "completed",
        "call_id": call_id,
        "output": output,
    }


def item_added(item: Event, previous_item_id: str | None) -> Event:
    return _event("conversation.item.added", item=item, previous_item_id=previous_item_id)


def item_done(item: Event, previous_item_id: str | None) -> Event:
    return _event("conversation.item.done", item=item, previous_item_id=previous_item_id)


def item_deleted(item_id: str) -> Event:
    return _event("conversation.item.deleted", item_id=item_id)


def item_retrieved(item: Event) -> Event:
    return _event("conversation.item.retrieved", item=item)


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int
    cached_tokens: int
    output_tokens: int

    def as_dict(self) -> Event:
        return {
            "total_tokens": self.input_tokens + self.output_tokens,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "input_token_details": {
                "cached_tokens": self.cached_tokens,
                "text_tokens": self.input_tokens,
                "audio_tokens": 0,
            },
            "output_token_details": {"text_tokens": self.output_tokens, "audio_tokens": 0},
        }


def response(
    response_id: str,
    conversation_id: str,
    status: ResponseStatus,
    *,
    output: Sequence[Event] = (),
    max_output_tokens: int | None = None,
    metadata: Mapping[str, str] | None = None,
    usage: Usage | None = None,
    reason: str | None = None,
    error: RealtimeProblem | None = None,
) -> Event:
    details: Event | None = None
    if status in ("incomplete", "cancelled") and reason is not None:
        details = {"type": status, "reason": reason}
    elif status == "failed" and error is not None:
        details = {"type": "failed", "error": {"type": error.kind, "code": error.code}}
    return {
        "id": response_id,
        "object": "realtime.response",
        "conversation_id": conversation_id,
        "status": status,
        "status_details": details,
        "output": list(output),
        "output_modalities": ["text"],
        "max_output_tokens": "inf" if max_output_tokens is None else max_output_tokens,
        "metadata": None if metadata is None else dict(metadata),
        "usage": None if usage is None else usage.as_dict(),
    }


def response_created(resp: Event) -> Event:
    return _event("response.created", response=resp)


def response_done(resp: Event) -> Event:
    return _event("response.done", response=resp)


def output_item_added(response_id: str, item: Event, output_index: int = 0) -> Event:
    return _event("response.output_item.added", response_id=response_id, output_index=output_index, item=item)


def output_item_done(response_id: str, item: Event, output_index: int = 0) -> Event:
    return _event("response.output_item.done", response_id=response_id, output_index=output_index, item=item)


def _part_fields(response_id: str, item_id: str, output_index: int = 0) -> Event:
    return {"response_id": response_id, "item_id": item_id, "output_index": output_index, "content_index": 0}


def content_part_added(response_id: str, item_id: str, output_index: int = 0) -> Event:
    part = {"type": "text", "text": ""}
    return _event(
        "response.content_part.added", **_part_fields(response_id, item_id, output_index), part=part
    )


def content_part_done(response_id: str, item_id: str, text: str, output_index: int = 0) -> Event:
    part = {"type": "text", "text": text}
    return _event("response.content_part.done", **_part_fields(response_id, item_id, output_index), part=part)


def text_delta(response_id: str, item_id: str, delta: str, output_index: int = 0) -> Event:
    return _event(
        "response.output_text.delta", **_part_fields(response_id, item_id, output_index), delta=delta
    )


def text_done(response_id: str, item_id: str, text: str, output_index: int = 0) -> Event:
    return _event("response.output_text.done", **_part_fields(response_id, item_id, output_index), text=text)


def arguments_delta(response_id: str, item_id: str, output_index: int, call_id: str, delta: str) -> Event:
    return _event(
        "response.function_call_arguments.delta",
        response_id=response_id,
        item_id=item_id,
        output_index=output_index,
        call_id=call_id,
        delta=delta,
    )


def arguments_done(
    response_id: str, item_id: str, output_index: int, call_id: str, *, name: str, arguments: str
) -> Event:
    return _event(
        "response.function_call_arguments.done",
        response_id=response_id,
        item_id=item_id,
        output_index=output_index,
        call_id=call_id,
        name=name,
        arguments=arguments,
    )


def error(problem: RealtimeProblem, client_event_id: str | None = None) -> Event:
    body = {
        "type": problem.kind,
        "code": problem.code,
        "message": problem.message,
        "param": problem.param,
        "event_id": client_event_id,
    }
    return _event("error", error=body)


@dataclass(frozen=True, slots=True)
class RateLimit:
    name: Literal["requests", "tokens"]
    limit: int
    remaining: int
    reset_seconds: float


def rate_limits_updated(limits: Sequence[RateLimit]) -> Event:
    return _event(
        "rate_limits.updated",
        rate_limits=[
            {"name": r.name, "limit": r.limit, "remaining": r.remaining, "reset_seconds": r.reset_seconds}
            for r in limits
        ],
    )
