"""Typed reading of one decoded map (a client message, a session config), Sans-I/O.

Split from codec.py: every accessor here checks one field's type and range and, on failure, raises
`InvalidMessage` naming the map and the field (or `TokenOutOfRange` for a token id that cannot be
one). Strings, including map keys and anything nested in a free-form value, must be valid Unicode:
a lone surrogate never gets past a reader (see codec.py's docstring).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TypeVar

from shared.errors import ErrorCode, InvalidMessage, TokenOutOfRange

# Largest integer a JavaScript client holds exactly: the bound for seq, counts and lengths.
MAX_INT = 2**53 - 1
# The token log stores little-endian uint32.
MAX_TOKEN_ID = 2**32 - 1

_ERROR_CODES = frozenset(code.value for code in ErrorCode)
_T = TypeVar("_T")


def is_valid_text(value: str) -> bool:
    """False for a str holding a lone surrogate (no UTF-8 encoder accepts it)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def show(value: object) -> str:
    """A short description of a bad value for an error message (never a huge repr)."""
    if value is None or type(value) in (bool, int, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value[:40] + ("..." if len(value) > 40 else ""))
    return type(value).__name__


class FieldReader:
    """Reads typed fields off one decoded map; every error names the map and the field.

    Call `done()` last: it refuses keys that no accessor asked for.
    """

    __slots__ = ("_map", "_seen", "_where")

    def __init__(self, obj: object, where: str, *, seen: Iterable[str] = (), checked: bool = False) -> None:
        if type(obj) is not dict:
            raise InvalidMessage(f"{where} must be a map, got {show(obj)}")
        if not checked:  # `checked`: the caller already made a reader over this very map
            for key in obj:
                if type(key) is not str:
                    raise InvalidMessage(f"{where}: map keys must be strings, got {show(key)}")
                if not is_valid_text(key):
                    raise InvalidMessage(f"{where}: field {key!r} is not valid Unicode (a lone surrogate)")
        self._map: dict[str, object] = obj
        self._where = where
        self._seen = set(seen)

    def _get(self, key: str, required: bool) -> object:
        self._seen.add(key)
        value = self._map.get(key)
        if value is None:  # absent or null
            if required:
                raise InvalidMessage(f"{self._where}: missing field '{key}'")
            return None
        return value

    def _bad(self, key: str, want: str, value: object) -> InvalidMessage:
        return InvalidMessage(f"{self._where}: field '{key}' must be {want}, got {show(value)}")

    def _int(self, key: str, value: object, lo: int, hi: int) -> int:
        if type(value) is not int or not lo <= value <= hi:
            raise self._bad(key, f"an integer in [{lo}, {hi}]", value)
        return value

    def _float(self, key: str, value: object, lo: float, hi: float, lo_open: bool = False) -> float:
        if type(value) is not float and type(value) is not int:
            raise self._bad(key, "a number", value)
        number = float(value)
        if not (math.isfinite(number) and (lo < number if lo_open else lo <= number) and number <= hi):
            low = "" if lo == -math.inf else f"{'>' if lo_open else '>='} {lo}"
            high = "" if hi == math.inf else f"<= {hi}"
            raise self._bad(
                key, " ".join(["a finite number", " and ".join(filter(None, (low, high)))]), value
            )
        return number

    def _text(self, key: str, value: str) -> str:
        if not is_valid_text(value):
            raise InvalidMessage(f"{self._where}: field '{key}' is not valid Unicode (a lone surrogate)")
        return value

    def _plain(self, key: str, value: object) -> object:
        """Check an arbitrary value (a ping's `data`): valid strings and keys, finite floats."""
        if type(value) is str:
            self._text(key, value)
        elif type(value) is float:
            if not math.isfinite(value):
                raise self._bad(key, "free of non-finite numbers", value)
        elif type(value) is list or type(value) is tuple:
            for item in value:
                self._plain(key, item)
        elif type(value) is dict:
            for name, item in value.items():
                self._plain(key, name)
                self._plain(key, item)
        return value

    def _tokens(self, key: str, value: object) -> tuple[int, ...]:
        if type(value) is not list and type(value) is not tuple:
            raise self._bad(key, "a list of integers", value)
        for item in value:
            if type(item) is not int:
                raise self._bad(key, "a list of integers", item)
            if not 0 <= item <= MAX_TOKEN_ID:
                raise TokenOutOfRange(f"{self._where}: token {show(item)} in '{key}' is not a token id")
        return tuple(value)

    def _ints(self, key: str, value: object, lo: int, hi: int) -> tuple[int, ...]:
        if type(value) is not list and type(value) is not tuple:
            raise self._bad(key, "a list of integers", value)
        for item in value:
            if type(item) is not int or not lo <= item <= hi:
                raise self._bad(key, f"a list of integers in [{lo}, {hi}]", item)
        return tuple(value)

    def _floats(self, key: str, value: object) -> tuple[float, ...]:
        if type(value) is not list and type(value) is not tuple:
            raise self._bad(key, "a list of numbers", value)
        return tuple(self._float(key, item, -math.inf, math.inf) for item in value)

    def _opt(self, key: str, convert: Callable[[object], _T]) -> _T | None:
        value = self._get(key, False)
        return None if value is None else convert(value)

    def integer(self, key: str, lo: int = 0, hi: int = MAX_INT) -> int:
        return self._int(key, self._get(key, True), lo, hi)

    def opt_integer(self, key: str, lo: int = 0, hi: int = MAX_INT) -> int | None:
        return self._opt(key, lambda v: self._int(key, v, lo, hi))

    def number(self, key: str, lo: float = 0.0, hi: float = math.inf, *, lo_open: bool = False) -> float:
        """A finite int or float, returned as float; ints are accepted where a float is allowed."""
        return self._float(key, self._get(key, True), lo, hi, lo_open)

    def opt_number(
        self, key: str, lo: float = 0.0, hi: float = math.inf, *, lo_open: bool = False
    ) -> float | None:
        return self._opt(key, lambda v: self._float(key, v, lo, hi, lo_open))

    def number_values(self) -> dict[str, int | float]:
        """Every value of the map as a number (ints stay ints), e.g. `limits`."""
        out: dict[str, int | float] = {}
        for key, value in self._map.items():
            self._seen.add(key)
            out[key] = value if type(value) is int else self._float(key, value, -math.inf, math.inf)
        return out

    def boolean(self, key: str) -> bool:
        value = self._get(key, True)
        if type(value) is not bool:
            raise self._bad(key, "a boolean", value)
        return value

    def opt_boolean(self, key: str) -> bool | None:
        return None if self._get(key, False) is None else self.boolean(key)

    def string(self, key: str, *, nonempty: bool = False) -> str:
        value = self._get(key, True)
        if type(value) is not str or (nonempty and not value):
            raise self._bad(key, "a non-empty string" if nonempty else "a string", value)
        return self._text(key, value)

    def opt_string(self, key: str) -> str | None:
        return None if self._get(key, False) is None else self.string(key)

    def choice(self, key: str, choices: tuple[str, ...]) -> str:
        value = self._get(key, True)
        if type(value) is not str or value not in choices:
            raise self._bad(key, "one of " + ", ".join(choices), value)
        return value

    def opt_choice(self, key: str, choices: tuple[str, ...]) -> str | None:
        return None if self._get(key, False) is None else self.choice(key, choices)

    def token_ids(self, key: str) -> tuple[int, ...] | None:
        """An optional list of token ids: wrong types are `invalid_message`, ids outside [0, 2**32)
        `token_out_of_range` (as one past the model's vocabulary is, on the worker)."""
        return self._opt(key, lambda v: self._tokens(key, v))

    def value(self, key: str) -> object:
        """Any value (None when absent), checked to be encodable again: strings, keys, floats."""
        return self._plain(key, self._get(key, False))

    def integers(self, key: str, lo: int = 0, hi: int = MAX_TOKEN_ID) -> tuple[int, ...]:
        return self._ints(key, self._get(key, True), lo, hi)

    def opt_integers(self, key: str, lo: int = 0, hi: int = MAX_TOKEN_ID) -> tuple[int, ...] | None:
        return self._opt(key, lambda v: self._ints(key, v, lo, hi))

    def numbers(self, key: str) -> tuple[float, ...]:
        return self._floats(key, self._get(key, True))

    def opt_numbers(self, key: str) -> tuple[float, ...] | None:
        return self._opt(key, lambda v: self._floats(key, v))

    def has(self, key: str) -> bool:
        return key in self._map

    def raw(self, key: str) -> object:
        """Any value, unchecked (None when absent)."""
        return self._get(key, False)

    def submap(self, key: str, *, required: bool = True) -> FieldReader | None:
        value = self._get(key, required)
        return None if value is None else FieldReader(value, f"{self._where}.{key}")

    def error_code(self, key: str) -> ErrorCode:
        value = self._get(key, True)
        if type(value) is str and value in _ERROR_CODES:
            return ErrorCode(value)
        raise self._bad(key, "a known error code", value)

    def done(self) -> None:
        unknown = [key for key in self._map if key not in self._seen]
        if unknown:
            raise InvalidMessage(f"{self._where}: unknown field(s) {', '.join(sorted(unknown))}")
