"""The flows of a gateway session (open, resume, restore, close): which step awaits which result.

Why apart from machine.py: these are the values the machine keeps while a flow waits for an effect
or a worker's answer; the transitions themselves are all in machine.py.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

from shared.errors import MicroturnError
from shared.protocol.link import LinkOpened, ToWorker
from shared.protocol.messages import ServerMessage

# Workers tried for one open before giving up (placement charges each pick, so a dead worker that is
# still registered loses the next pick to a live one).
PLACEMENT_ATTEMPTS: Final = 3
# Pauses before each placement attempt of one restore (the first goes at once: suspects are skipped).
RESTORE_BACKOFF_S: Final = (0.0, 0.25, 0.5, 1.0)
# What a client is told to wait when the session store cannot be reached.
STORE_RETRY_MS: Final = 1000

# Builds the client's answer to an open/attach/restore from the worker's `opened`.
Reply: TypeAlias = Callable[[LinkOpened], list[ServerMessage]]


class Step(enum.Enum):
    """Which result the machine awaits: at most one effect or request at a time."""

    ADMIT_OPEN = "admit_open"
    PLACE = "place"  # a new session's record
    OPEN = "open"  # `opened` for an open
    DELETE_AFTER_OPEN = "delete_after_open"  # a failed open's keys; then retry or fail
    LOOKUP = "lookup"
    ADMIT_RESUME = "admit_resume"
    FIND_WORKER = "find_worker"
    ATTACH = "attach"  # `opened` for an attach
    MOVE = "move"  # a restore's placement
    RESTORE = "restore"  # `opened` for a restore
    BACKOFF = "backoff"  # the pause before the next restore attempt
    CLOSE = "close"  # `closed` for a close
    DELETE_AFTER_CLOSE = "delete_after_close"  # an unconfirmed close's keys


class Origin(enum.Enum):
    """Why a restore runs: the client's resume (its failure is the resume's), or a lost/draining
    worker under a live session (its failure ends this socket, not the session)."""

    RESUME = "resume"
    MOVE = "move"


@dataclass(slots=True)
class Flow:
    """The flow in progress and what its next step needs."""

    step: Step
    attempt: int = 0
    last: MicroturnError | None = None  # the last recoverable failure, reported if attempts run out
    reply: Reply | None = None  # the answer to the pending request's `opened`
    origin: Origin = Origin.MOVE
    seen_seq: int | None = None  # the last output seq the client saw (a restore's `seen_seq`)
    fail_with: MicroturnError | None = None  # raised once a failed open's keys are deleted
    frame: ToWorker | None = None  # the request awaiting `opened`
    replayed: int = 0  # undurable turns the restore frame carried
    target: str | None = None  # a move's first choice of worker (a drain's warm copy is there)
