"""`hot_path`: the micro-turn median of sessions that share a prefix, against the cache off.

`sessions` sessions open with the same P-token prefix and a few tokens of their own on a cache-on
engine (so they read the shared prefix's pages and then their own: two runs of pages) and the same
sessions on a cache-off engine (each its own contiguous pages); then `rounds` rounds of one
micro-turn each, the two engines' turns interleaved (each side first in every other pair).
Target (issue #33): the cache-on median within 1.05x of the cache-off one (the per-chunk path does
no lookup, and reads the shared pages in place).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loadtest.long_session.common import TurnShape, median, ratio, tokens
from loadtest.prefix.first_turn import engines, timed_turn

HOT_PATH_TARGET = 1.05


@dataclass(frozen=True)
class HotPathConfig:
    prefixes: tuple[int, ...] = (1024, 2048)
    sessions: int = 4
    rounds: int = 12
    shape: TurnShape = field(default_factory=TurnShape)


def run_hot_path(model: str, config: HotPathConfig) -> dict[str, Any]:
    shape = config.shape
    report: dict[str, Any] = {}
    for prefix_tokens in config.prefixes:
        prefix = tokens(0, 0, prefix_tokens)
        on, off = engines(model, prefix_tokens, config.sessions + 1, shape)
        with on, off:
            pairs = []
            for i in range(config.sessions):
                opening = prefix + tokens(20 + i, 0, shape.chunk_tokens)
                pair = (on.open_session(stop_token_ids=()), off.open_session(stop_token_ids=()))
                for engine, sid in zip((on, off), pair, strict=True):
                    engine.run_turn(sid, tokens=opening, max_output_tokens=shape.output_tokens, timeout=3600)
                pairs.append(pair)
            on_ms: list[float] = []
            off_ms: list[float] = []
            for turn in range(config.rounds):
                for i, (on_sid, off_sid) in enumerate(pairs):
                    chunk = tokens(20 + i, shape.chunk_tokens * (turn + 1), shape.chunk_tokens)
                    sides = [(on, on_sid, on_ms), (off, off_sid, off_ms)]
                    for engine, sid, times in sides if (turn + i) % 2 == 0 else reversed(sides):
                        times.append(timed_turn(engine, sid, chunk, shape.output_tokens))
            prefix_stats = on.stats().memory.prefix
        assert prefix_stats is not None
        report[f"P{prefix_tokens}"] = {
            "micro_turn_median_cache_on_ms": median(on_ms),
            "micro_turn_median_cache_off_ms": median(off_ms),
            "on_vs_off": ratio(median(on_ms), median(off_ms)),
            "target": HOT_PATH_TARGET,
            "holds": ratio(median(on_ms), median(off_ms)) <= HOT_PATH_TARGET,
            "shared_pages": prefix_stats.shared_pages,
            "turns": len(on_ms),
        }
    return report
