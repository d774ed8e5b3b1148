"""Bytes <-> messages for client protocol v1, in JSON or msgpack, with strict validation.

Why so strict: this is the only place where untrusted input becomes typed values. Everything past
the codec (gateway limits, the worker link, the engine) may rely on the types being exact: an int
is an `int` (never a bool, never a float), a string is a `str` of valid Unicode, token lists hold
non-negative ints that fit the uint32 token log, numbers are finite, and a map carries no key the
protocol does not define (a typo such as `max_output_token` fails loudly instead of being ignored).
Every failure raises `InvalidMessage` naming the message and the field, or `UnknownType` (or
`TokenOutOfRange` for a token id outside [0, 2**32)); nothing is mutated on the way. Optional
fields may be absent or null; the encoders leave `None` out.

Lone surrogates: JSON's `"\ud800"` escape decodes to a Python str that no UTF-8 encoder accepts
(msgpack, Redis, websockets' text frames, our own replies). Every string read here (values, map
keys, anything nested in a ping's `data`) is checked, so none gets past the codec; msgpack strings
are decoded with `surrogateescape`, so invalid UTF-8 there is refused the same way, naming the field.

No I/O here (websockets' Sans-I/O core is the model): callers hand in the frame they received and
get back a message, or hand in a message and get back the frame to send. The frame-size limit is
the caller's, checked before decoding (the gateway's `max_frame_bytes`, gateway/limits.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from enum import Enum
from typing import TypeVar, cast

import msgpack

from shared.errors import InvalidMessage, UnknownType
from shared.protocol.fields import MAX_TOKEN_ID, FieldReader, show
from shared.protocol.link_codec import check_one_input, to_wire
from shared.protocol.messages import (
    CLOSE_REASONS,
    CONTEXT_POLICIES,
    EXPIRY_REASONS,
    FINISH_REASONS,
    ClientMessage,
    CloseReason,
    ContextPolicy,
    Error,
    ExpiryReason,
    FinishReason,
    InputChunk,
    OpenConfig,
    OutputCancel,
    OutputDelta,
    OutputDone,
    Ping,
    Pong,
    ServerMessage,
    SessionClose,
    SessionClosed,
    SessionExpiring,
    SessionOpen,
    SessionOpened,
    SessionRestored,
    SessionResume,
    SessionResumed,
    SessionRewind,
    SessionRewound,
    Timing,
)
from shared.protocol.response_format import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_PATTERN_CHARS,
    MAX_SCHEMA_BYTES,
    RESPONSE_FORMAT_TYPES,
    ResponseFormat,
    ResponseFormatType,
    schema_bytes,
)

MAX_SEED = 2**64 - 1
_T = TypeVar("_T")
_M = TypeVar("_M")


class Encoding(Enum):
    """The two wire encodings; the value is the WebSocket subprotocol that selects it."""

    JSON = "microturn.v1.json"
    MSGPACK = "microturn.v1.msgpack"

    @property
    def subprotocol(self) -> str:
        return self.value


def choose_encoding(offered: Iterable[str]) -> Encoding | None:
    """The encoding for a client offering these subprotocols, in its order of preference.

    No subprotocol at all means JSON (and the server then echoes none); offers that name only
    unknown subprotocols get None: refuse the handshake. Otherwise the server echoes
    `encoding.subprotocol`.
    """
    names = [name.strip() for name in offered if name.strip()]
    if not names:
        return Encoding.JSON
    known = {e.value: e for e in Encoding}
    for name in names:
        if name in known:
            return known[name]
    return None


# ---- config -------------------------------------------------------------------------------------


def _config_from_reader(r: FieldReader) -> OpenConfig:
    """Read an `OpenConfig` off `r` (absent and null fields take their defaults) and finish `r`."""
    default = OpenConfig()
    policy = r.opt_choice("context_policy", CONTEXT_POLICIES)
    config = OpenConfig(
        max_output_tokens=_or(r.opt_integer("max_output_tokens"), default.max_output_tokens),
        temperature=_or(r.opt_number("temperature"), default.temperature),
        top_p=r.opt_number("top_p", 0.0, 1.0, lo_open=True),
        top_k=r.opt_integer("top_k", 1),
        seed=r.opt_integer("seed", 0, MAX_SEED),
        stop_token_ids=r.token_ids("stop_token_ids"),
        logprobs=_or(r.opt_boolean("logprobs"), default.logprobs),
        idle_timeout_s=r.opt_number("idle_timeout_s", 0.0, lo_open=True),
        max_context_tokens=r.opt_integer("max_context_tokens", 1),
        context_policy=default.context_policy if policy is None else cast(ContextPolicy, policy),
        keep_prefix_tokens=_or(r.opt_integer("keep_prefix_tokens"), default.keep_prefix_tokens),
        retention_ratio=_or(r.opt_number("retention_ratio", 0.0, 1.0, lo_open=True), default.retention_ratio),
        stream=_or(r.opt_boolean("stream"), default.stream),
        model=r.opt_string("model"),
        keep_prefix_text=r.opt_string("keep_prefix_text"),
        response_format=_response_format(r.submap("response_format", required=False)),
    )
    r.done()
    if config.keep_prefix_text is not None and config.keep_prefix_tokens:
        raise InvalidMessage("give keep_prefix_text or keep_prefix_tokens, not both")
    return config


def _response_format(r: FieldReader | None) -> ResponseFormat | None:
    """Read a `response_format` map (None: absent) and finish `r`; the bounds are in
    shared/protocol/response_format.py. Exactly the field of its `type` may be given."""
    if r is None:
        return None
    kind = cast(ResponseFormatType, r.choice("type", RESPONSE_FORMAT_TYPES))
    fmt: ResponseFormat
    if kind == "json_schema":
        schema = r.value("schema")
        if type(schema) is not dict:
            raise InvalidMessage(f"response_format: field 'schema' must be a map, got {show(schema)}")
        size = schema_bytes(schema)
        if size > MAX_SCHEMA_BYTES:
            raise InvalidMessage(f"response_format: schema of {size} bytes exceeds {MAX_SCHEMA_BYTES}")
        fmt = ResponseFormat(kind, schema=schema)
    elif kind == "structural_tag":
        tag = r.value("tag")
        if type(tag) is not dict or tag.get("type") != "structural_tag":
            raise InvalidMessage(
                f"response_format: field 'tag' must be a map with type 'structural_tag', got {show(tag)}"
            )
        size = schema_bytes(tag)
        if size > MAX_SCHEMA_BYTES:
            raise InvalidMessage(f"response_format: tag of {size} bytes exceeds {MAX_SCHEMA_BYTES}")
        fmt = ResponseFormat(kind, tag=tag)
    elif kind == "regex":
        pattern = r.string("pattern", nonempty=True)
        if len(pattern) > MAX_PATTERN_CHARS:
            raise InvalidMessage(f"response_format: pattern exceeds {MAX_PATTERN_CHARS} characters")
        fmt = ResponseFormat(kind, pattern=pattern)
    else:
        choices = r.raw("choices")
        if not isinstance(choices, list | tuple) or not 0 < len(choices) <= MAX_CHOICES:
            raise InvalidMessage(
                f"response_format: field 'choices' must be a list of 1 to {MAX_CHOICES} strings, "
                f"got {show(choices)}"
            )
        for item in choices:
            if type(item) is not str or not 0 < len(item) <= MAX_CHOICE_CHARS:
                raise InvalidMessage(
                    f"response_format: each choice must be a string of 1 to {MAX_CHOICE_CHARS} "
                    f"characters, got {show(item)}"
                )
        r.value("choices")  # valid Unicode
        fmt = ResponseFormat(kind, choices=tuple(choices))
    r.done()
    return fmt


def response_format_from_map(obj: object, where: str = "response_format") -> ResponseFormat:
    """Validate a `response_format` map by the client protocol's rules (one given by hand to the
    engine enters here too)."""
    fmt = _response_format(FieldReader(obj, where))
    assert fmt is not None
    return fmt


def config_from_map(obj: object, where: str = "config") -> OpenConfig:
    """Validate a `session.open` config map; also the one check of a config that enters any other
    way: read back from the session record in Redis, or given by hand to `Engine.open_session`."""
    return _config_from_reader(FieldReader(obj, where))


def config_to_map(config: OpenConfig) -> dict[str, object]:
    """The wire map of a config; `None` fields are left out."""
    return to_wire(config)


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value


# ---- parsing frames -----------------------------------------------------------------------------


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in object")
    return out


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(data: str) -> object:
    try:
        return json.loads(data, object_pairs_hook=_unique_keys, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise InvalidMessage(f"malformed JSON: {e}") from e


def parse_msgpack(data: bytes | bytearray | memoryview) -> object:
    try:
        # surrogateescape: invalid UTF-8 becomes lone surrogates, refused by the field that holds them.
        obj: object = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, unicode_errors="surrogateescape"
        )
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise InvalidMessage(f"malformed msgpack: {str(e) or type(e).__name__}") from e
    return obj


def _parse(data: str | bytes | bytearray | memoryview, encoding: Encoding) -> object:
    if encoding is Encoding.JSON:
        if not isinstance(data, str):
            raise InvalidMessage(f"binary frame on a {encoding.value} session: send text frames")
        return parse_json(data)
    if isinstance(data, str):
        raise InvalidMessage(f"text frame on a {encoding.value} session: send binary frames")
    return parse_msgpack(data)


def _decode(obj: object, decoders: dict[str, Callable[[FieldReader], _M]]) -> _M:
    head = FieldReader(obj, "message")
    if not head.has("type"):
        raise InvalidMessage("missing field 'type'")
    kind = head.raw("type")
    if type(kind) is not str:
        raise InvalidMessage(f"field 'type' must be a string, got {show(kind)}")
    decode = decoders.get(kind)
    if decode is None:
        raise UnknownType(f"unknown message type {show(kind)}")
    r = FieldReader(obj, kind, seen=("type",), checked=True)
    message = decode(r)
    r.done()
    return message


# ---- client -> server ---------------------------------------------------------------------------


def _session_open(r: FieldReader) -> SessionOpen:
    sub = r.submap("config", required=False)
    return SessionOpen(OpenConfig() if sub is None else _config_from_reader(sub))


def _input_chunk(r: FieldReader) -> InputChunk:
    seq, tokens, text = r.integer("seq"), r.token_ids("tokens"), r.opt_string("text")
    check_one_input(tokens, text, "input.chunk")
    return InputChunk(
        seq,
        tokens,
        text,
        r.opt_integer("max_output_tokens"),
        r.opt_boolean("logprobs"),
        r.opt_boolean("flush"),
        _response_format(r.submap("response_format", required=False)),
    )


def _session_rewind(r: FieldReader) -> SessionRewind:
    to_seq, keep_tokens = r.opt_integer("to_seq"), r.opt_integer("keep_tokens", 0)
    if (to_seq is None) == (keep_tokens is None):
        raise InvalidMessage("session.rewind: give exactly one of to_seq and keep_tokens")
    return SessionRewind(to_seq, keep_tokens)


_CLIENT: dict[str, Callable[[FieldReader], ClientMessage]] = {
    SessionOpen.type: _session_open,
    SessionResume.type: lambda r: SessionResume(
        r.string("session_id", nonempty=True),
        r.string("resume_token", nonempty=True),
        r.opt_integer("last_seq"),
    ),
    InputChunk.type: _input_chunk,
    OutputCancel.type: lambda r: OutputCancel(r.integer("seq"), r.opt_integer("keep_output_tokens", 0)),
    SessionRewind.type: _session_rewind,
    SessionClose.type: lambda r: SessionClose(),
    Ping.type: lambda r: Ping(r.value("data")),
}


def decode_client(data: str | bytes | bytearray | memoryview, encoding: Encoding) -> ClientMessage:
    """Parse and validate one client frame; raises `InvalidMessage` or `UnknownType`."""
    return _decode(_parse(data, encoding), _CLIENT)


# ---- server -> client ---------------------------------------------------------------------------


def _session_opened(r: FieldReader) -> SessionOpened:
    session_id, token, model = (
        r.string("session_id", nonempty=True),
        r.string("resume_token"),
        r.string("model"),
    )
    limits = r.submap("limits", required=False)
    return SessionOpened(session_id, token, model, {} if limits is None else limits.number_values())


def _output_done(r: FieldReader) -> OutputDone:
    seq, tokens, text = r.integer("seq"), r.integers("tokens"), r.opt_string("text")
    finish = cast(FinishReason, r.choice("finish", FINISH_REASONS))
    t = r.submap("timing")
    assert t is not None
    timing = Timing(t.number("queue_ms"), t.number("compute_ms"))
    t.done()
    logprobs = r.opt_numbers("logprobs")
    if logprobs is not None and len(logprobs) != len(tokens):
        raise InvalidMessage(f"output.done: {len(logprobs)} logprobs for {len(tokens)} tokens")
    return OutputDone(seq, tokens, text, finish, timing, logprobs, r.opt_integer("committed_tokens"))


_SERVER: dict[str, Callable[[FieldReader], ServerMessage]] = {
    SessionOpened.type: _session_opened,
    SessionResumed.type: lambda r: SessionResumed(
        r.string("session_id", nonempty=True), r.integer("length"), r.opt_integer("last_seq")
    ),
    SessionRestored.type: lambda r: SessionRestored(
        r.string("session_id", nonempty=True), r.integer("length")
    ),
    OutputDelta.type: lambda r: OutputDelta(
        r.integer("seq"),
        r.integer("index"),
        r.integer("token", 0, MAX_TOKEN_ID),
        r.opt_string("text"),
        r.opt_number("logprob", -math.inf),
    ),
    OutputDone.type: _output_done,
    SessionRewound.type: lambda r: SessionRewound(r.integer("length", 0)),
    SessionClosed.type: lambda r: SessionClosed(cast(CloseReason, r.choice("reason", CLOSE_REASONS))),
    SessionExpiring.type: lambda r: SessionExpiring(
        r.string("session_id", nonempty=True),
        cast(ExpiryReason, r.choice("reason", EXPIRY_REASONS)),
        r.opt_integer("expires_in_ms"),
        r.opt_integer("tokens_left"),
    ),
    Error.type: lambda r: Error(
        r.error_code("code"),
        r.string("message"),
        r.boolean("fatal"),
        r.opt_integer("seq"),
        r.opt_integer("retry_after_ms"),
    ),
    Pong.type: lambda r: Pong(r.value("data")),
}


def decode_server(data: str | bytes | bytearray | memoryview, encoding: Encoding) -> ServerMessage:
    """Parse and validate one server frame (the Python client's side)."""
    return _decode(_parse(data, encoding), _SERVER)


# ---- encoding -----------------------------------------------------------------------------------

_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _dump(obj: dict[str, object], encoding: Encoding) -> str | bytes:
    if encoding is Encoding.JSON:
        return _JSON.encode(obj)
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def encode_server(message: ServerMessage, encoding: Encoding) -> str | bytes:
    """The frame for one server message: `str` (a text frame) for JSON, `bytes` for msgpack.

    Floats must be finite (JSON has no NaN or infinity): a non-finite one raises ValueError.
    """
    return _dump(to_wire(message, {"type": message.type}), encoding)


def encode_client(message: ClientMessage, encoding: Encoding) -> str | bytes:
    """The frame for one client message (the Python client's side); see `encode_server`."""
    return _dump(to_wire(message, {"type": message.type}), encoding)
