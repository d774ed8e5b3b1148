"""Prometheus text exposition (format 0.0.4) helpers shared by the gateway and the worker.

Why hand-written: each process exports a handful of counters, a few gauges and one histogram, all
updated from one thread, so plain ints need no locks; a client library would add more code than it
saves. Updates are O(1) on the hot path; text is only built when `/metrics` is scraped.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Final

# Turn latency buckets in seconds: a CPU tiny-model turn is a few ms, a GPU 8B turn ~40-60 ms,
# anything past a few seconds is a stall worth seeing as such.
TURN_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Cumulative-bucket histogram in seconds; `observe` is one bisect and two additions."""

    __slots__ = ("_bounds", "_counts", "count", "total")

    def __init__(self, bounds: Sequence[float] = TURN_BUCKETS_S) -> None:
        if list(bounds) != sorted(bounds) or not bounds:
            raise ValueError("histogram bounds must be non-empty and ascending")
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self.count += 1
        self.total += value

    def render(self, name: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self._bounds, self._counts, strict=False):
            running += count
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total:.6f}")
        lines.append(f"{name}_count {self.count}")
        return lines
