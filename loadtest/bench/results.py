"""What one mode measured, and the summary numbers the report compares.

Latencies are kept per (turn, session) rather than pre-aggregated so the JSON carries the raw
grid and every summary can be recomputed from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Turn 0 is excluded from the averages: it pays one-time costs (first-call allocations, the
# empty-cache path) that say nothing about steady-state micro-turns.
HEAD_TURNS = 10
TAIL_TURNS = 10


@dataclass
class ModeRun:
    """Raw results of one mode: `turn_ms[t][s]` is None for turns the mode did not time."""

    name: str
    turn_ms: list[list[float | None]]
    wall_s: float = 0.0
    # Turns whose outputs were compared with streaming's, and those that differed, as (session, turn).
    checked: int = 0
    mismatches: list[tuple[int, int]] = field(default_factory=list)
    # Of `mismatches`, those whose every differing token was a near-tie (hf mode: config.py).
    near_ties: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def empty(cls, name: str, *, sessions: int, turns: int) -> ModeRun:
        return cls(name, [[None] * sessions for _ in range(turns)])

    @property
    def timed_turns(self) -> list[int]:
        """Turns timed in every session (modes time the same turns in all sessions)."""
        return [t for t, row in enumerate(self.turn_ms) if row and all(ms is not None for ms in row)]

    def turn_mean_ms(self, turn: int) -> float:
        """Latency of one turn averaged over sessions."""
        values = [ms for ms in self.turn_ms[turn] if ms is not None]
        if len(values) != len(self.turn_ms[turn]):
            raise ValueError(f"{self.name}: turn {turn} was not timed in every session")
        return sum(values) / len(values)


@dataclass(frozen=True)
class ModeSummary:
    """None where a mode timed too few turns for the figure (a one-turn run has no steady state)."""

    avg_ms: float | None
    head10_ms: float | None
    last10_ms: float | None
    tail_head: float | None
    timed_turns: tuple[int, ...]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(run: ModeRun) -> ModeSummary:
    timed = run.timed_turns
    steady = [t for t in timed if t != 0]
    avg = _mean([run.turn_mean_ms(t) for t in steady])
    head = _mean([run.turn_mean_ms(t) for t in steady[:HEAD_TURNS]])
    last = _mean([run.turn_mean_ms(t) for t in timed[-TAIL_TURNS:]])
    tail_head = last / head if last is not None and head else None
    return ModeSummary(avg, head, last, tail_head, tuple(timed))


def speedup(baseline_ms: float | None, other_ms: float | None) -> float | None:
    """How many times faster the baseline is than `other` (None when either is missing)."""
    if baseline_ms is None or other_ms is None or baseline_ms <= 0 or not math.isfinite(other_ms):
        return None
    return other_ms / baseline_ms
