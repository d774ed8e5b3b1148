"""What one authenticated socket may do: admit its session, enforce its limits for the session's life.

Why per socket and not per session: the credential comes with the socket (the handshake), and the
gateway holding the socket is the one that sees every chunk and every `done`, so it can enforce the
limits without any Redis call on the hot path:

- at `session.open` / `session.resume` (Redis allowed): the key's daily budget, a slot among the
  key's concurrent sessions (gateway/auth/key_ledger.py), the browser token claimed by its one session,
  the session's deadline (from its creation time, so a resume does not restart the clock) and its
  token budget (from what it already spent);
- per chunk: one comparison of the key's known spend against its daily budget;
- per `done`: add the turn's tokens (in + out) to the local counts;
- a deadline: a `session.expiring` warning ahead of it, then the expiry (timers the session machine
  arms). A token budget warns at `TOKEN_WARN_FRACTION` and expires once spent.

It implements the machine's `SessionGuard` (gateway/session/guard.py): verdicts are returned, never
called back, and it reads no clock: the machine gives the time of each event (monotonic), the shell
gives admission an `Instant`, where the wall-clock deadline and the end of the UTC day become
monotonic times once. So its decisions are a function of what it is given (tested with made-up times
in tests/system/gateway/test_session_auth.py).

The limits a session lives under (`grant()`, an `AuthLimits`) are part of its session record,
written whole at open by the record's one owner (shared/store/registry.py) and carried to the worker,
which re-writes them with the rest of the record if Redis loses it; so whichever gateway a client
resumes through applies the same ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Final

from redis.exceptions import RedisError

from gateway.auth.api_keys import ApiKey, ms_until_next_day
from gateway.auth.client_tokens import ClientToken, ClientTokenStore
from gateway.auth.key_ledger import REFRESH_S, KeyLedger
from gateway.session.guard import Deadline, Expire, Instant, Verdict
from shared.errors import RateLimited, SessionExpired, Unauthorized
from shared.protocol.key_limits import AuthLimits, KeyLimits
from shared.protocol.messages import SessionExpiring
from shared.store.schema import KeySchema

logger = logging.getLogger(__name__)

# The duration warning comes this share of the session's allowed life ahead of the end, at most
# WARN_LEAD_MAX_S (Gemini Live's goAway comes ~60 s ahead; a micro-turn client needs less).
WARN_LEAD_FRACTION: Final = 0.2
WARN_LEAD_MAX_S: Final = 30.0
TOKEN_WARN_FRACTION: Final = 0.9
UNAUTHORIZED_MESSAGE: Final = "missing, invalid, revoked or expired credential"
SECONDS_PER_DAY: Final = 86400  # a UTC day (POSIX time has no leap seconds)


def _budget_spent(budget: int, retry_after_ms: int) -> RateLimited:
    """Recoverable: the same chunk or open succeeds once the UTC day turns (in `retry_after_ms`)."""
    return RateLimited(f"this key spent its {budget} tokens for today", retry_after_ms=max(1, retry_after_ms))


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a socket authenticated as: an API key, and the browser token it came through if any."""

    key: ApiKey
    token: ClientToken | None = None

    @property
    def granted(self) -> KeyLimits:
        """What a session it opens lives under: the token's granted limits (capped by the key's at
        mint) where it sets them, else the key's."""
        return self.key.limits.granted_under(self.token.limits if self.token is not None else None)


@dataclass(frozen=True, slots=True)
class AuthDeps:
    """The gateway-wide pieces a socket's auth uses (built once in the app's lifespan)."""

    schema: KeySchema
    ledger: KeyLedger
    tokens: ClientTokenStore
    session_ttl_s: float


class SessionAuth:
    """One socket's credential and the limits of the session it runs (at most one at a time)."""

    def __init__(self, principal: Principal, deps: AuthDeps) -> None:
        self.principal = principal
        self._d = deps
        self._sid: str | None = None
        self._claimed: str | None = None  # the sid this socket's browser token was claimed for
        self._started = False
        # Monotonic times, set at admission: the session's end (from its creation), the UTC day's end.
        self._deadline: float | None = None
        self._day_ends = 0.0
        self._limit_s = 0.0  # the session's allowed duration (0: none)
        self._max_tokens = 0
        self._used = 0
        self._token_warned = False

    @property
    def chunks_per_s(self) -> float:
        return self.principal.key.limits.chunks_per_s

    def limits_map(self) -> dict[str, int | float]:
        """What `session.opened` adds to its `limits` (only the limits that are set)."""
        granted = self.principal.granted
        limits: dict[str, int | float] = {
            name: value for name in KeyLimits.names(granted=True) if (value := getattr(granted, name))
        }
        if self.principal.key.limits.max_tokens_per_day:
            limits["max_tokens_per_day"] = self.principal.key.limits.max_tokens_per_day
        return limits

    # ---- open and resume (Redis) ------------------------------------------------------------------

    async def _admit(self, sid: str, at: Instant) -> None:
        # Read again at every open and resume: a key revoked (or re-limited) since the handshake is
        # refused (or limited) at its next open, not only on its next socket.
        key = await self._d.ledger.keys.by_digest(self.principal.key.digest)
        if key is None:
            raise Unauthorized(UNAUTHORIZED_MESSAGE)
        self.principal = dataclasses.replace(self.principal, key=key)
        budget = key.limits.max_tokens_per_day
        until_next_day_ms = ms_until_next_day(at.wall_s)
        if budget and await self._d.ledger.load_usage(key.digest) >= budget:
            raise _budget_spent(budget, until_next_day_ms)
        if not await self._d.ledger.admit(key.digest, sid, key.limits.max_sessions):
            raise RateLimited(
                f"this key already has {key.limits.max_sessions} sessions open",
                retry_after_ms=int(REFRESH_S * 1000),
            )
        self._sid = sid
        self._day_ends = at.monotonic_s + until_next_day_ms / 1000

    async def admit_open(self, sid: str, at: Instant) -> None:
        """Budget, slot, then the browser token's one session; raises with nothing held."""
        token = self.principal.token
        if token is not None and token.sid is not None:
            raise Unauthorized(UNAUTHORIZED_MESSAGE)
        await self._admit(sid, at)
        if token is not None:
            hold_s = self._d.session_ttl_s + self.principal.granted.max_session_s
            if not await self._d.tokens.claim(token, sid, hold_s):
                await self.release()
                raise Unauthorized(UNAUTHORIZED_MESSAGE)
            self._claimed = sid
        granted = self.principal.granted
        self._max_tokens, self._used, self._limit_s = granted.max_tokens, 0, granted.max_session_s
        self._deadline = at.monotonic_s + self._limit_s if self._limit_s else None

    def grant(self) -> AuthLimits:
        """The limits this session is opened under, as its record keeps them."""
        return AuthLimits.grant(self.principal.key.digest, self.principal.granted)

    async def admit_resume(self, sid: str, created_ms: int, granted: AuthLimits | None, at: Instant) -> None:
        """The session must be this key's (and this token's); its limits carry over, clock included."""
        token = self.principal.token
        if granted is None or granted.key_sha256 != self.principal.key.digest:
            raise Unauthorized(UNAUTHORIZED_MESSAGE)
        if token is not None and token.sid != sid:
            raise Unauthorized(UNAUTHORIZED_MESSAGE)
        max_session_s, max_tokens = granted.max_session_s, granted.max_tokens
        deadline = at.monotonic_at(created_ms / 1000 + max_session_s) if max_session_s else None
        if deadline is not None and deadline <= at.monotonic_s:
            raise SessionExpired(f"the session reached its maximum duration of {max_session_s:g} s")
        used = await self._d.ledger.session_used(sid) if max_tokens else 0
        if max_tokens and used >= max_tokens:
            raise SessionExpired(f"the session spent its budget of {max_tokens} tokens")
        await self._admit(sid, at)
        self._deadline, self._limit_s = deadline, max_session_s
        self._max_tokens, self._used = max_tokens, used

    # ---- the session's life (no Redis) ------------------------------------------------------------

    def start(self, now: float) -> tuple[Verdict, Deadline | None]:
        """The session is active on this socket: a resumed session already near its token budget is
        warned (or ended) at once; the deadline, if any, is for the caller's timers."""
        self._started = True
        verdict = self._check_budget(self._sid) if self._sid is not None and self._max_tokens else None
        if self._deadline is None or self._sid is None:
            return verdict, None
        left = self._deadline - now
        lead = min(WARN_LEAD_MAX_S, WARN_LEAD_FRACTION * self._limit_s)
        # A session resumed inside the warning window is warned at once: every socket that will see
        # `session_expired` sees the warning first.
        warn_in, warn_ms = max(0.0, left - lead), int(min(lead, max(left, 0.0)) * 1000)
        why = f"the session reached its maximum duration of {self._limit_s:g} s"
        warning = SessionExpiring(self._sid, "max_duration", expires_in_ms=warn_ms)
        return verdict, Deadline(warn_in, warning, max(0.0, left), Expire(why))

    def check_chunk(self, now: float) -> None:
        """Per chunk: a spent daily budget refuses it (recoverable, retry when the day turns)."""
        key = self.principal.key
        budget = key.limits.max_tokens_per_day
        if budget and self._d.ledger.spent(key.digest) >= budget:
            raise _budget_spent(budget, self._ms_until_day_ends(now))

    def _ms_until_day_ends(self, now: float) -> int:
        """Until the UTC day turns, from the day's end known at admission (a day later once passed)."""
        ends = self._day_ends
        if now >= ends:  # the session outlived the day it was admitted on
            ends += SECONDS_PER_DAY * (1 + (now - ends) // SECONDS_PER_DAY)
        return int((ends - now) * 1000)

    def on_done(self, tokens: int) -> Verdict:
        """Per `done`: count the turn's tokens; warn near the session's budget, expire at it."""
        if tokens <= 0:
            return None
        budgeted = self._max_tokens > 0
        self._d.ledger.charge(self.principal.key.digest, self._sid if budgeted else None, tokens)
        if not budgeted or self._sid is None:
            return None
        self._used += tokens
        return self._check_budget(self._sid)

    def _check_budget(self, sid: str) -> Verdict:
        if self._used >= self._max_tokens:
            return Expire(f"the session spent its budget of {self._max_tokens} tokens")
        if not self._token_warned and self._used >= TOKEN_WARN_FRACTION * self._max_tokens:
            self._token_warned = True
            return SessionExpiring(sid, "token_budget", tokens_left=self._max_tokens - self._used)
        return None

    async def release(self) -> None:
        """The session is over on this socket (or never started): its slot back."""
        sid, self._sid = self._sid, None
        claimed, self._claimed = self._claimed, None
        token = self.principal.token
        if claimed is not None and token is not None and not self._started:
            with contextlib.suppress(RedisError, OSError):
                await self._d.tokens.unclaim(token, claimed)
        if sid is not None:
            await self._d.ledger.release(self.principal.key.digest, sid)
