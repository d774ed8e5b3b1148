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
    # Warm copies of other workers' sessions built here for their drains, and those a restore took
    # over (worker/server/warm.py): a make-before-break handover landed.
    warm_copies: int = 0
    warm_adopted: int = 0
    # Of the warm copies, those whose KV came from the draining worker's pages (kv_receiver.py) and
    # those rebuilt from the log from nothing (the fallback, or `--drain-handover rebuild`).
    warm_from_pages: int = 0
    warm_rebuilds: int = 0
    # The KV copies this worker received and stored, and those it refused, by reason.
    kv_copies_received: int = 0
    kv_copies_refused: dict[str, int] = field(default_factory=dict)
    # A draining worker's side (kv_sender.py): copies sent and stored by their target, their bytes
    # and seconds (export to `kv_stored`), and the sessions that fell back to the rebuild, by reason.
    kv_copies_sent: int = 0
    kv_copy_bytes_sent: int = 0
    kv_copy_seconds: float = 0.0
    kv_copy_fallbacks: dict[str, int] = field(default_factory=dict)
    # Sessions a rebalance switched from here to a less-loaded worker (rebalance.py).
    sessions_rebalanced: int = 0
    # Queue plus compute time of each turn, in seconds.
    turn_latency: Histogram = field(default_factory=Histogram)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def kv_copy_refused(self, reason: str) -> None:
        self.kv_copies_refused[reason] = self.kv_copies_refused.get(reason, 0) + 1

    def kv_copy_fell_back(self, reason: str) -> None:
        self.kv_copy_fallbacks[reason] = self.kv_copy_fallbacks.get(reason, 0) + 1

    def render(self, stats: EngineStats) -> str:
        gauges = {
            "microturn_worker_sessions": stats.sessions,
            "microturn_worker_active_sessions": stats.active_sessions,
            "microturn_worker_kv_pages_used": stats.pages_used,
            "microturn_worker_kv_pages_free": stats.pages_free,
            "microturn_worker_links": self.links,
        }
        memory = stats.memory
        # Pages per tier: the device pool and the host tier (0 total: no host tier).
        tiers = {
            "device": (memory.device_pages_used, memory.device_pages_total),
            "host": (memory.host_pages_used, memory.host_pages_total),
        }
        prefix = memory.prefix
        if prefix is not None:  # the prefix cache is on (worker/engine/memory/prefix_cache.py)
            gauges["microturn_worker_prefix_cache_cached_pages"] = prefix.cached_pages
            gauges["microturn_worker_prefix_cache_shared_pages"] = prefix.shared_pages
            gauges["microturn_worker_prefix_cache_shared_references"] = prefix.shared_references
            gauges["microturn_worker_prefix_cache_host_pages"] = prefix.host_pages
            gauges["microturn_worker_prefix_cache_host_references"] = prefix.host_references
        lines = []
        for name, value in gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        counters: dict[str, float] = {
            "microturn_worker_turns_total": self.turns,
            "microturn_worker_steps_total": stats.steps,
            "microturn_worker_tokens_forwarded_total": stats.tokens_forwarded,
            "microturn_worker_kv_evictions_total": stats.kv_evictions,
            "microturn_worker_warm_copies_total": self.warm_copies,
            "microturn_worker_warm_adopted_total": self.warm_adopted,
            "microturn_worker_warm_from_pages_total": self.warm_from_pages,
            "microturn_worker_warm_rebuilds_total": self.warm_rebuilds,
            "microturn_worker_kv_copies_received_total": self.kv_copies_received,
            "microturn_worker_kv_copies_sent_total": self.kv_copies_sent,
            "microturn_worker_kv_copy_bytes_sent_total": self.kv_copy_bytes_sent,
            "microturn_worker_kv_copy_seconds_total": self.kv_copy_seconds,
            "microturn_worker_sessions_rebalanced_total": self.sessions_rebalanced,
            "microturn_worker_kv_offloads_total": memory.offloads.count,
            "microturn_worker_kv_offload_bytes_total": memory.offloads.bytes,
            "microturn_worker_kv_offload_seconds_total": memory.offloads.seconds,
            "microturn_worker_kv_restores_total": memory.restores.count,
            "microturn_worker_kv_restore_bytes_total": memory.restores.bytes,
            "microturn_worker_kv_restore_seconds_total": memory.restores.seconds,
            "microturn_worker_kv_recomputes_total": memory.recomputes,
            "microturn_worker_kv_recomputed_tokens_total": memory.recomputed_tokens,
        }
        if prefix is not None:
            counters["microturn_worker_prefix_cache_hits_total"] = prefix.hits
            counters["microturn_worker_prefix_cache_misses_total"] = prefix.misses
            counters["microturn_worker_prefix_cache_tokens_reused_total"] = prefix.tokens_reused
        for name, total in counters.items():
            lines += [f"# TYPE {name} counter", f"{name} {total}"]
        for name, index in (
            ("microturn_worker_kv_tier_pages_used", 0),
            ("microturn_worker_kv_tier_pages_total", 1),
        ):
            lines.append(f"# TYPE {name} gauge")
            lines += [f'{name}{{tier="{tier}"}} {pages[index]}' for tier, pages in tiers.items()]
        # An info gauge: which attention backend serves (its start-up check passed, or `torch`).
        lines += [
            "# TYPE microturn_worker_attention_backend gauge",
            f'microturn_worker_attention_backend{{backend="{stats.attention_backend}"}} 1',
        ]
        lines.append("# TYPE microturn_worker_errors_total counter")
        lines += [
            f'microturn_worker_errors_total{{code="{code}"}} {n}' for code, n in sorted(self.errors.items())
        ]
        for name, by_reason in (
            ("microturn_worker_kv_copy_fallbacks_total", self.kv_copy_fallbacks),
            ("microturn_worker_kv_copies_refused_total", self.kv_copies_refused),
        ):
            lines.append(f"# TYPE {name} counter")
            lines += [f'{name}{{reason="{reason}"}} {n}' for reason, n in sorted(by_reason.items())]
        lines += self.turn_latency.render("microturn_worker_turn_latency_seconds")
        return "\n".join(lines) + "\n"
