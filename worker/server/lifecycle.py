"""The lifecycle of one worker-side session: its phases and every allowed move, in one place.

Why a table: a session here is changed by the link's frames (open, restore, close), the engine's
callbacks (opened, expired), a drain or a rebalance (switchover.py, handover.py, rebalance.py) and
another worker's move (warm.py, kv_receiver.py). Each of them moves the phase through
`SessionLifecycle.move`, which refuses a move the table does not allow with a typed internal error
(`IllegalTransition`), as gateway/session/lifecycle.py does for the gateway's side: a bug shows as an
error, never as a session in a phase no code expects.

The phases say what a chunk that arrives meets (worker/server/service.py `_chunk`): it waits while
the session OPENS, runs while it is READY or MOVING, and is left unanswered (the gateway holds it
in its undurable tail for the session's next worker) once it is SWITCHING or HANDED_OVER. A turn
that ends is answered and logged while the session is SERVED (READY, MOVING, or SWITCHING for the
turns in flight when the switch began); once HANDED_OVER it re-runs on the next worker. A COPY
answers no chunk at all: it is another worker's session, built here before its drain switches it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from shared.errors import InternalError


class Phase(enum.Enum):
    OPENING = "opening"  # the engine opens it (fresh, restored, or a copy taken over); chunks wait
    READY = "ready"  # served here
    MOVING = "moving"  # a drain or a rebalance makes its copy on another worker; still served here
    SWITCHING = "switching"  # its copy is warm: chunks in flight end here (briefly), later ones elsewhere
    HANDED_OVER = "handed_over"  # `migrate` is sent or on its way: nothing more is answered here
    COPY = "copy"  # another worker's session, warmed here for its drain: no link, no chunk, no log
    CLOSED = "closed"  # over here: closed, expired, failed to open, or a copy discarded


# Every allowed move; anything else is a bug (`IllegalTransition`).
TRANSITIONS: Final[Mapping[Phase, frozenset[Phase]]] = {
    # HANDED_OVER: a drain caught it still opening (its gateway is told to place it again).
    Phase.OPENING: frozenset({Phase.READY, Phase.HANDED_OVER, Phase.CLOSED}),
    Phase.READY: frozenset({Phase.MOVING, Phase.HANDED_OVER, Phase.CLOSED}),
    # MOVING straight to HANDED_OVER: its copy failed or was late, the classic handover takes it.
    # MOVING back to READY: a rebalance's copy failed or was late, and it stays (rebalance.py).
    Phase.MOVING: frozenset({Phase.SWITCHING, Phase.HANDED_OVER, Phase.CLOSED, Phase.READY}),
    Phase.SWITCHING: frozenset({Phase.HANDED_OVER, Phase.CLOSED}),
    Phase.HANDED_OVER: frozenset(),
    # OPENING: the gateway's restore takes the copy over and it becomes the live session.
    Phase.COPY: frozenset({Phase.OPENING, Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
}

# The phases of a session this worker holds for a client (the heartbeat refreshes its keys, an
# attach binds it, a drain hands it over).
LIVE: Final = frozenset({Phase.OPENING, Phase.READY, Phase.MOVING, Phase.SWITCHING})
# The phases in which a chunk is left unanswered: it is in the gateway's tail for the next worker.
HELD_ELSEWHERE: Final = frozenset({Phase.SWITCHING, Phase.HANDED_OVER})
# The phases in which a turn that ends is answered here and logged (sessions.py `log_turn`):
# SWITCHING's are the turns already in flight when the switch began.
SERVED: Final = frozenset({Phase.READY, Phase.MOVING, Phase.SWITCHING})


class IllegalTransition(InternalError):
    """A move the lifecycle table does not allow: a worker bug, reported as `internal`."""


class SessionLifecycle:
    """The phase of one worker-side session; `move` is the only way to change it."""

    __slots__ = ("phase",)

    def __init__(self, phase: Phase) -> None:
        self.phase = phase  # read freely; written only by `move`

    def move(self, to: Phase) -> None:
        if to not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"worker session: {self.phase.value} -> {to.value} is not allowed")
        self.phase = to

    @property
    def live(self) -> bool:
        return self.phase in LIVE
