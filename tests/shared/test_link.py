"""Worker link frames: round trips, typed refusal of malformed frames, the client messages they carry."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from shared.errors import Backpressure, ErrorCode, InternalError, InvalidMessage
from shared.protocol.link import (
    LinkAttach,
    LinkCancel,
    LinkChunk,
    LinkClose,
    LinkClosed,
    LinkDelta,
    LinkDetach,
    LinkDone,
    LinkError,
    LinkFrame,
    LinkOpen,
    LinkOpened,
    LinkRestore,
    LinkRewind,
    LinkRewound,
    link_error_from,
)
from shared.protocol.link_codec import decode_link, encode_link
from shared.protocol.messages import (
    Error,
    InputChunk,
    OpenConfig,
    OutputDelta,
    OutputDone,
    SessionRewind,
    SessionRewound,
    Timing,
)

CONFIG = OpenConfig(max_output_tokens=8, temperature=0.5, seed=7, stop_token_ids=(2,), stream=True)

FRAMES: list[LinkFrame] = [
    LinkOpen("s1"),
    LinkOpen("s1", CONFIG, (1, 2, 3)),
    LinkAttach("s1"),
    LinkAttach("s1", 12),
    LinkRestore("s1", CONFIG, tuple(range(5000)), 99),
    LinkRestore("s1", OpenConfig()),
    LinkChunk("s1", InputChunk(0, tokens=(5, 6))),
    LinkChunk("s1", InputChunk(1, text="hi", max_output_tokens=4, logprobs=True)),
    LinkCancel("s1", 3),
    LinkCancel("s1", 3, keep_output_tokens=2),
    LinkRewind("s1", SessionRewind(keep_tokens=12)),
    LinkRewound("s1", SessionRewound(12), 4),
    LinkDetach("s1"),
    LinkClose("s1"),
    LinkClose("s1", "idle_timeout"),
    LinkOpened("s1", 0),
    LinkOpened("s1", 1234, 17),
    LinkDelta("s1", OutputDelta(3, 0, 42, "Hi", -0.5)),
    LinkDelta("s1", OutputDelta(3, 1, 43)),
    LinkDone("s1", OutputDone(3, (42, 43), "Hi!", "length", Timing(0.25, 9.5), (-0.5, -0.125)), 1500),
    LinkDone("s1", OutputDone(4, (), None, "cancelled", Timing(0.0, 0.0)), 1500),
    LinkError("s1", Error(ErrorCode.BACKPRESSURE, "queue full", False, 5, 100)),
    LinkError("", Error(ErrorCode.INVALID_MESSAGE, "bad frame", False)),
    LinkClosed("s1", "evicted"),
]


def _pack(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


@pytest.mark.parametrize("frame", FRAMES, ids=repr)
def test_frames_round_trip(frame: LinkFrame) -> None:
    data = encode_link(frame)
    assert isinstance(data, bytes)
    wire = msgpack.unpackb(data)
    assert wire["op"] == type(frame).op
    assert wire["sid"] == frame.sid
    assert None not in wire.values()
    assert decode_link(data) == frame


def test_ops_are_distinct_and_cover_the_design() -> None:
    ops = {type(f).op for f in FRAMES}
    assert ops == {
        "open",
        "attach",
        "restore",
        "chunk",
        "cancel",
        "rewind",
        "rewound",
        "detach",
        "close",
        "opened",
        "delta",
        "done",
        "error",
        "closed",
    }


def test_config_travels_as_a_map() -> None:
    wire = msgpack.unpackb(encode_link(LinkOpen("s1", CONFIG)))
    assert wire["config"]["temperature"] == 0.5
    assert wire["config"]["stop_token_ids"] == [2]
    assert "top_p" not in wire["config"]


FAILURES: list[tuple[bytes, str]] = [
    (b"", "malformed msgpack"),
    (b"\xc1", "malformed msgpack"),
    (_pack({"op": "detach", "sid": "s"}) + b"\x01", "malformed msgpack"),
    (_pack([1]), "map"),
    (_pack({b"op": "detach", "sid": "s"}), "keys must be strings"),
    (_pack({"sid": "s"}), "'op'"),
    (_pack({"op": 3, "sid": "s"}), "'op'"),
    (_pack({"op": "explode", "sid": "s"}), "explode"),
    (_pack({"op": "chunk", "chunk": {"seq": 1, "tokens": [1]}}), "'sid'"),
    (_pack({"op": "chunk", "sid": "", "chunk": {"seq": 1, "tokens": [1]}}), "'sid'"),
    (_pack({"op": "chunk", "sid": b"s", "chunk": {"seq": 1, "tokens": [1]}}), "'sid'"),
    (_pack({"op": "chunk", "sid": "s", "chunk": {"seq": True, "tokens": [1]}}), "'seq'"),
    (_pack({"op": "chunk", "sid": "s", "chunk": {"seq": -1, "tokens": [1]}}), "'seq'"),
    (_pack({"op": "chunk", "sid": "s", "chunk": {"seq": 1}}), "exactly one"),
    (_pack({"op": "chunk", "sid": "s", "chunk": {"seq": 1, "tokens": [1], "text": "a"}}), "exactly one"),
    (_pack({"op": "chunk", "sid": "s", "chunk": {"seq": 1, "tokens": [1]}, "extra": 0}), "extra"),
    (_pack({"op": "open", "sid": "s", "config": {"temperatur": 0}}), "temperatur"),
    (_pack({"op": "open", "sid": "s", "history": [1, None]}), "history"),
    (_pack({"op": "restore", "sid": "s", "config": {}, "tokens": [1, 2.5]}), "tokens"),
    (_pack({"op": "close", "sid": "s", "reason": "whatever"}), "reason"),
    (_pack({"op": "cancel", "sid": "s"}), "'seq'"),
    (_pack({"op": "opened", "sid": "s", "length": "3"}), "length"),
    (_pack({"op": "delta", "sid": "s", "delta": {"seq": 1, "index": 0, "token": -1}}), "token"),
    (
        _pack(
            {
                "op": "done",
                "sid": "s",
                "done": {
                    "seq": 1,
                    "tokens": [1, 2],
                    "finish": "stop",
                    "timing": {"queue_ms": 0, "compute_ms": 1},
                    "logprobs": [-1.0],
                },
                "length": 9,
            }
        ),
        "logprobs",
    ),
    (
        _pack(
            {
                "op": "done",
                "sid": "s",
                "done": {"seq": 1, "tokens": [], "finish": "stop", "timing": {"compute_ms": 1}},
                "length": 9,
            }
        ),
        "queue_ms",
    ),
    (_pack({"op": "error", "sid": "s", "error": {"code": "nope", "message": "m", "fatal": True}}), "'code'"),
    (_pack({"op": "error", "sid": "s", "error": {"code": "internal", "message": "m", "fatal": 1}}), "fatal"),
    (_pack({"op": "closed", "sid": "s"}), "reason"),
]


@pytest.mark.parametrize(("data", "mentions"), FAILURES, ids=[repr(f[0]) for f in FAILURES])
def test_invalid_frames_raise_invalid_message(data: bytes, mentions: str) -> None:
    with pytest.raises(InvalidMessage) as info:
        decode_link(data)
    assert type(info.value) is InvalidMessage
    assert mentions in info.value.message


def test_text_frames_are_refused() -> None:
    with pytest.raises(InvalidMessage, match="text frame"):
        decode_link('{"op": "detach", "sid": "s"}')


def test_frames_carry_the_client_messages_they_relay() -> None:
    chunk = InputChunk(4, tokens=(1, 2), max_output_tokens=3, logprobs=True)
    decoded_chunk = decode_link(encode_link(LinkChunk("s1", chunk)))
    assert isinstance(decoded_chunk, LinkChunk) and decoded_chunk.chunk == chunk
    delta = OutputDelta(4, 1, 9, "x", -0.5)
    decoded_delta = decode_link(encode_link(LinkDelta("s1", delta)))
    assert isinstance(decoded_delta, LinkDelta) and decoded_delta.delta == delta
    done = OutputDone(4, (9, 10), "xy", "stop", Timing(0.5, 7.0), (-0.5, -1.5), committed_tokens=2)
    decoded_done = decode_link(encode_link(LinkDone("s1", done, 300, durable_seq=3)))
    assert isinstance(decoded_done, LinkDone)
    assert (decoded_done.done, decoded_done.length, decoded_done.durable_seq) == (done, 300, 3)
    error = Error(ErrorCode.BACKPRESSURE, "full", False, 4, 50)
    decoded_error = decode_link(encode_link(LinkError("s1", error)))
    assert isinstance(decoded_error, LinkError) and decoded_error.error == error


def test_link_error_from_exception() -> None:
    frame = link_error_from("s1", Backpressure("queue full", retry_after_ms=20), seq=6)
    assert frame == LinkError("s1", Error(ErrorCode.BACKPRESSURE, "queue full", False, 6, 20))
    assert link_error_from("s1", InternalError("boom")).error.fatal is True
    assert link_error_from("s1", Backpressure("x"), fatal=True).error.fatal is True
    assert decode_link(encode_link(frame)) == frame


def test_decoded_frames_are_immutable() -> None:
    frame: Any = decode_link(encode_link(LinkChunk("s1", InputChunk(1, tokens=(1,)))))
    with pytest.raises(AttributeError):
        frame.sid = "s2"
    with pytest.raises(AttributeError):
        frame.chunk.seq = 2
