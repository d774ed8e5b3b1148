"""The client events of the OpenAI Realtime API (GA names, as in openai-python's `types/realtime`),
parsed and validated into frozen dataclasses before anything acts on them.

Why strict here: the dialect promises "validate before mutating", so everything a client can get
wrong in one event is found while reading it and answered with an `error` naming the event. What a
text-only model cannot do (audio, tools, out-of-band responses) is refused here too, with a message
saying so, rather than silently ignored. Settings that change nothing for text (tracing, voice,
turn detection turned off) are accepted and left alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from gateway.openai.errors import RealtimeProblem

Role = Literal["user", "system", "assistant"]
ROLES: Final = ("user", "system", "assistant")
# The content part types a message of each role may carry (text only: this model takes no audio).
_TEXT_PARTS: Final[dict[str, tuple[str, ...]]] = {
    "user": ("input_text", "text"),
    "system": ("input_text", "text"),
    "assistant": ("output_text", "text"),
}
# session.update fields that mean nothing to a text session: accepted, kept out of the way.
_IGNORED_SESSION_FIELDS: Final = frozenset(
    {"type", "include", "tracing", "prompt", "truncation", "tool_choice", "parallel_tool_calls", "reasoning"}
)
MAX_EVENT_ID_CHARS: Final = 512


@dataclass(frozen=True, slots=True)
class SessionUpdate:
    event_id: str | None
    # Only the fields the event carried; `max_output_tokens` None means "inf".
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    model: str | None = None
    given: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class NewItem:
    item_id: str | None
    role: Role
    text: str


@dataclass(frozen=True, slots=True)
class ItemCreate:
    event_id: str | None
    item: NewItem
    # None: append at the end; a given id must be the last item's (items only ever append).
    previous_item_id: str | None = None


@dataclass(frozen=True, slots=True)
class ResponseCreate:
    event_id: str | None
    max_output_tokens: int | None = None  # None: the session's
    metadata: Mapping[str, str] | None = None


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


class BadEvent(RealtimeProblem):
    """A problem found while parsing, with whatever `event_id` could be read."""

    def __init__(
        self, message: str, event_id: str | None, *, code: str = "invalid_value", param: str | None = None
    ):
        super().__init__(message, code=code, param=param)
        self.event_id = event_id


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

    def max_tokens(self, where: Mapping[str, object], param: str, limit: int) -> tuple[bool, int | None]:
        """(given, value): `inf` gives None; an integer must be 1..limit."""
        if "max_output_tokens" not in where:
            return False, None
        value = where["max_output_tokens"]
        if value == "inf":
            return True, None
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise self.bad(f'{param} must be an integer from 1 to {limit}, or "inf"', param)
        return True, value

    def text_only(self, where: Mapping[str, object], param: str) -> None:
        modalities = where.get("output_modalities")
        if modalities is not None and modalities != ["text"]:
            raise self.bad(
                f'{param}: this model answers in text only: use ["text"]', param, "unsupported_value"
            )


def _session_update(r: _Reader, max_output_tokens: int) -> SessionUpdate:
    session = r.obj_at(r.obj, "session", "session")
    if session is None:
        raise r.bad("missing session", "session", "missing_required_parameter")
    kind = session.get("type", "realtime")
    if kind != "realtime":
        raise r.bad('session.type: only "realtime" sessions are served (no transcription)', "session.type")
    given: set[str] = set()
    instructions = r.opt_str(session, "instructions", "session.instructions")
    if "instructions" in session:
        given.add("instructions")
    r.text_only(session, "session.output_modalities")
    has_max, max_tokens = r.max_tokens(session, "session.max_output_tokens", max_output_tokens)
    if has_max:
        given.add("max_output_tokens")
    temperature = session.get("temperature")
    if temperature is not None:
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, int | float)
            or not 0 <= temperature <= 2
        ):
            raise r.bad("session.temperature must be a number from 0 to 2", "session.temperature")
        given.add("temperature")
    if session.get("tools"):
        raise r.bad("session.tools: this model calls no tools", "session.tools", "unsupported_value")
    audio = r.obj_at(session, "audio", "session.audio")
    if audio is not None and any(v for k, v in audio.items() if k != "input" or v):
        raise r.bad(
            "session.audio: this model takes and gives no audio", "session.audio", "unsupported_value"
        )
    model = r.opt_str(session, "model", "session.model")
    if model is not None:
        given.add("model")
    unknown = (
        set(session)
        - _IGNORED_SESSION_FIELDS
        - {
            "instructions",
            "output_modalities",
            "max_output_tokens",
            "temperature",
            "tools",
            "audio",
            "model",
        }
    )
    if unknown:
        raise r.bad(f"unknown session field {sorted(unknown)[0][:64]!r}", "session", "unknown_parameter")
    return SessionUpdate(
        r.event_id,
        instructions,
        max_tokens,
        None if temperature is None else float(temperature),
        model,
        frozenset(given),
    )


def _item_create(r: _Reader) -> ItemCreate:
    item = r.obj_at(r.obj, "item", "item")
    if item is None:
        raise r.bad("missing item", "item", "missing_required_parameter")
    kind = item.get("type", "message")
    if kind != "message":
        raise r.bad(
            f"item.type {str(kind)[:64]!r}: only message items are served", "item.type", "unsupported_value"
        )
    role = item.get("role")
    if role not in ROLES:
        raise r.bad('item.role must be "user", "system" or "assistant"', "item.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise r.bad("item.content must be a non-empty list of text parts", "item.content")
    allowed = _TEXT_PARTS[str(role)]
    texts = []
    for index, part in enumerate(content):
        param = f"item.content[{index}]"
        if not isinstance(part, dict):
            raise r.bad(f"{param} must be an object", param, "invalid_type")
        if part.get("type") not in allowed:
            raise r.bad(
                f"{param}.type must be one of {list(allowed)} for a {role} message (text only)",
                f"{param}.type",
                "unsupported_value",
            )
        texts.append(r.req_str(part, "text", f"{param}.text"))
    item_id = r.opt_str(item, "id", "item.id")
    if item_id is not None and not 1 <= len(item_id) <= 64:
        raise r.bad("item.id must have 1 to 64 characters", "item.id")
    previous = r.opt_str(r.obj, "previous_item_id")
    return ItemCreate(r.event_id, NewItem(item_id, role, "".join(texts)), previous)


def _response_create(r: _Reader, max_output_tokens: int) -> ResponseCreate:
    response = r.obj_at(r.obj, "response", "response") or {}
    for key in ("input", "tools", "instructions", "prompt", "audio", "tool_choice"):
        if response.get(key):
            raise r.bad(
                f"response.{key}: out-of-band responses are not served; add items to the conversation",
                f"response.{key}",
                "unsupported_value",
            )
    conversation = response.get("conversation", "auto")
    if conversation != "auto":
        raise r.bad(
            'response.conversation: only "auto" (the session\'s conversation)', "response.conversation"
        )
    r.text_only(response, "response.output_modalities")
    has_max, max_tokens = r.max_tokens(response, "response.max_output_tokens", max_output_tokens)
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
    limit = (max_tokens if max_tokens is not None else max_output_tokens) if has_max else None
    return ResponseCreate(r.event_id, limit, metadata)  # type: ignore[arg-type]
