"""Which session count to try next: double until a step fails, then bisect the gap.

Pure (results in, next count out) so the search is unit-tested without running anything. A step
passes when its p99 chunk latency is within the limit and Locust saw no failure. Results need not
be monotonic on a noisy machine: the answer is the largest passing count below the smallest
failing count above it.
"""

from __future__ import annotations


def best_passing(results: dict[int, bool]) -> int:
    """The largest passing count (0 if none passed)."""
    passed = [s for s, ok in results.items() if ok]
    return max(passed, default=0)


def next_sessions(results: dict[int, bool], max_sessions: int, start: int = 1) -> int | None:
    """The next count to run, or None when the answer is pinned down (or the cap reached)."""
    if not results:
        return min(start, max_sessions)
    lo = best_passing(results)
    above = [s for s, ok in results.items() if not ok and s > lo]
    if not above:
        if lo >= max_sessions:
            return None
        return min(max_sessions, lo * 2) if lo else None  # even the start failed: nothing below to try
    hi = min(above)
    # Resolve to 1/8 of the answer: more steps would cost minutes for noise-level differences.
    if hi - lo <= max(1, lo // 8):
        return None
    return (lo + hi) // 2
