"""The gateway's Prometheus metrics, hand-written (text exposition format 0.0.4).

Why no client library: the gateway needs a handful of counters, two gauges and one histogram, all
updated from the single asyncio thread, so plain ints need no locks; a dependency would add more
code than it saves. Updates are O(1) attribute or dict writes on the hot path; the text is only
built when `/metrics` is scraped.
"""

from __future__ import annotations

from collections import Counter

from shared.metrics import Histogram


class GatewayMetrics:
    """Every metric the gateway exports; one instance per app, mutated only on the event loop."""

    def __init__(self) -> None:
        self.sockets_open = 0
        self.sessions_active = 0
        self.sessions_opened = 0
        self.sessions_resumed = 0
        self.sessions_restored = 0
        self.chunks_forwarded = 0
        self.outputs_delivered = 0
        self.link_connects = 0
        self.link_reconnects = 0
        self.link_failures = 0
        self.workers_suspected = 0
        self.sessions_migrated = 0
        self.chunks_replayed = 0
        self.errors: Counter[str] = Counter()
        # Per socket dialect (gateway/dialect.py): counted in each dialect's encode path.
        self.dialect_sessions: Counter[str] = Counter()
        self.dialect_turns: Counter[str] = Counter()
        self.turn_latency = Histogram()

    def count(self, counter: str, by: int = 1) -> None:
        """Add to the int counter named `counter` (the session machine's `Count` actions name theirs)."""
        value = getattr(self, counter)
        if not isinstance(value, int):
            raise TypeError(f"{counter} is not a counter")
        setattr(self, counter, value + by)

    def error(self, code: str) -> None:
        self.errors[code] += 1

    def dialect_session(self, dialect: str) -> None:
        self.dialect_sessions[dialect] += 1

    def dialect_turn(self, dialect: str) -> None:
        self.dialect_turns[dialect] += 1

    def render(self) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float) -> None:
            out.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"))

        metric("microturn_gateway_sockets_open", "gauge", "Client WebSockets open.", self.sockets_open)
        metric(
            "microturn_gateway_sessions", "gauge", "Sessions bound to a socket here.", self.sessions_active
        )
        metric("microturn_gateway_sessions_opened_total", "counter", "Sessions opened.", self.sessions_opened)
        metric(
            "microturn_gateway_sessions_resumed_total",
            "counter",
            "Sessions resumed (attach or restore).",
            self.sessions_resumed,
        )
        metric(
            "microturn_gateway_sessions_restored_total",
            "counter",
            "Sessions rebuilt on another worker from the token log.",
            self.sessions_restored,
        )
        metric(
            "microturn_gateway_chunks_forwarded_total",
            "counter",
            "Input chunks forwarded to a worker.",
            self.chunks_forwarded,
        )
        metric(
            "microturn_gateway_outputs_total",
            "counter",
            "output.done messages delivered to clients.",
            self.outputs_delivered,
        )
        metric(
            "microturn_gateway_link_connects_total",
            "counter",
            "Worker link connections established.",
            self.link_connects,
        )
        metric(
            "microturn_gateway_link_reconnects_total",
            "counter",
            "Worker link connections re-established after a break.",
            self.link_reconnects,
        )
        metric(
            "microturn_gateway_link_failures_total",
            "counter",
            "Worker link connect attempts that failed or links that broke.",
            self.link_failures,
        )
        metric(
            "microturn_gateway_workers_suspected_total",
            "counter",
            "Workers this gateway stopped placing on after losing its link to them.",
            self.workers_suspected,
        )
        metric(
            "microturn_gateway_sessions_migrated_total",
            "counter",
            "Sessions moved off a draining worker (planned restores).",
            self.sessions_migrated,
        )
        metric(
            "microturn_gateway_chunks_replayed_total",
            "counter",
            "Chunks not yet durable handed to a restoring worker (replayed or re-appended).",
            self.chunks_replayed,
        )
        name = "microturn_gateway_errors_total"
        out += [f"# HELP {name} Error messages sent to clients, by code.", f"# TYPE {name} counter"]
        out += [f'{name}{{code="{code}"}} {count}' for code, count in sorted(self.errors.items())]
        for name, help_text, counts in (
            (
                "microturn_gateway_dialect_sessions_total",
                "Sessions opened, by client dialect.",
                self.dialect_sessions,
            ),
            (
                "microturn_gateway_dialect_turns_total",
                "Turns answered (native output.done, OpenAI response.done), by client dialect.",
                self.dialect_turns,
            ),
        ):
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            out += [f'{name}{{dialect="{dialect}"}} {count}' for dialect, count in sorted(counts.items())]
        name = "microturn_gateway_turn_latency_seconds"
        out += [f"# HELP {name} Chunk received from the client to its output.done sent, at the gateway."]
        out += self.turn_latency.render(name)
        return "\n".join(out) + "\n"
