"""`session.update`: every field of OpenAI's GA `RealtimeSessionCreateRequest`, parsed, and the ones
this model cannot act on kept to be echoed.

Why accept what cannot be used: OpenAI's own clients (the Agents SDKs above all) always send their
audio formats, transcription, turn detection and voice, even for a text-only session, and treat
every `error` as a failure. So a setting is refused only when it is *used*: `output_modalities`
asking for audio, an MCP tool (this server runs no MCP client; tools.py), and `input_audio_buffer.*`
events (client_events.py). Everything else a realtime session may carry is type-checked, kept, and
echoed back in `session.created` / `session.updated` as OpenAI echoes it.

Acted on: `type` (only "realtime"), `model` (must be the socket's), `instructions`,
`max_output_tokens`, `output_modalities` (["text"]), `tools` (function tools, tools.py; echoed
as parsed), `tool_choice` (also echoed), `truncation` (the session's context window,
truncation.py; also echoed) and `temperature` (a pre-GA field some clients still send). Echoed
only: the rest of `ECHOED_FIELDS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.openai.errors import BadEvent
from gateway.openai.tools import FunctionTool, ToolChoice, parse_tool_choice, parse_tools
from gateway.openai.truncation import AUTO, Truncation, parse_truncation

JSON = Any  # a value as json.loads gives it
# The GA session fields kept and echoed, with the JSON types each may have (null: back to unset).
ECHOED_FIELDS: Final[dict[str, tuple[type, ...]]] = {
    "audio": (dict,),
    "include": (list,),
    "prompt": (dict,),
    "tracing": (str, dict),
    "truncation": (str, dict),
    "tool_choice": (str, dict),
    "parallel_tool_calls": (bool,),
    "reasoning": (dict,),
}
ACTED_ON_FIELDS: Final = frozenset(
    {"type", "model", "instructions", "max_output_tokens", "output_modalities", "tools", "temperature"}
)
# `audio.input` and `audio.output` as the GA types define them: merged key by key by an update.
_AUDIO_FIELDS: Final[dict[str, dict[str, tuple[type, ...]]]] = {
    "input": {
        "format": (dict,),
        "noise_reduction": (dict,),
        "transcription": (dict,),
        "turn_detection": (dict,),
    },
    "output": {"format": (dict,), "voice": (str, dict), "speed": (int, float)},
}


@dataclass(frozen=True, slots=True)
class SessionUpdate:
    event_id: str | None
    # Only the fields the event carried (`given`); `max_output_tokens` None means "inf".
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    model: str | None = None
    given: frozenset[str] = frozenset()
    # The echoed fields the event carried, as sent (validated types).
    echoed: Mapping[str, JSON] = field(default_factory=dict)
    # The context window `truncation` asks for (when given: "truncation" in `echoed`).
    truncation: Truncation = AUTO
    # The function tools (None: not given; null or [] gives none) and the tool choice (None: not
    # given; also in `echoed`, as sent).
    tools: tuple[FunctionTool, ...] | None = None
    tool_choice: ToolChoice | None = None


def _bad(message: str, event_id: str | None, param: str, code: str = "invalid_value") -> BadEvent:
    return BadEvent(message, event_id, code=code, param=param)


def _type_name(types: tuple[type, ...]) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number"}
    return " or ".join(dict.fromkeys(names.get(t, "a number") for t in types))


def _check_type(value: JSON, types: tuple[type, ...], param: str, event_id: str | None) -> None:
    if value is None:
        return
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        raise _bad(f"{param} must be {_type_name(types)}", event_id, param, "invalid_type")


def _audio(value: JSON, event_id: str | None) -> None:
    if value is None:
        return
    for part, sub in value.items():
        param = f"session.audio.{part}"
        if part not in _AUDIO_FIELDS:
            raise _bad(f"unknown session field 'audio.{part[:64]}'", event_id, param, "unknown_parameter")
        _check_type(sub, (dict,), param, event_id)
        for key, inner in (sub or {}).items():
            if key not in _AUDIO_FIELDS[part]:
                raise _bad(
                    f"unknown session field 'audio.{part}.{key[:64]}'", event_id, param, "unknown_parameter"
                )
            _check_type(inner, _AUDIO_FIELDS[part][key], f"{param}.{key}", event_id)


def parse_echoed(session: Mapping[str, JSON], event_id: str | None) -> dict[str, JSON]:
    """The echoed-only fields `session` carries, type-checked; raises on an unknown field."""
    unknown = set(session) - set(ECHOED_FIELDS) - ACTED_ON_FIELDS
    if unknown:
        name = sorted(unknown)[0][:64]
        raise _bad(f"unknown session field {name!r}", event_id, "session", "unknown_parameter")
    echoed = {}
    for name, types in ECHOED_FIELDS.items():
        if name in session:
            _check_type(session[name], types, f"session.{name}", event_id)
            if name == "audio":
                _audio(session[name], event_id)
            echoed[name] = session[name]
    return echoed


def merge_echoed(kept: Mapping[str, JSON], update: Mapping[str, JSON]) -> dict[str, JSON]:
    """`kept` with `update` applied as OpenAI applies a partial update: a field given replaces the
    one kept (null unsets it), and `audio.input` / `audio.output` are merged key by key."""
    merged = dict(kept)
    for name, value in update.items():
        if name == "audio" and isinstance(value, dict):
            audio = {part: dict(sub) for part, sub in (merged.get("audio") or {}).items() if sub is not None}
            for part, sub in value.items():
                if sub is None:
                    audio.pop(part, None)
                else:
                    audio[part] = {**audio.get(part, {}), **sub}
            merged["audio"] = audio
        elif value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return merged


def read_max_output_tokens(
    where: Mapping[str, JSON], param: str, limit: int, event_id: str | None
) -> tuple[bool, int | None]:
    """(given, value) of a `max_output_tokens` field: "inf" gives None; an integer must be 1..limit."""
    if "max_output_tokens" not in where:
        return False, None
    value = where["max_output_tokens"]
    if value == "inf":
        return True, None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise _bad(f'{param} must be an integer from 1 to {limit}, or "inf"', event_id, param)
    return True, value


def text_only(where: Mapping[str, JSON], param: str, event_id: str | None) -> None:
    """`output_modalities` may only ask for text: asking for audio is using what the model lacks."""
    modalities = where.get("output_modalities")
    if modalities is not None and modalities != ["text"]:
        raise _bad(
            f'{param}: this model answers in text only: use ["text"]', event_id, param, "unsupported_value"
        )


def parse_session_update(session: Mapping[str, JSON], event_id: str | None, limit: int) -> SessionUpdate:
    """The `session` of a `session.update` (or of a client secret's request)."""
    if session.get("type", "realtime") != "realtime":
        raise _bad(
            'session.type: only "realtime" sessions are served (no transcription)', event_id, "session.type"
        )
    echoed = parse_echoed(session, event_id)
    given: set[str] = set()
    instructions = session.get("instructions")
    if "instructions" in session:
        _check_type(instructions, (str,), "session.instructions", event_id)
        given.add("instructions")
    text_only(session, "session.output_modalities", event_id)
    has_max, max_tokens = read_max_output_tokens(session, "session.max_output_tokens", limit, event_id)
    if has_max:
        given.add("max_output_tokens")
    temperature = session.get("temperature")
    if temperature is not None:
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, int | float)
            or not 0 <= temperature <= 2
        ):
            raise _bad("session.temperature must be a number from 0 to 2", event_id, "session.temperature")
        given.add("temperature")
    tools = None
    if "tools" in session:
        raw_tools = session["tools"]
        tools = () if raw_tools is None else parse_tools(raw_tools, "session.tools", event_id)
        echoed["tools"] = [tool.as_dict() for tool in tools]
    choice = session.get("tool_choice")
    tool_choice = None if choice is None else parse_tool_choice(choice, "session.tool_choice", event_id)
    truncation = parse_truncation(session.get("truncation"), event_id)
    model = session.get("model")
    _check_type(model, (str,), "session.model", event_id)
    if model is not None:
        given.add("model")
    return SessionUpdate(
        event_id,
        instructions,
        max_tokens,
        None if temperature is None else float(temperature),
        model,
        frozenset(given),
        echoed,
        truncation,
        tools,
        tool_choice,
    )
