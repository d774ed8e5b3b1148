"""The `error` events of the dialect: what a client did wrong (or what failed underneath), with the
`event_id` of the client event it answers.

Why a typed exception: validation happens in several places (event parsing, the conversation's
limits) and every one of them must refuse *before* anything changes; raising `RealtimeProblem`
carries the answer up to the one place that turns it into a frame, and the socket stays open.
"""

from __future__ import annotations

from typing import Final

from shared.errors import ErrorCode
from shared.protocol.messages import CloseReason, Error

INVALID_REQUEST: Final = "invalid_request_error"
SERVER_ERROR: Final = "server_error"

# Native codes that are the server's trouble, not the client's request.
_SERVER_CODES: Final = frozenset(
    {ErrorCode.WORKER_UNAVAILABLE, ErrorCode.INTERNAL, ErrorCode.CAPACITY_EXHAUSTED}
)


class RealtimeProblem(Exception):
    """One `error` event to send; the dialect's state is as it was before the event that raised it."""

    def __init__(
        self,
        message: str,
        *,
        code: str = "invalid_value",
        param: str | None = None,
        kind: str = INVALID_REQUEST,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind


class BadEvent(RealtimeProblem):
    """A problem found while parsing a client event, with whatever `event_id` could be read."""

    def __init__(
        self, message: str, event_id: str | None, *, code: str = "invalid_value", param: str | None = None
    ):
        super().__init__(message, code=code, param=param)
        self.event_id = event_id


def problem_from_native(error: Error, what: str | None = None) -> RealtimeProblem:
    """A native `error` (from the session underneath) as the dialect's problem."""
    kind = SERVER_ERROR if error.code in _SERVER_CODES else INVALID_REQUEST
    message = error.message if what is None else f"{what}: {error.message}"
    if error.retry_after_ms is not None:
        message += f" (retry after {error.retry_after_ms} ms)"
    return RealtimeProblem(message, code=error.code.value, kind=kind)


# How the session's end reads to an OpenAI client: an `error` before the close (none for a close the
# client asked for).
_CLOSES: Final[dict[str, str]] = {
    "idle_timeout": "the session was idle too long and has ended",
    "evicted": "the session was evicted from its worker and has ended",
    "worker_lost": "the session's worker was lost and the session could not be restored",
    "taken_over": "the session was taken over by another connection",
}


def problem_from_close(reason: CloseReason) -> RealtimeProblem | None:
    message = _CLOSES.get(reason)
    return None if message is None else RealtimeProblem(message, code=reason, kind=SERVER_ERROR)
