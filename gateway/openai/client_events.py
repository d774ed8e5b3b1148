"""The client events of the OpenAI Realtime API (GA names, as in openai-python's `types/realtime`),
parsed and validated into frozen dataclasses before anything acts on them.

Why strict here: the dialect promises "validate before mutating", so everything a client can get
wrong in one event is found while reading it and answered with an `error` naming the event. What a
text-only model cannot do is refused when a client *uses* it (audio sent),
with a message saying so; settings it cannot act on are accepted and echoed (session_config.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from gateway.openai.errors import BadEvent
from gateway.openai.session_config import (
    SessionUpdate,
    parse_session_update,
    read_max_output_tokens,
    text_only,
)
from gateway.openai.tools import ToolChoice, parse_tool_choice

Role = Literal["user", "system", "assistant"]
ROLES: Final = ("user", "system", "assistant")
# The content part types a message of each role may carry (text only: this model takes no audio).
_TEXT_PARTS: Final[dict[str, tuple[str, ...]]] = {
    "user": ("input_text", "text"),
    "system": ("input_text", "text"),
    "assistant": ("output_text", "text"),
}
MAX_EVENT_ID_CHARS: Final = 512


@dataclass(frozen=True, slots=True)
class NewItem:
    item_id: str | None
    role: Role
    text: str  # a message's text; a call output's `output`
    call_id: str | None = None  # set: a `function_call_output` item (tools.py)


@dataclass(frozen=True, slots=True)
class ItemCreate:
    event_id: str | None
    item: NewItem
    # None: append at the end; a given id must be the last item's (items only ever append).
    previous_item_id: str | None = None


@dataclass(frozen=True, slots=True)
class ItemReference:
    """An `input` entry naming a conversation item by id (`{"type": "item_reference", "id": ...}`)."""

    item_id: str


@dataclass(frozen=True, slots=True)
class OutOfBand:
    """`response.conversation: "none"` (issue #35, gateway/openai/out_of_band.py): the response
    adds nothing to the conversation. `input` None: over the conversation; else over exactly
    these items (messages of its own, or references to conversation items), after the
    session's instructions."""

    input: tuple[NewItem | ItemReference, ...] | None = None


@dataclass(frozen=True, slots=True)
class ResponseCreate:
    event_id: str | None
    max_output_tokens: int | None = None  # None: the session's
    metadata: Mapping[str, str] | None = None
    out_of_band: OutOfBand | None = None  # None: a response in the conversation
    tool_choice: ToolChoice | None = None  # None: the session's


@dataclass(frozen=True, slots=True)
class ResponseCancel:
    event_id: str | None
    response_id: str | None = None


@dataclass(frozen=True, slots=True)
class ItemDelete:
    event_id: str | None
    item_id: str


@dataclass(frozen=True, slots=True)
class ItemTruncate:
    event_id: str | None
    item_id: str


@dataclass(frozen=True, slots=True)
class ItemRetrieve:
    event_id: str | None
    item_id: str


ClientEvent: TypeAlias = (
    SessionUpdate | ItemCreate | ResponseCreate | ResponseCancel | ItemDelete | ItemTruncate | ItemRetrieve
)


def parse(data: str | bytes, *, max_output_tokens: int) -> ClientEvent:
    """One frame as a client event; raises `BadEvent` for anything malformed or unsupported."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise BadEvent("the frame is not a JSON object", None, code="invalid_json") from None
    if not isinstance(obj, dict):
        raise BadEvent("the frame is not a JSON object", None, code="invalid_json")
    event_id = obj.get("event_id")
    if event_id is not None and (not isinstance(event_id, str) or len(event_id) > MAX_EVENT_ID_CHARS):
        raise BadEvent(
            f"event_id must be a string of at most {MAX_EVENT_ID_CHARS} characters", None, param="event_id"
        )
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise BadEvent("missing event type", event_id, code="missing_required_parameter", param="type")
    r = _Reader(obj, event_id)
    if kind == "session.update":
        return _session_update(r, max_output_tokens)
    if kind == "conversation.item.create":
        return _item_create(r)
    if kind == "response.create":
        return _response_create(r, max_output_tokens)
    if kind == "response.cancel":
        return ResponseCancel(event_id, r.opt_str(obj, "response_id"))
    if kind == "conversation.item.delete":
        return ItemDelete(event_id, r.req_str(obj, "item_id"))
    if kind == "conversation.item.truncate":
        return ItemTruncate(event_id, r.req_str(obj, "item_id"))
    if kind == "conversation.item.retrieve":
        return ItemRetrieve(event_id, r.req_str(obj, "item_id"))
    if kind.startswith(("input_audio_buffer.", "output_audio_buffer.")):
        raise BadEvent(
            f"{kind}: this model takes no audio; send text items", event_id, code="audio_unsupported"
        )
    raise BadEvent(f"unknown event type {kind[:64]!r}", event_id, code="invalid_event_type", param="type")


class _Reader:
    """Typed field access that names the offending parameter (`session.max_output_tokens`)."""

    def __init__(self, obj: Mapping[str, object], event_id: str | None) -> None:
        self.obj = obj
        self.event_id = event_id

    def bad(self, message: str, param: str, code: str = "invalid_value") -> BadEvent:
        return BadEvent(message, self.event_id, code=code, param=param)

    def obj_at(self, where: Mapping[str, object], key: str, param: str) -> Mapping[str, object] | None:
        value = where.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.bad(f"{param} must be an object", param, "invalid_type")
        return value

    def opt_str(self, where: Mapping[str, object], key: str, param: str | None = None) -> str | None:
        value = where.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.bad(f"{param or key} must be a string", param or key, "invalid_type")
        return value

    def req_str(self, where: Mapping[str, object], key: str, param: str | None = None) -> str:
        value = self.opt_str(where, key, param)
        if value is None:
            raise self.bad(f"missing {param or key}", param or key, "missing_required_parameter")
        return value


def _session_update(r: _Reader, limit: int) -> SessionUpdate:
    session = r.obj_at(r.obj, "session", "session")
    if session is None:
        raise r.bad("missing session", "session", "missing_required_parameter")
    return parse_session_update(session, r.event_id, limit)


def _item_create(r: _Reader) -> ItemCreate:
    item = r.obj_at(r.obj, "item", "item")
    if item is None:
        raise r.bad("missing item", "item", "missing_required_parameter")
    previous = r.opt_str(r.obj, "previous_item_id")
    if item.get("type") == "function_call_output":
        return ItemCreate(r.event_id, _call_output(r, item), previous)
    return ItemCreate(r.event_id, _message(r, item, "item"), previous)


def _message(r: _Reader, item: Mapping[str, object], at: str) -> NewItem:
    """A message item (`conversation.item.create`'s, or one of an out-of-band response's `input`)."""
    kind = item.get("type", "message")
    if kind != "message":
        served = "message and function_call_output items are" if at == "item" else "message items are"
        raise r.bad(f"{at}.type {str(kind)[:64]!r}: only {served} served", f"{at}.type", "unsupported_value")
    role = item.get("role")
    if role not in ROLES:
        raise r.bad(f'{at}.role must be "user", "system" or "assistant"', f"{at}.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise r.bad(f"{at}.content must be a non-empty list of text parts", f"{at}.content")
    allowed = _TEXT_PARTS[str(role)]
    texts = []
    for index, part in enumerate(content):
        param = f"{at}.content[{index}]"
        if not isinstance(part, dict):
            raise r.bad(f"{param} must be an object", param, "invalid_type")
        if part.get("type") not in allowed:
            raise r.bad(
                f"{param}.type must be one of {list(allowed)} for a {role} message (text only)",
                f"{param}.type",
                "unsupported_value",
            )
        texts.append(r.req_str(part, "text", f"{param}.text"))
    return NewItem(_item_id(r, item, at), role, "".join(texts))


def _item_id(r: _Reader, item: Mapping[str, object], at: str) -> str | None:
    item_id = r.opt_str(item, "id", f"{at}.id")
    if item_id is not None and not 1 <= len(item_id) <= 64:
        raise r.bad(f"{at}.id must have 1 to 64 characters", f"{at}.id")
    return item_id


def _call_output(r: _Reader, item: Mapping[str, object]) -> NewItem:
    """A tool call's output, which the client ran (tools.py): joins as the call's answer."""
    unknown = set(item) - {"type", "id", "object", "status", "call_id", "output"}
    if unknown:
        name = sorted(unknown)[0][:64]
        raise r.bad(f"unknown function_call_output field {name!r}", "item", "unknown_parameter")
    call_id = r.req_str(item, "call_id", "item.call_id")
    output = r.req_str(item, "output", "item.output")
    return NewItem(_item_id(r, item, "item"), "user", output, call_id)


def _out_of_band(r: _Reader, response: Mapping[str, object]) -> OutOfBand | None:
    """`response.conversation` and `response.input`: None for a response in the conversation."""
    conversation = response.get("conversation", "auto")
    if conversation not in ("auto", "none"):
        raise r.bad('response.conversation must be "auto" or "none"', "response.conversation")
    given = response.get("input")
    if conversation == "auto":
        if given:
            raise r.bad(
                'response.input is served with response.conversation "none" (an out-of-band response)',
                "response.input",
                "unsupported_value",
            )
        return None
    if given is None:
        return OutOfBand()
    if not isinstance(given, list):
        raise r.bad("response.input must be a list of items", "response.input", "invalid_type")
    items: list[NewItem | ItemReference] = []
    for index, entry in enumerate(given):
        at = f"response.input[{index}]"
        if not isinstance(entry, dict):
            raise r.bad(f"{at} must be an object", at, "invalid_type")
        if entry.get("type") == "item_reference":
            items.append(ItemReference(r.req_str(entry, "id", f"{at}.id")))
        else:
            items.append(_message(r, entry, at))
    return OutOfBand(tuple(items))


def _response_create(r: _Reader, limit: int) -> ResponseCreate:
    response = r.obj_at(r.obj, "response", "response") or {}
    for key in ("tools", "instructions", "prompt", "audio"):
        if response.get(key):
            raise r.bad(
                f"response.{key}: not served; add items to the conversation",
                f"response.{key}",
                "unsupported_value",
            )
    out_of_band = _out_of_band(r, response)
    text_only(response, "response.output_modalities", r.event_id)
    has_max, max_tokens = read_max_output_tokens(response, "response.max_output_tokens", limit, r.event_id)
    metadata = r.obj_at(response, "metadata", "response.metadata")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise r.bad("response.metadata values must be strings", "response.metadata", "invalid_type")
    unknown = set(response) - {
        "input",
        "tools",
        "instructions",
        "prompt",
        "audio",
        "tool_choice",
        "conversation",
        "output_modalities",
        "max_output_tokens",
        "metadata",
    }
    if unknown:
        raise r.bad(f"unknown response field {sorted(unknown)[0][:64]!r}", "response", "unknown_parameter")
    wanted = (max_tokens if max_tokens is not None else limit) if has_max else None
    choice = response.get("tool_choice")
    tool_choice = None if choice is None else parse_tool_choice(choice, "response.tool_choice", r.event_id)
    return ResponseCreate(r.event_id, wanted, metadata, out_of_band, tool_choice)  # type: ignore[arg-type]
