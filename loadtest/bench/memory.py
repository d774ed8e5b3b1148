"""Process memory figures: the claim to back is that a resident session's RSS stays flat as it grows.

The KV pool is allocated (and touched) up front, so a session's growing context should fill pages
of memory the process already holds; RSS climbing with turns would mean something allocates per
token outside the pool.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import psutil

MIB = 2**20


def rss_mib() -> float:
    """Resident set size of this process now."""
    return float(psutil.Process().memory_info().rss) / MIB


def peak_rss_mib() -> float:
    """Highest RSS this process has had (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024


@dataclass(frozen=True)
class RssSamples:
    """RSS after each streaming turn of session 0; the claim compares turn `early_turns` with the last.

    The whole series is kept (a psutil read costs microseconds) so a failed flatness check can be
    told apart: a step at one turn is an allocator keeping a buffer, a steady slope is per-token growth.
    """

    early_turns: int
    by_turn: tuple[float, ...]  # by_turn[i]: MiB after i + 1 turns

    @property
    def last_turns(self) -> int:
        return len(self.by_turn)

    @property
    def early_mib(self) -> float:
        return self.by_turn[self.early_turns - 1]

    @property
    def last_mib(self) -> float:
        return self.by_turn[-1]

    @property
    def ratio(self) -> float:
        return self.last_mib / self.early_mib

    def flat(self, tolerance: float) -> bool | None:
        """None when the run was too short to have a later sample than the early one."""
        if self.last_turns <= self.early_turns:
            return None
        return abs(self.ratio - 1.0) <= tolerance
