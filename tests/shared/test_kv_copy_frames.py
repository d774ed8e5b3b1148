"""The KV copy stream's control frames (shared/protocol/kv_copy.py): they round-trip, a malformed
one is a typed error, the format check names the first difference, the checksum spans frames."""

from __future__ import annotations

import zlib

import msgpack
import pytest

from shared.errors import InvalidMessage
from shared.protocol.kv_copy import (
    KVFormat,
    KVHeader,
    KVReady,
    KVRefused,
    KVStored,
    checksum,
    decode_kv,
    encode_kv,
)
from shared.protocol.messages import OpenConfig

FORMAT = KVFormat(model="ab12", dtype="float32", page_size=16, layout="head_major", page_bytes=65536)


@pytest.mark.parametrize(
    "frame",
    [
        KVHeader("s", FORMAT, (1, 2, 3), 1, 0xDEADBEEF, OpenConfig(max_output_tokens=2)),
        KVReady("s"),
        KVStored("s", 3),
        KVRefused("s", "checksum", "CRC-32 differs"),
    ],
)
def test_every_frame_round_trips(frame: KVHeader | KVReady | KVStored | KVRefused) -> None:
    assert decode_kv(encode_kv(frame)) == frame


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # not msgpack
        msgpack.packb([1, 2]),  # not a map
        msgpack.packb({"sid": "s"}),  # no op
        msgpack.packb({"op": "kv_pages", "sid": "s"}),  # unknown op
        msgpack.packb({"op": "kv_refused", "sid": "s", "reason": "bored"}),  # unknown reason
        msgpack.packb({"op": "kv_stored", "sid": "s"}),  # a field missing
        msgpack.packb({"op": "kv_ready", "sid": "s", "extra": 1}),  # an unknown field
    ],
)
def test_a_malformed_frame_is_a_typed_error(data: bytes) -> None:
    with pytest.raises(InvalidMessage):
        decode_kv(data)
    with pytest.raises(InvalidMessage):
        decode_kv("text")  # the stream is binary


def test_the_format_check_names_the_first_difference() -> None:
    assert FORMAT.mismatch(FORMAT) is None
    other_model = KVFormat("cd34", "bfloat16", 32, "nhd", 1)
    assert FORMAT.mismatch(other_model) == "model"  # whatever else differs too
    assert FORMAT.mismatch(KVFormat("ab12", "bfloat16", 32, "nhd", 1)) == "dtype"
    assert FORMAT.mismatch(KVFormat("ab12", "float32", 32, "nhd", 1)) == "page_size"
    assert FORMAT.mismatch(KVFormat("ab12", "float32", 16, "nhd", 65536)) == "layout"
    assert FORMAT.mismatch(KVFormat("ab12", "float32", 16, "head_major", 1)) == "layout"


def test_the_checksum_of_the_frames_is_the_payloads() -> None:
    payload = bytes(range(256)) * 1000
    frames = [memoryview(payload)[i : i + 4096] for i in range(0, len(payload), 4096)]
    assert checksum(frames) == zlib.crc32(payload)
    flipped = bytearray(payload)
    flipped[40_000] ^= 0xFF
    assert checksum([memoryview(flipped)]) != checksum(frames)
