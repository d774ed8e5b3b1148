"""The field-driven link codec (shared/protocol/link_codec.py), checked against the registry of frame classes.

Every frame is built from its own type hints (a sample value per field), so a new frame class or a
new field (of a frame or of a client message it carries) is covered here with no edit.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

import msgpack
import pytest

from shared.errors import InvalidMessage
from shared.protocol.link import FRAME_CLASSES, LinkFrame
from shared.protocol.link_codec import decode_link, encode_link
from shared.protocol.messages import InputChunk

CLASSES = sorted(FRAME_CLASSES.values(), key=lambda cls: cls.op)


def _sample_value(hint: Any, full: bool) -> Any:
    """A valid value of the type `hint`: every optional field set when `full`, else only required."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return _sample_value(next(a for a in args if a is not type(None)), full)
    if origin is typing.Literal:
        return args[-1]
    if origin is tuple:
        return (_sample_value(args[0], full),)  # one item: tails, tokens and logprobs stay consistent
    if origin is dict:
        return {"k": 1}
    if dataclasses.is_dataclass(hint):
        return _sample(typing.cast(type, hint), full)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return next(iter(hint))
    return {int: 7, float: 0.5, bool: True, str: "x", object: "any"}[hint]


def _required(f: dataclasses.Field[Any], hint: Any) -> bool:
    """No default, and None is not a value of its type (such a field is None when absent)."""
    no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    return no_default and type(None) not in typing.get_args(hint)


def _sample(cls: type, full: bool) -> Any:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if full or _required(f, hints[f.name]):
            values[f.name] = _sample_value(hints[f.name], full)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            values[f.name] = None  # no default, but None is a value: left out on the wire
    if cls is InputChunk:  # a chunk carries exactly one of `tokens` or `text`
        values.pop("text", None)
        values["tokens"] = (7,)
    return cls(**values)


def _wire(frame: LinkFrame) -> dict[str, Any]:
    wire: dict[str, Any] = msgpack.unpackb(encode_link(frame))
    return wire


def _pack(wire: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(wire, use_bin_type=True)
    return packed


@pytest.mark.parametrize("full", [True, False], ids=["every-field", "required-only"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.op)
def test_every_frame_class_round_trips(cls: type, full: bool) -> None:
    frame = _sample(cls, full)
    assert decode_link(encode_link(frame)) == frame


def test_the_registry_names_each_class_by_its_op() -> None:
    assert all(cls.op == op for op, cls in FRAME_CLASSES.items())
    assert len(set(FRAME_CLASSES.values())) == len(FRAME_CLASSES)


# Fields whose value is a free-form JSON map (a response_format's schema or structural tag): its
# inside is anyone's.
_FREE_FORM = frozenset({"schema", "tag"})


def _paths(wire: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key path in a wire map, nested maps (and the first map of a list) included."""
    out = []
    for key, value in wire.items():
        if key == "op":
            continue
        out.append((*prefix, key))
        if isinstance(value, dict) and key not in _FREE_FORM:
            out.extend(_paths(value, (*prefix, key)))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            out.extend(_paths(value[0], (*prefix, key, "0")))
    return out


def _set(wire: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    node: Any = wire
    for key in path[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return wire


_DELETE = object()
# A value no field accepts (every `object`-typed field excepted): a map of a map's type is refused.
_WRONG = [[{"no": "such"}]]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.op)
def test_a_wrong_value_anywhere_is_a_typed_error(cls: type) -> None:
    frame = _sample(cls, True)
    paths = _paths(_wire(frame))
    assert paths
    for path in paths:
        with pytest.raises(InvalidMessage) as info:
            decode_link(_pack(_set(_wire(frame), path, _WRONG)))
        assert type(info.value) is InvalidMessage
        assert repr(path[-1]) in info.value.message or path[-1].isdigit(), info.value.message


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.op)
def test_a_missing_required_field_or_an_unknown_one_is_a_typed_error(cls: type) -> None:
    """Without one of its keys a frame is refused (a required field), or decodes to itself (the
    key held its field's default, as on the wire of a frame built without it)."""
    required = _sample(cls, False)
    refused = 0
    for path in _paths(_wire(required)):
        try:
            decoded = decode_link(_pack(_set(_wire(required), path, _DELETE)))
        except InvalidMessage as error:
            assert type(error) is InvalidMessage
            assert "missing field" in error.message or "exactly one" in error.message, error.message
            refused += 1
        else:
            assert decoded == required, path
    assert refused >= 1  # `sid` at least
    with pytest.raises(InvalidMessage, match=r"unknown field.*surplus"):
        decode_link(_pack({**_wire(required), "surplus": 1}))


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", _pack({"op": "detach", "sid": "s"}) + b"\x01", b"\x81\xa2op\xa1\xff", _pack([1])],
    ids=["empty", "reserved-byte", "trailing-bytes", "invalid-utf8", "not-a-map"],
)
def test_malformed_msgpack_is_a_typed_error(data: bytes) -> None:
    with pytest.raises(InvalidMessage):
        decode_link(data)
