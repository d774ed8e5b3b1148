"""`open`: a worker whose device pool holds N sessions keeps 8N open, each resumable without a recompute.

The device pool (`kv_tokens`) holds N sessions of `length` tokens with room for their turns; the
host tier holds the rest. 8N sessions are built to `length` tokens, then `cycles` full cycles run:
each session takes one micro-turn in turn, so every turn resumes a session parked on the host
(the pool holds only the last N). Figures: the per-turn latency over the cycles (median, p99, max),
a warm turn of a session on the device for scale, and the counters: restores (one per resumed
turn), recomputes and drops (both must stay 0: no session lost its KV).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from loadtest.long_session.common import MemoryMark, Streamer, TurnShape, median, p99, pool_tokens, ratio
from worker.engine import Engine

logger = logging.getLogger(__name__)

OPEN_FACTOR = 8


@dataclass(frozen=True)
class OpenSessionsConfig:
    device_sessions: int = 4
    length: int = 512
    cycles: int = 2
    shape: TurnShape = field(default_factory=TurnShape)


def run_open(model: str, config: OpenSessionsConfig) -> dict[str, Any]:
    grows = config.shape.grows_by
    per_session = pool_tokens(config.length + (config.cycles + 2) * grows)
    opened = OPEN_FACTOR * config.device_sessions
    device = per_session * config.device_sessions
    with Engine.load(model, kv_tokens=device, host_kv_tokens=per_session * opened) as engine:
        sessions = [Streamer(engine, 100 + i, config.shape) for i in range(opened)]
        for session in sessions:
            session.build(config.length)
        before = MemoryMark.of(engine)
        cycle_ms = [session.turn()[0] for _ in range(config.cycles) for session in sessions]
        moved = MemoryMark.of(engine).since(before)
        last = sessions[-1]  # on the device after the last cycle
        warm_ms = median([last.turn()[0] for _ in range(3)])
        for session in sessions:
            session.close()
    figures = {
        "turn_median_ms": median(cycle_ms),
        "turn_p99_ms": p99(cycle_ms),
        "turn_max_ms": max(cycle_ms),
        "warm_turn_ms": warm_ms,
        "restore_gb_s": moved.restore_gb_s,
    }
    figures["median_vs_warm"] = ratio(figures["turn_median_ms"], warm_ms)
    counts = {
        "sessions_open": opened,
        "device_pool_sessions": config.device_sessions,
        "turns": len(cycle_ms),
        "restores": moved.restores,
        "offloads": moved.offloads,
        "recomputes": moved.recomputes,
        "drops": moved.drops,
    }
    logger.info("open: %s %s", figures, counts)
    return {
        "config": {
            "device_sessions": config.device_sessions,
            "length": config.length,
            "cycles": config.cycles,
            "kv_tokens": device,
            "host_kv_tokens": per_session * opened,
            "chunk_tokens": config.shape.chunk_tokens,
            "output_tokens": config.shape.output_tokens,
        },
        "figures": figures,
        "counts": counts,
        "targets": {
            f"{OPEN_FACTOR}N_open_without_recompute": counts["recomputes"] == 0 and counts["drops"] == 0
        },
    }
