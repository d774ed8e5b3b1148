"""What the session machine asks of a socket's credential, with no I/O: the seam to gateway/auth/.

Why a protocol here: the machine (machine.py) must not import the auth package (it reaches Redis);
`gateway.auth.session_auth.SessionAuth` implements this. Its answers are values the machine turns
into actions (a warning to the client, timers, an expiry), never callbacks.

Time comes in as an argument, never from a clock read here: the machine passes the monotonic time
of the event it is handling (`now`), and the shell passes an `Instant` (both clocks, read together)
to the credential's admission, where the wall-clock times of Redis (a session's creation, the UTC
day a budget counts in) are turned into monotonic ones once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeAlias

from shared.protocol.key_limits import AuthLimits
from shared.protocol.messages import SessionExpiring


@dataclass(frozen=True, slots=True)
class Instant:
    """One moment on both clocks, read together by the shell: `monotonic_s` (time.monotonic, the
    clock of the machine's events and timers) and `wall_s` (time.time: Redis records, the UTC day)."""

    monotonic_s: float
    wall_s: float

    def monotonic_at(self, wall_s: float) -> float:
        """A wall-clock moment on the monotonic clock (as the two stood at this instant)."""
        return self.monotonic_s + (wall_s - self.wall_s)


@dataclass(frozen=True, slots=True)
class Expire:
    """The session reached a limit of its credential: it ends, the client is told `why`."""

    why: str


# What a credential says after a turn or at the start: warn, end, or nothing.
Verdict: TypeAlias = SessionExpiring | Expire | None


@dataclass(frozen=True, slots=True)
class Deadline:
    """The session's duration limit, as two timers from now: the warning, then the end."""

    warn_in_s: float
    warning: SessionExpiring
    expire_in_s: float
    expiry: Expire


class SessionGuard(Protocol):
    @property
    def chunks_per_s(self) -> float:
        """The key's chunk rate (0: none); it caps the gateway's per-session rate."""
        ...

    def limits_map(self) -> dict[str, int | float]:
        """What `session.opened` adds to its `limits`."""
        ...

    def grant(self) -> AuthLimits:
        """The limits a session opened now lives under (written into its record)."""
        ...

    def start(self, now: float) -> tuple[Verdict, Deadline | None]:
        """The session became active on this socket at `now` (monotonic s): an immediate verdict,
        and its deadline."""
        ...

    def check_chunk(self, now: float) -> None:
        """Raise the typed error that refuses a chunk arriving at `now` (monotonic s; a spent daily
        budget), or nothing."""
        ...

    def on_done(self, tokens: int) -> Verdict:
        """Count a turn's tokens (in + out)."""
        ...
