"""`first_turn`: the first turn of a session whose P-token prefix is cached, against a warm micro-turn.

For each P, an engine with the cache on and one with it off, in one process. The cache is seeded by
one session (untimed); then, interleaved sample by sample: a new session's first turn on each
engine (the prefix and `chunk_tokens` of its own, `output_tokens` out), and a warm micro-turn of
the same size on the seeding session. Targets (issue #33): the cached first turn at most 1.3x the
warm micro-turn; the full prefill (cache off) for scale.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from loadtest.long_session.common import TurnShape, median, pool_tokens, ratio, tokens
from worker.engine import Engine

# The bound: a cached first turn costs at most this many warm micro-turns of its size.
FIRST_TURN_TARGET = 1.3


@dataclass(frozen=True)
class FirstTurnConfig:
    prefixes: tuple[int, ...] = (1024, 2048)
    samples: int = 4
    shape: TurnShape = field(default_factory=TurnShape)


def engines(model: str, prefix: int, sessions: int, shape: TurnShape) -> tuple[Engine, Engine]:
    """The cache-on and cache-off engines, each with room for `sessions` unshared sessions (no
    host tier: nothing is parked) and chunks as long as the prefix and a turn."""
    chunk = prefix + shape.chunk_tokens
    options: dict[str, Any] = {
        "kv_tokens": pool_tokens((prefix + 4 * shape.grows_by) * sessions),
        "host_kv_tokens": 0,
        "max_chunk_tokens": chunk,
        "max_pending_tokens": chunk,
    }
    return Engine.load(model, prefix_cache="on", **options), Engine.load(model, prefix_cache="off", **options)


def timed_turn(engine: Engine, sid: str, chunk: list[int], outputs: int) -> float:
    began = time.perf_counter()
    engine.run_turn(sid, tokens=chunk, max_output_tokens=outputs, timeout=3600)
    return (time.perf_counter() - began) * 1000


def run_first_turn(model: str, config: FirstTurnConfig) -> dict[str, Any]:
    shape = config.shape
    report: dict[str, Any] = {}
    for prefix_tokens in config.prefixes:
        prefix = tokens(0, 0, prefix_tokens)
        on, off = engines(model, prefix_tokens, config.samples + 2, shape)
        with on, off:
            seed = on.open_session(stop_token_ids=())
            on.run_turn(
                seed, tokens=prefix + tokens(1, 0, shape.chunk_tokens), max_output_tokens=0, timeout=3600
            )
            cached_ms: list[float] = []
            full_ms: list[float] = []
            warm_ms: list[float] = []
            for k in range(config.samples):
                own = prefix + tokens(10 + k, 0, shape.chunk_tokens)
                for engine, times in ((on, cached_ms), (off, full_ms)):
                    sid = engine.open_session(stop_token_ids=())
                    times.append(timed_turn(engine, sid, own, shape.output_tokens))
                    engine.close_session(sid)
                warm = tokens(1, shape.chunk_tokens * (k + 1), shape.chunk_tokens)
                warm_ms.append(timed_turn(on, seed, warm, shape.output_tokens))
            prefix_stats = on.stats().memory.prefix
        assert prefix_stats is not None
        report[f"P{prefix_tokens}"] = {
            "cached_first_turn_ms": median(cached_ms),
            "warm_micro_turn_ms": median(warm_ms),
            "full_prefill_first_turn_ms": median(full_ms),
            "cached_vs_warm": ratio(median(cached_ms), median(warm_ms)),
            "full_vs_cached": ratio(median(full_ms), median(cached_ms)),
            "target_cached_vs_warm": FIRST_TURN_TARGET,
            "holds": ratio(median(cached_ms), median(warm_ms)) <= FIRST_TURN_TARGET,
            "hits": prefix_stats.hits,
            "tokens_reused": prefix_stats.tokens_reused,
        }
    return report
