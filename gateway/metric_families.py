"""Every counter and gauge the gateway exports, one row each: a new one is one row here.

Each `Metric` names its Prometheus family: the name, the type and the help line `/metrics` prints
(gateway/metrics.py keeps the values and renders them in this order), and for a labelled family
the label that splits it. Why a table apart from the values: the session machine names the
counters it moves in its `Count` actions (gateway/session/actions.py) but must not reach the
metrics themselves (tests/test_architecture.py), so the one list of names lives here, where both
read it. The turn-latency histogram is gateway/metrics.py's own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    kind: Literal["counter", "gauge"]
    help: str
    # A labelled family: one series per value of this label (counted with `label=`).
    label: str | None = None


class Metric(enum.Enum):
    SOCKETS_OPEN = Family("microturn_gateway_sockets_open", "gauge", "Client WebSockets open.")
    SESSIONS_ACTIVE = Family("microturn_gateway_sessions", "gauge", "Sessions bound to a socket here.")
    SESSIONS_OPENED = Family("microturn_gateway_sessions_opened_total", "counter", "Sessions opened.")
    SESSIONS_RESUMED = Family(
        "microturn_gateway_sessions_resumed_total", "counter", "Sessions resumed (attach or restore)."
    )
    SESSIONS_RESTORED = Family(
        "microturn_gateway_sessions_restored_total",
        "counter",
        "Sessions rebuilt on another worker from the token log.",
    )
    CHUNKS_FORWARDED = Family(
        "microturn_gateway_chunks_forwarded_total", "counter", "Input chunks forwarded to a worker."
    )
    OUTPUTS_DELIVERED = Family(
        "microturn_gateway_outputs_total", "counter", "output.done messages delivered to clients."
    )
    LINK_CONNECTS = Family(
        "microturn_gateway_link_connects_total", "counter", "Worker link connections established."
    )
    LINK_RECONNECTS = Family(
        "microturn_gateway_link_reconnects_total",
        "counter",
        "Worker link connections re-established after a break.",
    )
    LINK_FAILURES = Family(
        "microturn_gateway_link_failures_total",
        "counter",
        "Worker link connect attempts that failed or links that broke.",
    )
    WORKERS_SUSPECTED = Family(
        "microturn_gateway_workers_suspected_total",
        "counter",
        "Workers this gateway stopped placing on after losing its link to them.",
    )
    SESSIONS_MIGRATED = Family(
        "microturn_gateway_sessions_migrated_total",
        "counter",
        "Sessions moved off a draining worker (planned restores).",
    )
    CHUNKS_REPLAYED = Family(
        "microturn_gateway_chunks_replayed_total",
        "counter",
        "Chunks not yet durable handed to a restoring worker (replayed or re-appended).",
    )
    ERRORS = Family(
        "microturn_gateway_errors_total", "counter", "Error messages sent to clients, by code.", "code"
    )
    # Per socket dialect (gateway/dialect.py): counted in each dialect's encode path.
    DIALECT_SESSIONS = Family(
        "microturn_gateway_dialect_sessions_total",
        "counter",
        "Sessions opened, by client dialect.",
        "dialect",
    )
    DIALECT_TURNS = Family(
        "microturn_gateway_dialect_turns_total",
        "counter",
        "Turns answered (native output.done, OpenAI response.done), by client dialect.",
        "dialect",
    )
