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


class MicroturnError(Exception):
    """Base of every typed error; `code` is the protocol's error code."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL
    # Whether the session stays usable after this error (the protocol's `fatal` is the negation).
    recoverable: ClassVar[bool] = True

    def __init__(self, message: str, *, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class InvalidMessage(MicroturnError):
    code = ErrorCode.INVALID_MESSAGE


class UnknownType(MicroturnError):
    code = ErrorCode.UNKNOWN_TYPE


class BadSequence(MicroturnError):
    code = ErrorCode.BAD_SEQUENCE


class TokenOutOfRange(MicroturnError):
    code = ErrorCode.TOKEN_OUT_OF_RANGE


class ChunkTooLarge(MicroturnError):
    code = ErrorCode.CHUNK_TOO_LARGE


class RateLimited(MicroturnError):
    code = ErrorCode.RATE_LIMITED


class Backpressure(MicroturnError):
    code = ErrorCode.BACKPRESSURE


class ContextFull(MicroturnError):
    code = ErrorCode.CONTEXT_FULL


class CapacityExhausted(MicroturnError):
    code = ErrorCode.CAPACITY_EXHAUSTED


class SessionNotFound(MicroturnError):
    code = ErrorCode.SESSION_NOT_FOUND
    recoverable = False


class SessionExpired(MicroturnError):
    code = ErrorCode.SESSION_EXPIRED
    recoverable = False


class Unauthorized(MicroturnError):
    code = ErrorCode.UNAUTHORIZED
    recoverable = False


class WorkerUnavailable(MicroturnError):
    code = ErrorCode.WORKER_UNAVAILABLE


class InternalError(MicroturnError):
    code = ErrorCode.INTERNAL
    recoverable = False


ERROR_TYPES: dict[ErrorCode, type[MicroturnError]] = {
    cls.code: cls
    for cls in (
        InvalidMessage,
        UnknownType,
        BadSequence,
        TokenOutOfRange,
        ChunkTooLarge,
        RateLimited,
        Backpressure,
        ContextFull,
        CapacityExhausted,
        SessionNotFound,
        SessionExpired,
        Unauthorized,
        WorkerUnavailable,
        InternalError,
    )
}


def error_from_code(code: str, message: str, *, retry_after_ms: int | None = None) -> MicroturnError:
    """Rebuild the typed error on the receiving side of a link; unknown codes become `internal`."""
    try:
        cls = ERROR_TYPES[ErrorCode(code)]
    except ValueError:
        cls = InternalError
    return cls(message, retry_after_ms=retry_after_ms)
