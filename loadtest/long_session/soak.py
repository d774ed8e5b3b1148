"""`soak`: 20,000 micro-turns on one session through a real stack, hours of a session fast-forwarded.

One stack of processes (a Redis-protocol server, one `tiny` worker, one gateway; microturn/stack.py,
the gateway's per-session rate limit lifted: the turns come back to back). One client session with
`truncate` and a limit reached early takes `turns` micro-turns through the gateway. Every
`sample_every` turns: the worker's RSS (psutil, on its pid) and the session's Redis bytes (STRLEN of
its token log `mt:log:{<sid>}` plus MEMORY USAGE of its record `mt:session:{<sid>}`).

Figures: the median turn of the first `window` turns after the limit and of the last `window`
(target: within 1.1x), and the growth of RSS and of the Redis bytes after the limit: the largest
sample of the later half of the samples after the limit against the earlier half's (target: flat,
within 10%).
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from loadtest.long_session.common import TurnShape, median, ratio, tokens
from microturn.processes import free_port
from microturn.stack import Stack, StackOptions
from shared.client import SyncRealtimeClient
from shared.store.schema import KeySchema

logger = logging.getLogger(__name__)

LAST_VS_FIRST_TARGET = 1.1
FLAT_TARGET = 1.1
_NO_RATE_LIMIT = ("--max-chunks-per-s", "1000000", "--chunk-burst", "1000000")


@dataclass(frozen=True)
class SoakConfig:
    turns: int = 20000
    window: int = 1000
    sample_every: int = 1000
    max_context_tokens: int = 1024
    keep_prefix_tokens: int = 32
    retention_ratio: float = 0.8
    model: str = "tiny"
    # None: the stack's embedded server.
    redis_url: str | None = None
    shape: TurnShape = field(default_factory=TurnShape)


@dataclass(frozen=True)
class Sample:
    turn: int
    worker_rss_mib: float
    log_bytes: int
    record_bytes: int

    @property
    def redis_bytes(self) -> int:
        return self.log_bytes + self.record_bytes


def _first_cut_turn(config: SoakConfig) -> int:
    """The first turn (0-based) whose input and outputs would take the history past the limit."""
    grows = config.shape.grows_by
    return next(i for i in range(config.turns) if (i + 1) * grows > config.max_context_tokens)


def _sample(turn: int, worker: psutil.Process, store: redis.Redis, sid: str) -> Sample:
    schema = KeySchema()
    log_bytes = int(store.strlen(schema.log(sid)))
    record_bytes = int(store.memory_usage(schema.session(sid)) or 0)
    return Sample(turn, worker.memory_info().rss / 2**20, log_bytes, record_bytes)


def _stream(
    url: str, worker: psutil.Process, store: redis.Redis, config: SoakConfig
) -> tuple[list[float], list[Sample]]:
    shape = config.shape
    turn_ms: list[float] = []
    samples: list[Sample] = []
    with SyncRealtimeClient.connect(url) as client:
        client.open(
            stop_token_ids=[],
            max_context_tokens=config.max_context_tokens,
            context_policy="truncate",
            keep_prefix_tokens=config.keep_prefix_tokens,
            retention_ratio=config.retention_ratio,
        )
        sid = client.session_id
        assert sid is not None
        for turn in range(config.turns):
            chunk = tokens(7, turn * shape.chunk_tokens, shape.chunk_tokens)
            began = time.perf_counter()
            done = client.turn(turn + 1, tokens=chunk, max_output_tokens=shape.output_tokens, timeout=60)
            turn_ms.append((time.perf_counter() - began) * 1000)
            if len(done.tokens) != shape.output_tokens:
                raise RuntimeError(
                    f"turn {turn + 1} gave {len(done.tokens)} tokens, not {shape.output_tokens}"
                )
            if (turn + 1) % config.sample_every == 0:
                samples.append(_sample(turn + 1, worker, store, sid))
        client.close()
    return turn_ms, samples


def run_soak(config: SoakConfig) -> dict[str, Any]:
    first_cut = _first_cut_turn(config)
    if first_cut + 2 * config.window > config.turns:
        raise ValueError(f"{config.turns} turns leave no two windows of {config.window} after the limit")
    with tempfile.TemporaryDirectory(prefix="long-session-soak-") as work:
        options = StackOptions(
            model=config.model,
            device="cpu",
            port=free_port(),
            worker_port=free_port(),
            kv_tokens=4 * config.max_context_tokens,
            auth="off",
            redis_url=config.redis_url,
            gateway_args=_NO_RATE_LIMIT,
            log_path=Path(work) / "stack.log",
        )
        stack = Stack(options)
        try:
            stack.start()
            worker = psutil.Process(next(c.proc.pid for c in stack.children if c.name == "worker"))
            url = stack.local_url.replace("http://", "ws://", 1) + "/v1/realtime"
            store = redis.Redis.from_url(stack.redis_url)
            try:
                turn_ms, samples = _stream(url, worker, store, config)
            finally:
                store.close()
        finally:
            stack.stop()
    after = [s for s in samples if s.turn > first_cut]
    first_window = turn_ms[first_cut : first_cut + config.window]
    last_window = turn_ms[-config.window :]
    figures = {
        "first_window_after_limit_median_ms": median(first_window),
        "last_window_median_ms": median(last_window),
        "worker_rss_first_after_limit_mib": after[0].worker_rss_mib,
        "worker_rss_last_mib": after[-1].worker_rss_mib,
    }
    figures["last_vs_first"] = ratio(
        figures["last_window_median_ms"], figures["first_window_after_limit_median_ms"]
    )
    # Compaction makes the log a sawtooth (it grows by a record a turn until it is compacted), so
    # "flat" compares peaks: the largest sample of the later half against the earlier half's.
    early, late = after[: len(after) // 2] or after, after[len(after) // 2 :]
    figures["worker_rss_growth"] = ratio(
        max(s.worker_rss_mib for s in late), max(s.worker_rss_mib for s in early)
    )
    figures["redis_bytes_max_early_after_limit"] = max(s.redis_bytes for s in early)
    figures["redis_bytes_max_late"] = max(s.redis_bytes for s in late)
    figures["redis_bytes_growth"] = ratio(
        figures["redis_bytes_max_late"], figures["redis_bytes_max_early_after_limit"]
    )
    logger.info("soak: %s", figures)
    return {
        "config": {
            "turns": config.turns,
            "window": config.window,
            "max_context_tokens": config.max_context_tokens,
            "keep_prefix_tokens": config.keep_prefix_tokens,
            "retention_ratio": config.retention_ratio,
            "first_cut_turn": first_cut + 1,
            "chunk_tokens": config.shape.chunk_tokens,
            "output_tokens": config.shape.output_tokens,
        },
        "figures": figures,
        "samples": [
            {
                "turn": s.turn,
                "worker_rss_mib": s.worker_rss_mib,
                "log_bytes": s.log_bytes,
                "record_bytes": s.record_bytes,
            }
            for s in samples
        ],
        "targets": {
            f"last_window_within_{LAST_VS_FIRST_TARGET}x_of_first": figures["last_vs_first"]
            <= LAST_VS_FIRST_TARGET,
            "worker_rss_flat": figures["worker_rss_growth"] <= FLAT_TARGET,
            "redis_bytes_flat": figures["redis_bytes_growth"] <= FLAT_TARGET,
        },
    }
