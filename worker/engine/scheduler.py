"""Builds one step's ragged batch from the sessions that have tokens to feed. Pure Python, no torch.

Policy, for realtime latency: rows that decode one token go first (a turn in progress waits on
each), then appends shortest-first, so a long restore or re-prefill only takes the budget the
micro-turns leave; an append that does not fit is split and continues in the next step. While
other sessions have work too, an append is fed at most `max_append_piece` tokens a step: a long
re-prefill (a window cut, a restore from the log, a long prompt) is spread over steps that also
carry the other sessions' micro-turns, instead of making them all wait for one long step.
Background appends (a session warmed before a drain hands it over, `EngineCore.warm`) come after
every client row and, while clients have work, share one piece between them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from worker.engine.session import Session


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
        self, *, max_batch_tokens: int, max_batch_rows: int, max_append_piece: int | None = None
    ) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_rows = max_batch_rows
        self.max_append_piece = max_append_piece or max_batch_tokens

    def schedule(self, running: Iterable[Session]) -> ScheduledBatch | None:
        """`running`: sessions with an active turn, in activation order."""
        with_work = [s for s in running if s.uncached > 0]
        background = sorted((s for s in with_work if _is_background(s)), key=lambda s: s.uncached)
        foreground = [s for s in with_work if not _is_background(s)]
        decodes = [s for s in foreground if s.uncached == 1]
        appends = sorted((s for s in foreground if s.uncached > 1), key=lambda s: s.uncached)
        rows: list[ScheduledRow] = []
        budget = self.max_batch_tokens
        piece = self.max_append_piece if len(with_work) > 1 else budget
        background_budget = self.max_append_piece if foreground else budget
        queue = [(s, False) for s in decodes + appends] + [(s, True) for s in background]
        for session, is_background in queue:
            if budget == 0 or len(rows) == self.max_batch_rows or (is_background and background_budget == 0):
                break
            count = min(session.uncached, budget, piece, background_budget if is_background else budget)
            if is_background:
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
