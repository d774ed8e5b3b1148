"""Prometheus text exposition for the worker, hand-rolled: a few counters and one histogram."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.metrics import Histogram
from worker.engine import EngineStats


@dataclass
class WorkerMetrics:
    turns: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    links: int = 0
    # Queue plus compute time of each turn, in seconds.
    turn_latency: Histogram = field(default_factory=Histogram)

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
        # An info gauge: which attention backend serves (its start-up check passed, or `torch`).
        lines += [
            "# TYPE microturn_worker_attention_backend gauge",
            f'microturn_worker_attention_backend{{backend="{stats.attention_backend}"}} 1',
        ]
        lines.append("# TYPE microturn_worker_errors_total counter")
        lines += [
            f'microturn_worker_errors_total{{code="{code}"}} {n}' for code, n in sorted(self.errors.items())
        ]
        lines += self.turn_latency.render("microturn_worker_turn_latency_seconds")
        return "\n".join(lines) + "\n"
