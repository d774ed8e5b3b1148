"""Builds one step's ragged batch from the sessions that have tokens to feed. Pure Python, no torch.

Policy, for realtime latency: rows that decode one token go first (a turn in progress waits on
each), then appends shortest-first, so a long restore or re-prefill only takes the budget the
micro-turns leave; an append that does not fit is split and continues in the next step. An append
is fed at most `max_append_piece` tokens a step, whether or not other sessions have work at that
moment: a long re-prefill (a window cut, a restore from the log, a long prompt) is spread over
short steps, so a chunk that arrives while it runs waits for one piece, never for the whole
prefill. Background appends (a session warmed before a drain hands it over, `EngineCore.warm`)
come after every client row and share `max_background_piece` tokens a step between them: a copy
is nobody's turn yet.

Where the pieces ride depends on the device's cost model (`piggyback`):
- GPU (`piggyback=True`): a step's time hardly grows with its tokens until it is compute-bound,
  so pieces ride in the same steps as the micro-turns, for free (chunked prefill).
- CPU (`piggyback=False`): a step's time grows with every token, so a piece in a micro-turn's
  step makes that turn pay for somebody else's re-prefill. Long appends (more than one piece
  left) and background appends wait for a step with no client row (between micro-turns, which
  a realtime client leaves most of the time), or until they have waited `MAX_DEFERRED_STEPS`
  steps in a row, so they cannot starve under saturated load.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from worker.engine.session import Session

# CPU: how many steps in a row a long append or a warm copy may be held back for micro-turns before
# one of its pieces rides anyway. About one micro-turn's decode (its input step and ~8 outputs).
MAX_DEFERRED_STEPS: Final = 8


@dataclass(frozen=True)
class ScheduledRow:
    session: Session
    start: int  # the first fed token's position: the session's num_cached
    count: int
    # Whether this row's last position is sampled: it completes the pending tokens of a turn
    # that wants output.
    sample: bool


@dataclass(frozen=True)
class ScheduledBatch:
    rows: tuple[ScheduledRow, ...]

    @property
    def num_tokens(self) -> int:
        return sum(row.count for row in self.rows)


class Scheduler:
    def __init__(
        self,
        *,
        max_batch_tokens: int,
        max_batch_rows: int,
        max_append_piece: int | None = None,
        max_background_piece: int | None = None,
        piggyback: bool = True,
    ) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_rows = max_batch_rows
        self.max_append_piece = max_append_piece or max_batch_tokens
        self.max_background_piece = max_background_piece or self.max_append_piece
        self.piggyback = piggyback
        self._deferred_steps = 0  # consecutive steps that held long or background appends back

    def schedule(self, running: Iterable[Session]) -> ScheduledBatch | None:
        """`running`: sessions with an active turn, in activation order."""
        with_work = [s for s in running if s.uncached > 0]
        background = sorted((s for s in with_work if _is_background(s)), key=lambda s: s.uncached)
        foreground = [s for s in with_work if not _is_background(s)]
        decodes = [s for s in foreground if s.uncached == 1]
        appends = sorted((s for s in foreground if s.uncached > 1), key=lambda s: s.uncached)
        clients = decodes + [s for s in appends if s.uncached <= self.max_append_piece]
        held = len(clients) < len(foreground) or bool(background)  # long appends or copies to feed
        if held and clients and not self.piggyback and self._deferred_steps < MAX_DEFERRED_STEPS:
            self._deferred_steps += 1
            queue = [(s, False) for s in clients]
        else:
            self._deferred_steps = 0
            queue = [(s, False) for s in decodes + appends] + [(s, True) for s in background]
        rows: list[ScheduledRow] = []
        budget = self.max_batch_tokens
        background_budget = self.max_background_piece  # one piece a step, shared by every copy warming
        for session, is_background in queue:
            if budget == 0 or len(rows) == self.max_batch_rows or (is_background and background_budget == 0):
                break
            count = min(session.uncached, budget, self.max_append_piece)
            if is_background:
                count = min(count, background_budget)
                background_budget -= count
            turn = session.active
            completes = count == session.uncached
            rows.append(
                ScheduledRow(
                    session, session.num_cached, count, completes and turn is not None and turn.wants_output
                )
            )
            budget -= count
        return ScheduledBatch(tuple(rows)) if rows else None


def _is_background(session: Session) -> bool:
    return session.active is not None and session.active.background
