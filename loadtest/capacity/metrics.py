"""Scraping the worker's and the gateway's `/metrics` around a load step, to check Locust's counts.

What must agree for a step (every user drains its outputs before it stops, so nothing is in
flight when the second scrape is taken): each chunk Locust saw answered is one `output.done` the
gateway delivered and one turn the worker finished; each chunk failure Locust saw is one error
frame the gateway sent.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from typing import Final

_TIMEOUT_S: Final = 5.0


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name with its labels (`name{code="x"}`) -> value; comments and blank lines skipped."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        samples[name] = float(value)
    return samples


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
        return parse_prometheus(response.read().decode())


def total(samples: dict[str, float], name: str) -> float:
    """The sum over every label set of `name` (a counter without labels is its single sample)."""
    return sum(v for key, v in samples.items() if key == name or key.startswith(name + "{"))


def by_label(samples: dict[str, float], name: str) -> dict[str, float]:
    """`name{code="x"}` -> {"x": value}."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        if key.startswith(name + "{"):
            out[key[len(name) + 1 : -1].split('"')[1]] = value
    return out


@dataclass(frozen=True)
class Snapshot:
    gateway: dict[str, float]
    worker: dict[str, float]

    @classmethod
    def take(cls, gateway_url: str, worker_url: str) -> Snapshot:
        return cls(scrape(gateway_url + "/metrics"), scrape(worker_url + "/metrics"))


@dataclass(frozen=True)
class ServerCounts:
    """What the servers counted between two snapshots."""

    gateway_chunks: int  # chunks the gateway forwarded to the worker
    gateway_outputs: int  # output.done frames delivered to clients
    gateway_errors: int  # error frames sent to clients, any code
    gateway_errors_by_code: dict[str, int]
    worker_turns: int  # turns the worker finished (one per chunk)
    worker_errors: int
    worker_tokens_forwarded: int  # tokens through the model: the recompute work shows here

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot) -> ServerCounts:
        def delta(name: str, which: str) -> int:
            a, b = getattr(after, which), getattr(before, which)
            return round(total(a, name) - total(b, name))

        errors_name = "microturn_gateway_errors_total"
        old = by_label(before.gateway, errors_name)
        by_code = {c: round(v - old.get(c, 0.0)) for c, v in by_label(after.gateway, errors_name).items()}
        return cls(
            gateway_chunks=delta("microturn_gateway_chunks_forwarded_total", "gateway"),
            gateway_outputs=delta("microturn_gateway_outputs_total", "gateway"),
            gateway_errors=delta(errors_name, "gateway"),
            gateway_errors_by_code={c: n for c, n in by_code.items() if n},
            worker_turns=delta("microturn_worker_turns_total", "worker"),
            worker_errors=delta("microturn_worker_errors_total", "worker"),
            worker_tokens_forwarded=delta("microturn_worker_tokens_forwarded_total", "worker"),
        )
