"""Error codes of the client protocol (docs/design.md section 3) and the typed exceptions that carry them.

The engine, the worker link and the gateway all raise `MicroturnError` subclasses; the wire layer
turns one into an `error` message with the same `code`. A recoverable error never changes the
session it names: every check that can raise one runs before anything is mutated.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class ErrorCode(StrEnum):
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_TYPE = "unknown_type"
    BAD_SEQUENCE = "bad_sequence"
    TOKEN_OUT_OF_RANGE = "token_out_of_range"
    CHUNK_TOO_LARGE = "chunk_too_large"
    RATE_LIMITED = "rate_limited"
    BACKPRESSURE = "backpressure"
    CONTEXT_FULL = "context_full"
    CAPACITY_EXHAUSTED = "capacity_exhausted"
    SESSION_NOT_FOUND = "session_not_found"
    SESSION_EXPIRED = "session_expired"
    UNAUTHORIZED = "unauthorized"
    WORKER_UNAVAILABLE = "worker_unavailable"
    INTERNAL = "internal"


# Every typed error by its code (filled as the classes below are declared): what a receiving side
# rebuilds from an `error` message's code.
ERROR_TYPES: dict[ErrorCode, type[MicroturnError]] = {}


class MicroturnError(Exception):
    """Base of every typed error; `code` is the protocol's error code.

    A subclass names its code (and whether the session survives it) in its class line, which also
    registers it in `ERROR_TYPES`: `class Backpressure(MicroturnError, code=ErrorCode.BACKPRESSURE)`.
    """

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL
    # Whether the session stays usable after this error (the protocol's `fatal` is the negation).
    recoverable: ClassVar[bool] = True

    def __init_subclass__(cls, *, code: ErrorCode, recoverable: bool = True, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.code, cls.recoverable = code, recoverable
        ERROR_TYPES[code] = cls

    def __init__(self, message: str, *, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class InvalidMessage(MicroturnError, code=ErrorCode.INVALID_MESSAGE):
    pass


class UnknownType(MicroturnError, code=ErrorCode.UNKNOWN_TYPE):
    pass


class BadSequence(MicroturnError, code=ErrorCode.BAD_SEQUENCE):
    pass


class TokenOutOfRange(MicroturnError, code=ErrorCode.TOKEN_OUT_OF_RANGE):
    pass


class ChunkTooLarge(MicroturnError, code=ErrorCode.CHUNK_TOO_LARGE):
    pass


class RateLimited(MicroturnError, code=ErrorCode.RATE_LIMITED):
    pass


class Backpressure(MicroturnError, code=ErrorCode.BACKPRESSURE):
    pass


class ContextFull(MicroturnError, code=ErrorCode.CONTEXT_FULL):
    pass


class CapacityExhausted(MicroturnError, code=ErrorCode.CAPACITY_EXHAUSTED):
    pass


class SessionNotFound(MicroturnError, code=ErrorCode.SESSION_NOT_FOUND, recoverable=False):
    pass


class SessionExpired(MicroturnError, code=ErrorCode.SESSION_EXPIRED, recoverable=False):
    pass


class Unauthorized(MicroturnError, code=ErrorCode.UNAUTHORIZED, recoverable=False):
    pass


class WorkerUnavailable(MicroturnError, code=ErrorCode.WORKER_UNAVAILABLE):
    pass


class InternalError(MicroturnError, code=ErrorCode.INTERNAL, recoverable=False):
    pass


def error_from_code(code: str, message: str, *, retry_after_ms: int | None = None) -> MicroturnError:
    """Rebuild the typed error on the receiving side of a link; unknown codes become `internal`."""
    try:
        cls = ERROR_TYPES[ErrorCode(code)]
    except ValueError:
        cls = InternalError
    return cls(message, retry_after_ms=retry_after_ms)
