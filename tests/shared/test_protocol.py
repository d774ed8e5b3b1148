"""Client protocol v1: round trips, strict validation, subprotocol negotiation, close codes."""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import pytest

from shared.errors import (
    CapacityExhausted,
    ErrorCode,
    InternalError,
    InvalidMessage,
    MicroturnError,
    RateLimited,
    SessionNotFound,
    TokenOutOfRange,
    UnknownType,
)
from shared.protocol.close_codes import CLOSE_CODES, close_code_for, error_code_for_close, error_message_from
from shared.protocol.codec import (
    Encoding,
    choose_encoding,
    config_from_map,
    config_to_map,
    decode_client,
    decode_server,
    encode_client,
    encode_server,
)
from shared.protocol.messages import (
    ClientMessage,
    Error,
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
    SessionOpen,
    SessionOpened,
    SessionRestored,
    SessionResume,
    SessionResumed,
    SessionRewind,
    SessionRewound,
    Timing,
)
from shared.protocol.response_format import ResponseFormat

FULL_CONFIG = OpenConfig(
    max_output_tokens=8,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    seed=2**63,
    stop_token_ids=(2, 7),
    logprobs=True,
    idle_timeout_s=30.5,
    max_context_tokens=4096,
    context_policy="truncate",
    keep_prefix_tokens=12,
    stream=True,
)

CLIENT_MESSAGES: list[ClientMessage] = [
    SessionOpen(),
    SessionOpen(FULL_CONFIG),
    SessionOpen(OpenConfig(stop_token_ids=())),
    SessionResume("s-1", "tok", 41),
    SessionResume("s-1", "tok"),
    InputChunk(0, tokens=(1, 2, 3)),
    InputChunk(7, tokens=(), max_output_tokens=0, logprobs=False),
    InputChunk(2**53 - 1, tokens=(2**32 - 1,), max_output_tokens=16, logprobs=True),
    InputChunk(3, text="héllo, 世界 \n"),
    InputChunk(4, text=""),
    InputChunk(
        5, text="a", response_format=ResponseFormat("json_schema", schema={"type": "object", "x": [1.5]})
    ),
    InputChunk(6, tokens=(1,), response_format=ResponseFormat("regex", pattern="[0-9]+")),
    InputChunk(7, tokens=(1,), response_format=ResponseFormat("choice", choices=("yes", "no"))),
    InputChunk(
        8,
        tokens=(1,),
        response_format=ResponseFormat(
            "structural_tag",
            tag={"type": "structural_tag", "format": {"type": "const_string", "value": "<a>"}},
        ),
    ),
    SessionOpen(OpenConfig(response_format=ResponseFormat("choice", choices=("a",)))),
    OutputCancel(9),
    OutputCancel(9, keep_output_tokens=0),
    SessionRewind(to_seq=4),
    SessionRewind(keep_tokens=0),
    SessionClose(),
    Ping(),
    Ping({"t": 1.5, "nested": [1, "x", None, True]}),
    Ping("just a string"),
]

SERVER_MESSAGES: list[ServerMessage] = [
    SessionOpened("s-1", "secret", "smollm2-135m", {"max_frame_bytes": 1 << 20, "chunks_per_s": 12.5}),
    SessionOpened("s-1", "secret", "tiny"),
    SessionResumed("s-1", 1200, 40),
    SessionResumed("s-1", 0),
    SessionRestored("s-1", 1200),
    OutputDelta(3, 0, 42, "Hi", -0.25),
    OutputDelta(3, 1, 43),
    OutputDone(3, (42, 43), "Hi there", "length", Timing(0.5, 12.25), (-0.25, -1.0)),
    OutputDone(4, (), None, "cancelled", Timing(0.0, 0.0)),
    OutputDone(5, (2,), "", "stop", Timing(1.0, 2.0)),
    SessionClosed("idle_timeout"),
    SessionClosed("taken_over"),
    Error(ErrorCode.RATE_LIMITED, "slow down", False, 12, 250),
    Error(ErrorCode.SESSION_NOT_FOUND, "no such session", True),
    Pong(),
    Pong({"t": 1.5}),
    SessionRewound(37),
]


def _json(frame: str | bytes) -> Any:
    assert isinstance(frame, str)
    return json.loads(frame)


# ---- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("message", CLIENT_MESSAGES, ids=repr)
def test_client_messages_round_trip(message: ClientMessage, encoding: Encoding) -> None:
    frame = encode_client(message, encoding)
    assert isinstance(frame, str if encoding is Encoding.JSON else bytes)
    assert decode_client(frame, encoding) == message


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("message", SERVER_MESSAGES, ids=repr)
def test_server_messages_round_trip(message: ServerMessage, encoding: Encoding) -> None:
    frame = encode_server(message, encoding)
    assert isinstance(frame, str if encoding is Encoding.JSON else bytes)
    assert decode_server(frame, encoding) == message


def test_wire_shape_matches_design() -> None:
    done = _json(encode_server(SERVER_MESSAGES[7], Encoding.JSON))
    assert done == {
        "type": "output.done",
        "seq": 3,
        "tokens": [42, 43],
        "text": "Hi there",
        "finish": "length",
        "timing": {"queue_ms": 0.5, "compute_ms": 12.25},
        "logprobs": [-0.25, -1.0],
    }
    error = _json(encode_server(Error(ErrorCode.BACKPRESSURE, "full", False), Encoding.JSON))
    assert error == {"type": "error", "code": "backpressure", "message": "full", "fatal": False}
    chunk = msgpack.unpackb(encode_client(InputChunk(1, text="a"), Encoding.MSGPACK))
    assert chunk == {"type": "input.chunk", "seq": 1, "text": "a"}


def test_every_message_type_has_a_distinct_wire_name() -> None:
    names = [type(m).type for m in CLIENT_MESSAGES + SERVER_MESSAGES]
    assert len(set(names)) == 16


def test_missing_or_null_config_fields_take_defaults() -> None:
    assert decode_client('{"type": "session.open"}', Encoding.JSON) == SessionOpen(OpenConfig())
    nulls = {f: None for f in config_to_map(FULL_CONFIG)}
    frame = json.dumps({"type": "session.open", "config": nulls})
    assert decode_client(frame, Encoding.JSON) == SessionOpen(OpenConfig())
    # An int where a float is allowed is accepted and becomes a float.
    cfg = decode_client('{"type":"session.open","config":{"temperature":1}}', Encoding.JSON)
    assert isinstance(cfg, SessionOpen)
    assert cfg.config.temperature == 1.0
    assert type(cfg.config.temperature) is float


# ---- validation: JSON ---------------------------------------------------------------------------

_CHUNK = '{"type": "input.chunk", "seq": 1, "tokens": [1], "response_format": '
JSON_FAILURES: list[tuple[str, type[MicroturnError], str]] = [
    (_CHUNK + '{"type": "grammar"}}', InvalidMessage, "field 'type' must be one of json_schema"),
    (_CHUNK + '{"type": "json_schema"}}', InvalidMessage, "field 'schema' must be a map"),
    (_CHUNK + '{"type": "json_schema", "schema": [1]}}', InvalidMessage, "field 'schema' must be a map"),
    (_CHUNK + '{"type": "regex", "pattern": ""}}', InvalidMessage, "non-empty string"),
    (_CHUNK + '{"type": "regex", "pattern": "a", "choices": ["a"]}}', InvalidMessage, "unknown field"),
    (_CHUNK + '{"type": "regex", "pattern": "%s"}}' % ("a" * 1025), InvalidMessage, "exceeds 1024"),
    (_CHUNK + '{"type": "choice", "choices": []}}', InvalidMessage, "list of 1 to 256"),
    (_CHUNK + '{"type": "choice", "choices": ["a", 1]}}', InvalidMessage, "each choice"),
    (_CHUNK + '{"type": "choice", "choices": [""]}}', InvalidMessage, "each choice"),
    (_CHUNK + '{"type": "choice", "choices": ["\\ud800"]}}', InvalidMessage, "Unicode"),
    (_CHUNK + '"json"}', InvalidMessage, "must be a map"),
    (_CHUNK + '{"type": "structural_tag"}}', InvalidMessage, "field 'tag' must be a map"),
    (_CHUNK + '{"type": "structural_tag", "tag": {"format": {}}}}', InvalidMessage, "type 'structural_tag'"),
    (
        _CHUNK + '{"type": "structural_tag", "tag": {"type": "structural_tag", "d": "%s"}}}' % ("x" * 16384),
        InvalidMessage,
        "tag of",
    ),
    (
        '{"type": "session.open", "config": {"response_format": '
        '{"type": "json_schema", "schema": {"d": "%s"}}}}' % ("x" * 16384),
        InvalidMessage,
        "exceeds 16384",
    ),
    ("{", InvalidMessage, "malformed JSON"),
    ("", InvalidMessage, "malformed JSON"),
    ('{"type": "ping"} x', InvalidMessage, "malformed JSON"),
    ('{"type": "ping", "data": NaN}', InvalidMessage, "NaN"),
    ('{"type": "ping", "type": "ping"}', InvalidMessage, "duplicate"),
    ("[1, 2]", InvalidMessage, "map"),
    ("42", InvalidMessage, "map"),
    ('"session.open"', InvalidMessage, "map"),
    ("null", InvalidMessage, "map"),
    ("{}", InvalidMessage, "missing field 'type'"),
    ('{"seq": 1, "tokens": [1]}', InvalidMessage, "missing field 'type'"),
    ('{"type": 5}', InvalidMessage, "'type'"),
    ('{"type": null}', InvalidMessage, "'type'"),
    ('{"type": "input.chunks", "seq": 1}', UnknownType, "input.chunks"),
    ('{"type": "pong"}', UnknownType, "pong"),  # a server message sent by a client
    ('{"type": "input.chunk", "tokens": [1]}', InvalidMessage, "missing field 'seq'"),
    ('{"type": "input.chunk", "seq": true, "tokens": [1]}', InvalidMessage, "'seq'"),
    ('{"type": "input.chunk", "seq": 1.0, "tokens": [1]}', InvalidMessage, "'seq'"),
    ('{"type": "input.chunk", "seq": "1", "tokens": [1]}', InvalidMessage, "'seq'"),
    ('{"type": "input.chunk", "seq": -1, "tokens": [1]}', InvalidMessage, "'seq'"),
    ('{"type": "input.chunk", "seq": 9007199254740992, "tokens": [1]}', InvalidMessage, "'seq'"),
    ('{"type": "input.chunk", "seq": 1, "tokens": "1 2"}', InvalidMessage, "'tokens'"),
    ('{"type": "input.chunk", "seq": 1, "tokens": [1, true]}', InvalidMessage, "'tokens'"),
    ('{"type": "input.chunk", "seq": 1, "tokens": [1, 2.0]}', InvalidMessage, "'tokens'"),
    # A token id that cannot be one is out of range, negative or past 2**32 alike (issue 8).
    ('{"type": "input.chunk", "seq": 1, "tokens": [1, -3]}', TokenOutOfRange, "'tokens'"),
    ('{"type": "input.chunk", "seq": 1, "tokens": [4294967296]}', TokenOutOfRange, "'tokens'"),
    ('{"type": "input.chunk", "seq": 1, "tokens": [1e400]}', InvalidMessage, "'tokens'"),
    # Lone surrogates (JSON escapes) are refused where they are read, naming the field.
    ('{"type": "input.chunk", "seq": 1, "text": "a\\ud800b"}', InvalidMessage, "'text'"),
    (
        '{"type": "session.resume", "session_id": "\\udfff", "resume_token": "t"}',
        InvalidMessage,
        "'session_id'",
    ),
    (
        '{"type": "session.resume", "session_id": "s", "resume_token": "\\ud800"}',
        InvalidMessage,
        "'resume_token'",
    ),
    ('{"type": "ping", "data": {"k": ["x", "\\ud83d"]}}', InvalidMessage, "'data'"),
    ('{"type": "ping", "data": {"\\ud800": 1}}', InvalidMessage, "'data'"),
    ('{"type": "ping", "data": 1e999}', InvalidMessage, "'data'"),
    ('{"type": "ping", "\\ud800": 1}', InvalidMessage, "'\\ud800'"),
    ('{"type": "\\ud800"}', UnknownType, "unknown message type"),
    ('{"type": "session.open", "config": {"\\udc80x": 1}}', InvalidMessage, "not valid Unicode"),
    ('{"type": "input.chunk", "seq": 1, "tokens": {"0": 1}}', InvalidMessage, "'tokens'"),
    ('{"type": "input.chunk", "seq": 1, "text": 5}', InvalidMessage, "'text'"),
    ('{"type": "input.chunk", "seq": 1, "text": ["a"]}', InvalidMessage, "'text'"),
    ('{"type": "input.chunk", "seq": 1}', InvalidMessage, "exactly one"),
    ('{"type": "input.chunk", "seq": 1, "tokens": [1], "text": "a"}', InvalidMessage, "exactly one"),
    (
        '{"type": "input.chunk", "seq": 1, "text": "a", "max_output_tokens": true}',
        InvalidMessage,
        "max_output",
    ),
    ('{"type": "input.chunk", "seq": 1, "text": "a", "max_output_tokens": -1}', InvalidMessage, "max_output"),
    ('{"type": "input.chunk", "seq": 1, "text": "a", "logprobs": 1}', InvalidMessage, "'logprobs'"),
    ('{"type": "input.chunk", "seq": 1, "text": "a", "sequence": 2}', InvalidMessage, "sequence"),
    ('{"type": "output.cancel"}', InvalidMessage, "'seq'"),
    ('{"type": "output.cancel", "seq": false}', InvalidMessage, "'seq'"),
    ('{"type": "output.cancel", "seq": 1, "keep_output_tokens": -1}', InvalidMessage, "keep_output"),
    ('{"type": "session.rewind"}', InvalidMessage, "exactly one"),
    ('{"type": "session.rewind", "to_seq": 1, "keep_tokens": 2}', InvalidMessage, "exactly one"),
    ('{"type": "session.rewind", "keep_tokens": -2}', InvalidMessage, "keep_tokens"),
    ('{"type": "session.close", "reason": "bye"}', InvalidMessage, "reason"),
    ('{"type": "session.resume", "session_id": "", "resume_token": "t"}', InvalidMessage, "session_id"),
    ('{"type": "session.resume", "session_id": "s"}', InvalidMessage, "resume_token"),
    ('{"type": "session.resume", "session_id": "s", "resume_token": 1}', InvalidMessage, "resume_token"),
    (
        '{"type": "session.resume", "session_id": "s", "resume_token": "t", "last_seq": -1}',
        InvalidMessage,
        "last_seq",
    ),
    ('{"type": "session.open", "config": []}', InvalidMessage, "config"),
    ('{"type": "session.open", "config": {"temprature": 1}}', InvalidMessage, "temprature"),
    ('{"type": "session.open", "config": {"temperature": -0.5}}', InvalidMessage, "temperature"),
    ('{"type": "session.open", "config": {"temperature": true}}', InvalidMessage, "temperature"),
    ('{"type": "session.open", "config": {"temperature": "1"}}', InvalidMessage, "temperature"),
    ('{"type": "session.open", "config": {"temperature": 1e999}}', InvalidMessage, "temperature"),
    ('{"type": "session.open", "config": {"top_p": 0}}', InvalidMessage, "top_p"),
    ('{"type": "session.open", "config": {"top_p": 1.5}}', InvalidMessage, "top_p"),
    ('{"type": "session.open", "config": {"top_k": 0}}', InvalidMessage, "top_k"),
    ('{"type": "session.open", "config": {"seed": -1}}', InvalidMessage, "seed"),
    ('{"type": "session.open", "config": {"stop_token_ids": [true]}}', InvalidMessage, "stop_token_ids"),
    ('{"type": "session.open", "config": {"logprobs": "yes"}}', InvalidMessage, "logprobs"),
    ('{"type": "session.open", "config": {"idle_timeout_s": 0}}', InvalidMessage, "idle_timeout_s"),
    ('{"type": "session.open", "config": {"max_context_tokens": 0}}', InvalidMessage, "max_context"),
    ('{"type": "session.open", "config": {"context_policy": "drop"}}', InvalidMessage, "context_policy"),
    ('{"type": "session.open", "config": {"stream": 1}}', InvalidMessage, "stream"),
]


@pytest.mark.parametrize(("frame", "error", "mentions"), JSON_FAILURES, ids=[f[0] for f in JSON_FAILURES])
def test_json_validation_failures(frame: str, error: type[MicroturnError], mentions: str) -> None:
    with pytest.raises(error) as info:
        decode_client(frame, Encoding.JSON)
    assert type(info.value) is error
    assert mentions in info.value.message
    assert info.value.recoverable  # a bad message never kills the session by itself


# ---- validation: msgpack ------------------------------------------------------------------------


def _pack(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


MSGPACK_FAILURES: list[tuple[bytes, type[MicroturnError], str]] = [
    (b"", InvalidMessage, "malformed msgpack"),
    (b"\xc1", InvalidMessage, "malformed msgpack"),  # a reserved, never-valid byte
    (_pack({"type": "ping"})[:-2], InvalidMessage, "malformed msgpack"),  # truncated
    (_pack({"type": "ping"}) + b"\x00", InvalidMessage, "malformed msgpack"),  # trailing data
    (_pack({1: "ping"}), InvalidMessage, "malformed msgpack"),  # int map key
    (_pack({b"type": "ping"}), InvalidMessage, "keys must be strings"),
    (_pack([1, 2]), InvalidMessage, "map"),
    (_pack("ping"), InvalidMessage, "map"),
    (_pack({"data": 1}), InvalidMessage, "missing field 'type'"),
    (_pack({"type": b"ping"}), InvalidMessage, "'type'"),
    (_pack({"type": "nope"}), UnknownType, "nope"),
    (_pack({"type": "input.chunk", "seq": 1.0, "tokens": [1]}), InvalidMessage, "'seq'"),
    (_pack({"type": "input.chunk", "seq": True, "tokens": [1]}), InvalidMessage, "'seq'"),
    (_pack({"type": "input.chunk", "seq": -5, "tokens": [1]}), InvalidMessage, "'seq'"),
    (_pack({"type": "input.chunk", "seq": 2**64 - 1, "tokens": [1]}), InvalidMessage, "'seq'"),
    (_pack({"type": "input.chunk", "seq": 1, "text": b"hi"}), InvalidMessage, "'text'"),
    (_pack({"type": "input.chunk", "seq": 1, "tokens": [1, False]}), InvalidMessage, "'tokens'"),
    (_pack({"type": "input.chunk", "seq": msgpack.ExtType(1, b"x"), "text": "a"}), InvalidMessage, "'seq'"),
    (_pack({"type": "session.open", "config": {"bogus": 1}}), InvalidMessage, "bogus"),
    (_pack({"type": "session.open", "config": {"temperature": math.nan}}), InvalidMessage, "temperature"),
    (_pack({"type": "input.chunk", "seq": 1, "tokens": [-1]}), TokenOutOfRange, "'tokens'"),
    # Invalid UTF-8 (here an encoded surrogate) is refused by the field that holds it.
    (
        _pack({"type": "input.chunk", "seq": 1, "text": "a"}).replace(b"\xa1a", b"\xa3\xed\xa0\x80"),
        InvalidMessage,
        "'text'",
    ),
    (_pack({"type": "ping", "data": ["ok", "x"]}).replace(b"\xa1x", b"\xa1\xff"), InvalidMessage, "'data'"),
    (_pack({"type": "ping", "zz": 1}).replace(b"\xa2zz", b"\xa2\xc3("), InvalidMessage, "not valid Unicode"),
]


@pytest.mark.parametrize(
    ("frame", "error", "mentions"), MSGPACK_FAILURES, ids=[repr(f[0]) for f in MSGPACK_FAILURES]
)
def test_msgpack_validation_failures(frame: bytes, error: type[MicroturnError], mentions: str) -> None:
    with pytest.raises(error) as info:
        decode_client(frame, Encoding.MSGPACK)
    assert type(info.value) is error
    assert mentions in info.value.message


def test_frame_kind_must_match_the_encoding() -> None:
    chunk = InputChunk(1, tokens=(5,))
    with pytest.raises(InvalidMessage, match="text frame"):
        decode_client(encode_client(chunk, Encoding.JSON), Encoding.MSGPACK)
    with pytest.raises(InvalidMessage, match="binary frame"):
        decode_client(encode_client(chunk, Encoding.MSGPACK), Encoding.JSON)
    # JSON text sent as a binary frame is refused too, even though it would parse.
    with pytest.raises(InvalidMessage, match="binary frame"):
        decode_client(b'{"type": "session.close"}', Encoding.JSON)
    with pytest.raises(InvalidMessage, match="binary frame"):
        decode_server(encode_server(Pong(), Encoding.MSGPACK), Encoding.JSON)


def test_msgpack_accepts_bytes_like_frames() -> None:
    frame = encode_client(OutputCancel(3), Encoding.MSGPACK)
    assert isinstance(frame, bytes)
    assert decode_client(bytearray(frame), Encoding.MSGPACK) == OutputCancel(3)
    assert decode_client(memoryview(frame), Encoding.MSGPACK) == OutputCancel(3)


def test_decoding_does_not_mutate_its_input() -> None:
    config = {"temperature": 0.5, "stop_token_ids": [1, 2], "oops": True}
    before = json.loads(json.dumps(config))
    with pytest.raises(InvalidMessage, match="oops"):
        config_from_map(config)
    assert config == before
    good = {"temperature": 0.5, "stop_token_ids": [1, 2]}
    assert config_from_map(good) == OpenConfig(temperature=0.5, stop_token_ids=(1, 2))
    assert good == {"temperature": 0.5, "stop_token_ids": [1, 2]}


SERVER_FAILURES: list[tuple[dict[str, Any], str]] = [
    ({"type": "error", "code": "teapot", "message": "m", "fatal": False}, "'code'"),
    ({"type": "error", "code": "internal", "message": "m"}, "fatal"),
    ({"type": "session.closed", "reason": "bored"}, "reason"),
    (
        {"type": "output.done", "seq": 1, "tokens": [1, 2], "finish": "stop", "timing": {"queue_ms": 1}},
        "compute_ms",
    ),
    (
        {
            "type": "output.done",
            "seq": 1,
            "tokens": [1, 2],
            "finish": "stop",
            "timing": {"queue_ms": 1, "compute_ms": 2},
            "logprobs": [-1.0],
        },
        "logprobs",
    ),
    ({"type": "output.done", "seq": 1, "tokens": [], "finish": "eos", "timing": {}}, "finish"),
    ({"type": "output.delta", "seq": 1, "index": 0, "token": 1, "logprob": "low"}, "logprob"),
    (
        {
            "type": "session.opened",
            "session_id": "s",
            "resume_token": "t",
            "model": "m",
            "limits": {"x": True},
        },
        "x",
    ),
    ({"type": "session.resumed", "session_id": "s"}, "length"),
    ({"type": "session.open"}, "session.open"),  # a client message is unknown to the client
]


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize(("obj", "mentions"), SERVER_FAILURES, ids=[str(f[0]) for f in SERVER_FAILURES])
def test_server_message_validation(obj: dict[str, Any], mentions: str, encoding: Encoding) -> None:
    frame: str | bytes = json.dumps(obj) if encoding is Encoding.JSON else _pack(obj)
    with pytest.raises((InvalidMessage, UnknownType)) as info:
        decode_server(frame, encoding)
    assert mentions in info.value.message


def test_non_finite_floats_are_not_encoded_as_json() -> None:
    with pytest.raises(ValueError, match="JSON"):
        encode_server(OutputDelta(1, 0, 5, "a", -math.inf), Encoding.JSON)


# ---- subprotocol negotiation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offered", "expected"),
    [
        ([], Encoding.JSON),
        ([""], Encoding.JSON),
        (["microturn.v1.json"], Encoding.JSON),
        (["microturn.v1.msgpack"], Encoding.MSGPACK),
        ([" microturn.v1.msgpack "], Encoding.MSGPACK),
        (["graphql-ws", "microturn.v1.msgpack"], Encoding.MSGPACK),
        (["microturn.v1.msgpack", "microturn.v1.json"], Encoding.MSGPACK),
        (["microturn.v1.json", "microturn.v1.msgpack"], Encoding.JSON),
        (["graphql-ws"], None),
        (["microturn.v2.json", "MICROTURN.V1.JSON"], None),
    ],
)
def test_choose_encoding(offered: list[str], expected: Encoding | None) -> None:
    assert choose_encoding(offered) is expected
    assert choose_encoding(iter(offered)) is expected


def test_subprotocol_names() -> None:
    assert Encoding.JSON.subprotocol == "microturn.v1.json"
    assert Encoding.MSGPACK.subprotocol == "microturn.v1.msgpack"


# ---- close codes and error messages -------------------------------------------------------------


def test_close_codes_are_distinct_application_codes_for_every_error() -> None:
    assert set(CLOSE_CODES) == set(ErrorCode)
    codes = [close_code_for(code) for code in ErrorCode]
    assert len(set(codes)) == len(codes)
    assert all(4000 <= c <= 4999 for c in codes)
    assert close_code_for(ErrorCode.INVALID_MESSAGE) == 4000
    for code in ErrorCode:
        assert error_code_for_close(close_code_for(code)) is code
    assert error_code_for_close(1000) is None


def test_every_non_recoverable_error_has_a_close_code() -> None:
    from shared.errors import ERROR_TYPES

    fatal = {code for code, cls in ERROR_TYPES.items() if not cls.recoverable}
    assert fatal == {
        ErrorCode.SESSION_NOT_FOUND,
        ErrorCode.SESSION_EXPIRED,
        ErrorCode.UNAUTHORIZED,
        ErrorCode.INTERNAL,
    }
    assert fatal <= set(CLOSE_CODES)


def test_error_message_from_exception() -> None:
    limited = error_message_from(RateLimited("too fast", retry_after_ms=200), seq=4)
    assert limited == Error(ErrorCode.RATE_LIMITED, "too fast", False, 4, 200)
    gone = error_message_from(SessionNotFound("no such session"))
    assert gone == Error(ErrorCode.SESSION_NOT_FOUND, "no such session", True)
    at_open = error_message_from(CapacityExhausted("full", retry_after_ms=1000), fatal=True)
    assert at_open.fatal
    assert at_open.retry_after_ms == 1000
    wire = _json(encode_server(limited, Encoding.JSON))
    assert wire == {
        "type": "error",
        "code": "rate_limited",
        "message": "too fast",
        "fatal": False,
        "seq": 4,
        "retry_after_ms": 200,
    }


def test_error_back_to_exception() -> None:
    exc = Error(ErrorCode.RATE_LIMITED, "too fast", False, 4, 200).to_exception()
    assert type(exc) is RateLimited
    assert exc.retry_after_ms == 200
    assert type(Error(ErrorCode.INTERNAL, "boom", True).to_exception()) is InternalError
