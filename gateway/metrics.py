"""The gateway's Prometheus metrics, hand-written (text exposition format 0.0.4).

Why no client library: the gateway needs a handful of counters, two gauges and one histogram, all
updated from the single asyncio thread, so plain ints need no locks; a dependency would add more
code than it saves. Updates are O(1) dict writes on the hot path; the text is only built when
`/metrics` is scraped. Which counters and gauges exist, and how each is named and described, is
one table (gateway/metric_families.py); this module keeps their values.
"""

from __future__ import annotations

from collections import Counter

from gateway.metric_families import Metric
from shared.metrics import Histogram


class GatewayMetrics:
    """Every metric the gateway exports; one instance per app, mutated only on the event loop."""

    def __init__(self) -> None:
        self._values: dict[Metric, int] = {m: 0 for m in Metric if m.value.label is None}
        self._labelled: dict[Metric, Counter[str]] = {m: Counter() for m in Metric if m.value.label}
        self.turn_latency = Histogram()

    def count(self, metric: Metric, by: int = 1, *, label: str | None = None) -> None:
        """Add `by` to `metric` (the session machine's `Count` actions name theirs); a labelled
        family counts under its `label` value, and needs one."""
        if label is None:
            if metric not in self._values:
                raise TypeError(f"{metric.name} is counted by {metric.value.label}: give a label")
            self._values[metric] += by
        else:
            self._labelled[metric][label] += by

    def set(self, metric: Metric, value: int) -> None:
        """Set the gauge `metric`."""
        self._values[metric] = value

    def value(self, metric: Metric, label: str | None = None) -> int:
        return self._values[metric] if label is None else self._labelled[metric][label]

    def render(self) -> str:
        out: list[str] = []
        for metric in Metric:
            family = metric.value
            out += [f"# HELP {family.name} {family.help}", f"# TYPE {family.name} {family.kind}"]
            if family.label is None:
                out.append(f"{family.name} {self._values[metric]:g}")
            else:
                counts = self._labelled[metric]
                out += [f'{family.name}{{{family.label}="{key}"}} {n}' for key, n in sorted(counts.items())]
        name = "microturn_gateway_turn_latency_seconds"
        out += [f"# HELP {name} Chunk received from the client to its output.done sent, at the gateway."]
        out += self.turn_latency.render(name)
        return "\n".join(out) + "\n"
