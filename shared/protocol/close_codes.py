"""WebSocket close codes for fatal errors, and the `error` message built from a typed exception.

Why: after a fatal error the server sends an `error` message and closes the socket. The close code
repeats the error code, so a client that missed (or could not parse) the last message still knows
why it was dropped, and proxies and browser dev tools show it. Codes live in the 4000-4999 range
that RFC 6455 leaves to applications. Every error code has one, in the order of docs/design.md section 3:
any code can be fatal where there is no session to keep (e.g. `capacity_exhausted` on
`session.open`), and the four never-recoverable ones (`session_not_found`, `session_expired`,
`unauthorized`, `internal`) always are.

| close | error code           |   | close | error code           |
|-------|----------------------|---|-------|----------------------|
| 4000  | `invalid_message`    |   | 4007  | `context_full`       |
| 4001  | `unknown_type`       |   | 4008  | `capacity_exhausted` |
| 4002  | `bad_sequence`       |   | 4009  | `session_not_found`  |
| 4003  | `token_out_of_range` |   | 4010  | `session_expired`    |
| 4004  | `chunk_too_large`    |   | 4011  | `unauthorized`       |
| 4005  | `rate_limited`       |   | 4012  | `worker_unavailable` |
| 4006  | `backpressure`       |   | 4013  | `internal`           |

A session that ends normally (`session.closed` was sent) closes with 1000. No code here stands for a
server shutting down: a gateway leaves that close to uvicorn (1012, service restart), and clients
resume after any close that is not 4xxx (docs/protocol.md).
"""

from __future__ import annotations

from shared.errors import ErrorCode, MicroturnError
from shared.protocol.messages import Error

CLOSE_NORMAL = 1000
# RFC 6455 codes for a refused handshake: a bad link secret or an unknown subprotocol offer
# (1008), and a server that takes no connection now, e.g. a draining worker (1013).
CLOSE_POLICY_VIOLATION = 1008
CLOSE_TRY_AGAIN_LATER = 1013

CLOSE_CODES: dict[ErrorCode, int] = {
    ErrorCode.INVALID_MESSAGE: 4000,
    ErrorCode.UNKNOWN_TYPE: 4001,
    ErrorCode.BAD_SEQUENCE: 4002,
    ErrorCode.TOKEN_OUT_OF_RANGE: 4003,
    ErrorCode.CHUNK_TOO_LARGE: 4004,
    ErrorCode.RATE_LIMITED: 4005,
    ErrorCode.BACKPRESSURE: 4006,
    ErrorCode.CONTEXT_FULL: 4007,
    ErrorCode.CAPACITY_EXHAUSTED: 4008,
    ErrorCode.SESSION_NOT_FOUND: 4009,
    ErrorCode.SESSION_EXPIRED: 4010,
    ErrorCode.UNAUTHORIZED: 4011,
    ErrorCode.WORKER_UNAVAILABLE: 4012,
    ErrorCode.INTERNAL: 4013,
}

ERROR_CODES_BY_CLOSE: dict[int, ErrorCode] = {close: code for code, close in CLOSE_CODES.items()}


def close_code_for(code: ErrorCode) -> int:
    """The 4xxx close code for a fatal error with this code (`internal`'s for an unknown one)."""
    return CLOSE_CODES.get(code, CLOSE_CODES[ErrorCode.INTERNAL])


def error_code_for_close(close_code: int) -> ErrorCode | None:
    """The error code a 4xxx close code stands for (None for any other close code)."""
    return ERROR_CODES_BY_CLOSE.get(close_code)


def error_message_from(exc: MicroturnError, seq: int | None = None, *, fatal: bool | None = None) -> Error:
    """The `error` message for a typed exception.

    `fatal` defaults to the exception's class (`not recoverable`); pass True where the error ends
    the connection anyway, e.g. a malformed first message or no capacity at `session.open`.
    """
    return Error(
        code=exc.code,
        message=exc.message,
        fatal=not exc.recoverable if fatal is None else fatal,
        seq=seq,
        retry_after_ms=exc.retry_after_ms,
    )
