"""Prometheus text exposition for the worker, hand-rolled: a few counters and one histogram."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from worker.engine import EngineStats

BUCKETS_MS = (5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2500.0, 5000.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = BUCKETS_MS
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_MS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return lines


@dataclass
class WorkerMetrics:
    turns: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    links: int = 0
    turn_ms: Histogram = field(default_factory=Histogram)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def render(self, stats: EngineStats) -> str:
        gauges = {
            "microturn_worker_sessions": stats.sessions,
            "microturn_worker_active_sessions": stats.active_sessions,
            "microturn_worker_kv_pages_used": stats.pages_used,
            "microturn_worker_kv_pages_free": stats.pages_free,
            "microturn_worker_links": self.links,
        }
        lines = []
        for name, value in gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        counters = {
            "microturn_worker_turns_total": self.turns,
            "microturn_worker_steps_total": stats.steps,
            "microturn_worker_tokens_forwarded_total": stats.tokens_forwarded,
            "microturn_worker_kv_evictions_total": stats.kv_evictions,
        }
        for name, value in counters.items():
            lines += [f"# TYPE {name} counter", f"{name} {value}"]
        lines.append("# TYPE microturn_worker_errors_total counter")
        lines += [
            f'microturn_worker_errors_total{{code="{code}"}} {n}' for code, n in sorted(self.errors.items())
        ]
        lines += self.turn_ms.render("microturn_worker_turn_ms")
        return "\n".join(lines) + "\n"
