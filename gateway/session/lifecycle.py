"""The lifecycle of one client socket's session: its phases and every allowed move, in one place.

Why a table: three contexts change a socket's phase (the receive loop, the link reader's callbacks
and the restore task), so the phases and the moves between them are declared here once and every
change goes through `SessionLifecycle.move`, which refuses a move the table does not allow with a
typed internal error (`IllegalTransition`): a bug shows as an `internal` error, never as a session
in a phase no code expects. What a *client* can ask for out of order is checked apart
(`SessionLifecycle.refusal`) and answered with a typed client error, as the protocol says.

Whether the worker still holds the session is part of the phase: `ENDED` (the socket ends, the
worker keeps the session until its idle timeout: detach it) versus `GONE` (closed, taken over,
expired, refused fatally or lost for good: nothing to detach or close). There is no separate flag.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from shared.errors import InternalError, InvalidMessage, MicroturnError


class Phase(enum.Enum):
    IDLE = "idle"  # no session yet: open or resume
    OPENING = "opening"  # open or resume in progress (awaits Redis and the worker's `opened`)
    ACTIVE = "active"  # chunks go to the session's worker
    RESTORING = "restoring"  # the worker was lost or drains; chunks are held until the new one answers
    CLOSING = "closing"  # `close` sent to the worker; awaiting its `closed`
    ENDED = "ended"  # the socket is closing; the worker still holds the session (detach it)
    GONE = "gone"  # the session is over on the worker side: nothing to detach or close


# Every allowed move; anything else is a bug (`IllegalTransition`).
TRANSITIONS: Final[Mapping[Phase, frozenset[Phase]]] = {
    Phase.IDLE: frozenset({Phase.OPENING, Phase.ENDED}),
    # Back to IDLE when the open or resume failed recoverably: the client may try again.
    Phase.OPENING: frozenset({Phase.IDLE, Phase.ACTIVE, Phase.ENDED, Phase.GONE}),
    Phase.ACTIVE: frozenset({Phase.RESTORING, Phase.CLOSING, Phase.ENDED, Phase.GONE}),
    Phase.RESTORING: frozenset({Phase.ACTIVE, Phase.ENDED, Phase.GONE}),
    Phase.CLOSING: frozenset({Phase.ENDED, Phase.GONE}),
    # A socket that is ending can still learn that the worker side is over (closed, taken over).
    Phase.ENDED: frozenset({Phase.GONE}),
    Phase.GONE: frozenset(),
}

_TERMINAL: Final = frozenset({Phase.ENDED, Phase.GONE})


class Request(enum.Enum):
    """What a client can ask of its session; `ping` is answered in every phase."""

    OPEN = "session.open/session.resume"
    CHUNK = "input.chunk"
    CANCEL = "output.cancel"
    REWIND = "session.rewind"
    CLOSE = "session.close"


# The phases in which each request is served (a chunk, a cancel or a rewind while RESTORING is held
# and goes right after the restore, in order; a close while RESTORING waits for the restore; a close
# while IDLE is answered `closed`). Elsewhere: `refusal`.
SERVED: Final[Mapping[Request, frozenset[Phase]]] = {
    Request.OPEN: frozenset({Phase.IDLE}),
    Request.CHUNK: frozenset({Phase.ACTIVE, Phase.RESTORING}),
    Request.CANCEL: frozenset({Phase.ACTIVE, Phase.RESTORING}),
    Request.REWIND: frozenset({Phase.ACTIVE, Phase.RESTORING}),
    Request.CLOSE: frozenset({Phase.IDLE, Phase.ACTIVE, Phase.RESTORING}),
}


class IllegalTransition(InternalError):
    """A move the lifecycle table does not allow, or a flow's step its phase does not allow
    (flows.py `STEPS`): a gateway bug, reported as `internal`."""


class SessionEnded(Exception):
    """The session ended (closed, taken over) while a request for it was in flight: already told."""


class SessionLifecycle:
    """The phase of one socket's session; `move` is the only way to change it."""

    __slots__ = ("phase",)

    def __init__(self, phase: Phase = Phase.IDLE) -> None:
        self.phase = phase  # read freely; written only by `move`

    def move(self, to: Phase) -> None:
        if to not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"session lifecycle: {self.phase.value} -> {to.value} is not allowed")
        self.phase = to

    def end_socket(self) -> None:
        """The socket ends; the worker keeps the session unless it is already over (then GONE stays)."""
        if self.phase not in _TERMINAL:
            self.move(Phase.ENDED)

    def end_session(self) -> None:
        """The session is over on the worker side (it said so, or it cannot be reached for good)."""
        if self.phase is not Phase.GONE:
            self.move(Phase.GONE)

    @property
    def ended(self) -> bool:
        """The socket is ending (whether or not the worker still holds the session)."""
        return self.phase in _TERMINAL

    @property
    def gone(self) -> bool:
        """The worker side is over: no `detach`, no `close` to send."""
        return self.phase is Phase.GONE

    def check(self, request: Request) -> None:
        """Raise the typed client error for `request` unless this phase serves it."""
        refusal = self.refusal(request)
        if refusal is not None:
            raise refusal

    def refusal(self, request: Request) -> MicroturnError | None:
        """The typed client error for `request` in this phase; None when it is served."""
        phase = self.phase
        if phase in SERVED[request]:
            return None
        if request is Request.OPEN:
            return InvalidMessage(f"this socket already has a session ({phase.value})")
        if request is Request.CHUNK:
            first = "send session.open or session.resume first"
            return InvalidMessage(f"no active session ({phase.value}): {first}")
        if request is Request.CLOSE:
            return InvalidMessage(f"no active session to close ({phase.value})")
        return InvalidMessage(f"no active session ({phase.value})")
