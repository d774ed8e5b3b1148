"""One codec for messages as maps, driven by `dataclasses.fields`: add a field, and it travels.

Why: the link (docs/link.md) carries the client's own messages inside its frames, and every hop
between our own processes needs the same walk from a frozen dataclass to a map and back. The walk
is written once, here, from each class's type hints (computed once per class and cached), so a new
field or a new frame is one edit in its dataclass (mini-sglang's `message/` package is the model).

- `to_wire(obj)`: a map of `obj`'s fields, `None` left out; nested dataclasses (and tuples of them)
  become maps, enums their value. The client codec (codec.py) encodes with it too, so what a client
  receives is exactly the dataclass's fields in declaration order.
- `from_wire(cls, obj, where)`: the reverse, for *internal* input (the link). It checks each value
  against its field's type (an int is an `int` in [0, 2**64), a float finite, a literal one of its
  values, a tuple's items each), refuses unknown and missing fields, and raises `InvalidMessage`
  naming the map and the field, so a version skew or a bug is a typed error, never a crash. It does
  not apply the client protocol's ranges and rules: client input goes through the strict,
  field-by-field codec (codec.py, fields.py), which is the one place those are written.
- `encode_link` / `decode_link`: a link frame (shared/protocol/link.py) <-> one msgpack frame, with
  the checks a frame's types cannot say. They live here, beside the walk, rather than beside the
  frame declarations: one file runs per frame on each side (docs/design.md, "The path of one chunk").
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgpack

from shared.errors import InvalidMessage
from shared.protocol.fields import show
from shared.protocol.link import FRAME_CLASSES, LinkChunk, LinkDone, LinkError, LinkFrame, LinkRestore

_T = TypeVar("_T")
# msgpack's unsigned range: every integer on the link (seq, length, token, ms...) is non-negative.
_MAX_WIRE_INT: Final = 2**64 - 1

# A converter takes (value, where, field name) and returns the typed value or raises.
_Convert = Callable[[Any, str, str], Any]

# How `to_wire` treats a field's value.
_PLAIN, _NESTED, _NESTED_TUPLE, _ENUM = range(4)


def _bad(where: str, name: str, want: str, value: object) -> InvalidMessage:
    return InvalidMessage(f"{where}: field '{name}' must be {want}, got {show(value)}")


def _int(value: Any, where: str, name: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_WIRE_INT:
        raise _bad(where, name, "a non-negative integer", value)
    return value


def _float(value: Any, where: str, name: str) -> float:
    if (type(value) is not float and type(value) is not int) or not math.isfinite(value):
        raise _bad(where, name, "a finite number", value)
    return float(value)


def _exact(kind: type, want: str) -> _Convert:
    def convert(value: Any, where: str, name: str) -> Any:
        if type(value) is not kind:
            raise _bad(where, name, want, value)
        return value

    return convert


_str: Final = _exact(str, "a string")


def _any(value: Any, where: str, name: str) -> Any:
    return value


def _literal(choices: tuple[object, ...]) -> _Convert:
    def convert(value: Any, where: str, name: str) -> Any:
        if type(value) is not str or value not in choices:
            raise _bad(where, name, "one of " + ", ".join(map(str, choices)), value)
        return value

    return convert


def _enum(cls: type[enum.Enum]) -> _Convert:
    def convert(value: Any, where: str, name: str) -> Any:
        try:
            return cls(value)
        except ValueError:
            raise _bad(where, name, f"a {cls.__name__}", value) from None

    return convert


def _tuple(item: _Convert) -> _Convert:
    def convert(value: Any, where: str, name: str) -> tuple[Any, ...]:
        if type(value) is not list and type(value) is not tuple:
            raise _bad(where, name, "a list", value)
        # Token lists are the bulk of the link: one pass, no call per item.
        if item is _int and all(type(x) is int and 0 <= x <= _MAX_WIRE_INT for x in value):
            return tuple(value)
        return tuple(item(x, where, name) for x in value)

    return convert


def _nested(cls: type) -> _Convert:
    def convert(value: Any, where: str, name: str) -> Any:
        if type(value) is not dict:
            raise _bad(where, name, "a map", value)
        return from_wire(cls, value, f"{where}.{name}")

    return convert


def _converter(hint: Any) -> tuple[_Convert, bool, int]:
    """(converter, whether None is allowed, how `to_wire` treats it) for one type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"no wire form for the union {hint!r}: one type or None")
        convert, _optional, mode = _converter(rest[0])
        return convert, type(None) in args, mode
    if origin is typing.Literal:
        return _literal(args), False, _PLAIN
    if origin is tuple:
        item, _optional, mode = _converter(args[0])
        return _tuple(item), False, _NESTED_TUPLE if mode == _NESTED else _PLAIN
    if origin is dict:
        return _exact(dict, "a map"), False, _PLAIN
    if dataclasses.is_dataclass(hint):
        return _nested(typing.cast(type, hint)), False, _NESTED
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum(hint), False, _ENUM
    simple: dict[Any, _Convert] = {
        int: _int,
        float: _float,
        bool: _exact(bool, "a boolean"),
        str: _str,
        object: _any,
    }
    if hint not in simple:
        raise TypeError(f"no wire form for the type {hint!r}")
    return simple[hint], False, _PLAIN


# One field's spec, a plain tuple (unpacked on every decode, the cheapest form):
# (name, convert, required, none_if_absent, mode). `required`: no default and None not allowed,
# so absent on the wire is an error; `none_if_absent`: no default but None allowed, so absent
# means None (to_wire leaves None out); `mode`: how to_wire treats the value.
_Spec = tuple[str, _Convert, bool, bool, int]
_FIELDS: dict[type, tuple[_Spec, ...]] = {}
_NAMES: dict[type, frozenset[str]] = {}
_ABSENT: Final = object()


def _fields(cls: type) -> tuple[_Spec, ...]:
    """The cached field specs of a dataclass, built from its resolved type hints."""
    specs = _FIELDS.get(cls)
    if specs is None:
        hints = typing.get_type_hints(cls)
        built = []
        for f in dataclasses.fields(cls):
            convert, optional, mode = _converter(hints[f.name])
            no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            built.append((f.name, convert, no_default and not optional, no_default and optional, mode))
        specs = _FIELDS[cls] = tuple(built)
        _NAMES[cls] = frozenset(spec[0] for spec in specs)
    return specs


def to_wire(obj: object, out: dict[str, object] | None = None) -> dict[str, object]:
    """`obj`'s fields added to `out` (a new map by default), `None` left out, nested ones as maps."""
    out = {} if out is None else out
    for name, _convert, _required, _none_if_absent, mode in _FIELDS.get(type(obj)) or _fields(type(obj)):
        value = getattr(obj, name)
        if value is None:
            continue
        if mode == _NESTED:
            value = to_wire(value)
        elif mode == _NESTED_TUPLE:
            value = [to_wire(item) for item in value]
        elif mode == _ENUM:
            value = value.value
        out[name] = value
    return out


def from_wire(cls: type[_T], obj: object, where: str) -> _T:
    """An instance of the dataclass `cls` from its map; raises `InvalidMessage` (see the docstring)."""
    if type(obj) is not dict:
        raise InvalidMessage(f"{where} must be a map, got {show(obj)}")
    values: dict[str, Any] = {}
    found = 0
    for name, convert, required, none_if_absent, _mode in _FIELDS.get(cls) or _fields(cls):
        value = obj.get(name, _ABSENT)
        if value is not _ABSENT:
            found += 1
            if value is not None:
                # The common scalars checked inline: a call per field is most of a decode's cost.
                if convert is _int:
                    if type(value) is not int or value < 0 or value > _MAX_WIRE_INT:
                        raise _bad(where, name, "a non-negative integer", value)
                elif convert is _str:
                    if type(value) is not str:
                        raise _bad(where, name, "a string", value)
                else:
                    value = convert(value, where, name)
                values[name] = value
                continue
        if required:
            raise InvalidMessage(f"{where}: missing field '{name}'")
        if none_if_absent:
            values[name] = None
    if found != len(obj):
        if any(type(key) is not str for key in obj):
            raise InvalidMessage(f"{where}: map keys must be strings")
        unknown = sorted(key for key in obj if key not in _NAMES[cls])
        raise InvalidMessage(f"{where}: unknown field(s) {', '.join(unknown)}")
    return cls(**values)


def check_one_input(tokens: object, text: object, where: str) -> None:
    """A chunk carries exactly one of `tokens` or `text` (also checked on the link's chunks)."""
    if (tokens is None) == (text is None):
        raise InvalidMessage(f"{where}: exactly one of 'tokens' or 'text' is required")


# ---- the link's frames ---------------------------------------------------------------------------


def encode_link(frame: LinkFrame) -> bytes:
    """One binary link frame: the frame's fields (`None` left out) under its `op`."""
    packed: bytes = msgpack.packb(to_wire(frame, {"op": frame.op}), use_bin_type=True)
    return packed


def _check(frame: LinkFrame) -> None:
    """The rules a frame's types cannot say: a named session, one input per chunk, and so on."""
    if not frame.sid and not isinstance(frame, LinkError):
        raise InvalidMessage(f"link {frame.op}: field 'sid' must be a non-empty string")
    if isinstance(frame, LinkChunk):
        check_one_input(frame.chunk.tokens, frame.chunk.text, "link chunk")
    elif isinstance(frame, LinkDone):
        done = frame.done
        if done.logprobs is not None and len(done.logprobs) != len(done.tokens):
            raise InvalidMessage(f"link done: {len(done.logprobs)} logprobs for {len(done.tokens)} tokens")
    elif isinstance(frame, LinkRestore):
        for turn in frame.tail:
            check_one_input(turn.chunk.tokens, turn.chunk.text, "link restore tail")
        seqs = [turn.chunk.seq for turn in frame.tail]
        if any(a >= b for a, b in itertools.pairwise(seqs)):
            raise InvalidMessage("link restore: tail seqs must increase")


def decode_link(data: bytes | bytearray | memoryview | str) -> LinkFrame:
    """Parse and check one link frame (either direction); raises `InvalidMessage`."""
    if isinstance(data, str):
        raise InvalidMessage("text frame on the worker link: frames are binary msgpack")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise InvalidMessage(f"malformed msgpack: {str(e) or type(e).__name__}") from e
    if type(obj) is not dict:
        raise InvalidMessage(f"a link frame must be a map, got {show(obj)}")
    op = obj.pop("op", None)
    if type(op) is not str:
        if any(type(key) is not str for key in obj):
            raise InvalidMessage("link frame: map keys must be strings")
        raise InvalidMessage("a link frame needs a string field 'op'")
    cls = FRAME_CLASSES.get(op)
    if cls is None:
        raise InvalidMessage(f"unknown link op {op[:40]!r}")
    frame = from_wire(cls, obj, f"link {op}")
    _check(frame)
    return frame
