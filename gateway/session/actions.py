"""What the session machine asks its caller to do: the actions it queues, and the timers it names.

Why values: the machine (machine.py) does no I/O, so every effect on the world is one of these,
drained in order by the asyncio shell (gateway/session/client_session.py) or read by a unit test. Three
kinds:
- messages: `SendClient`, `CloseSocket`, `SendWorker` (sent in the order queued);
- routing, timers and counts, done at once by the caller: `Bind`, `Unbind`, `ArmTimer`,
  `CancelTimer`, `Count` (the machine moves no metric itself: it says what to count);
- effects that await Redis or a worker (`Effect`), performed one at a time in order; each answers
  the machine with its result method (named on the class), or with `effect_failed`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from gateway.metric_families import Metric
from shared.protocol.key_limits import AuthLimits
from shared.protocol.link import ToWorker
from shared.protocol.messages import OpenConfig, ServerMessage

if TYPE_CHECKING:  # a value type only: the machine never reaches the store's I/O
    from shared.store.registry import SessionRecord


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """A worker as the link pool knows it: its link URL and its registry id."""

    url: str
    worker_id: str


class Timer(enum.Enum):
    REQUEST = "request"  # an open/attach/restore awaits the worker's `opened`
    CLOSE = "close"  # a `close` awaits the worker's `closed`
    BACKOFF = "backoff"  # the pause before the next placement attempt of a restore
    AUTH_WARN = "auth_warn"  # the credential's `session.expiring` warning
    AUTH_EXPIRE = "auth_expire"  # the credential's deadline


# ---- messages ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendClient:
    message: ServerMessage
    # When the turn's chunk arrived (monotonic s), for an `output.done`: the turn latency starts there.
    started: float | None = None


@dataclass(frozen=True, slots=True)
class CloseSocket:
    """Close the socket with `code` once everything queued before has been sent."""

    code: int


@dataclass(frozen=True, slots=True)
class SendWorker:
    """Send `frame` on the link to `worker`; dropped if the session has left that worker by then."""

    frame: ToWorker
    worker: WorkerRef


# ---- routing, timers and counts ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bind:
    """Route the session's frames from `worker`'s link to this socket (before a request is sent)."""

    sid: str
    worker: WorkerRef


@dataclass(frozen=True, slots=True)
class Unbind:
    sid: str


@dataclass(frozen=True, slots=True)
class ArmTimer:
    """Call `timer_fired(timer)` in `delay_s`; arming a timer again replaces it."""

    timer: Timer
    delay_s: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    timer: Timer


@dataclass(frozen=True, slots=True)
class Count:
    """Add `by` to the gateway's `metric` counter (a row of gateway/metric_families.py)."""

    metric: Metric
    by: int = 1


# ---- effects (one at a time, in order) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Place:
    """Pick a worker for a new session and write its record; answer `placed(record, url)`."""

    sid: str
    token: str
    config: OpenConfig
    auth: AuthLimits | None


@dataclass(frozen=True, slots=True)
class Move:
    """Pick a worker to restore the session on and point its record there; answer `placed`.
    `target`: that worker if it is live and ready (a drain warmed the session's copy there)."""

    sid: str
    record: SessionRecord
    config: OpenConfig
    target: str | None = None


@dataclass(frozen=True, slots=True)
class Lookup:
    """The record of a session to resume, once its token checks out; answer `looked_up`."""

    sid: str
    resume_token: str


@dataclass(frozen=True, slots=True)
class FindWorker:
    """The link URL of a live worker; answer `worker_found(url or None)`."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete the session's keys; answer `deleted()`."""

    sid: str


@dataclass(frozen=True, slots=True)
class AdmitOpen:
    """The credential admits a new session (budget, slot, token claim); answer `admitted()`."""

    sid: str


@dataclass(frozen=True, slots=True)
class AdmitResume:
    """The credential admits resuming this session under the limits it was granted; `admitted()`."""

    sid: str
    created_ms: int
    granted: AuthLimits | None


@dataclass(frozen=True, slots=True)
class ReleaseAuth:
    """The credential's slot for the session goes back (no answer)."""


@dataclass(frozen=True, slots=True)
class EndOnWorker:
    """Tell `worker` to end the session; if it cannot be reached, delete its keys (no answer)."""

    sid: str
    worker: WorkerRef


Effect: TypeAlias = (
    Place | Move | Lookup | FindWorker | Delete | AdmitOpen | AdmitResume | ReleaseAuth | EndOnWorker
)
Action: TypeAlias = (
    SendClient | CloseSocket | SendWorker | Bind | Unbind | ArmTimer | CancelTimer | Count | Effect
)
