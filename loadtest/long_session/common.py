"""What every scenario shares: the turn shape, deterministic tokens, timed turns and summaries."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.engine import Engine
from worker.engine.turn import TurnResult

# Token ids 1..TOKEN_SPAN: valid in every preset's vocabulary (tiny has 512).
TOKEN_SPAN = 500


@dataclass(frozen=True)
class TurnShape:
    """One micro-turn: `chunk_tokens` in, `output_tokens` out (greedy); the issue's 32 and 8."""

    chunk_tokens: int = 32
    output_tokens: int = 8
    # Histories are built with chunks of at most this many tokens and no output (the engine's
    # default `max_chunk_tokens`): the same KV as many small turns, in a fraction of the time.
    build_chunk_tokens: int = 512

    @property
    def grows_by(self) -> int:
        """What one turn adds to its session's sequence."""
        return self.chunk_tokens + self.output_tokens


def tokens(stream: int, start: int, count: int) -> list[int]:
    """`count` deterministic tokens of one stream, from position `start` (varied, not repeating soon)."""
    return [1 + ((stream * 7919 + (start + k) * 104729) >> 3) % TOKEN_SPAN for k in range(count)]


class Streamer:
    """One engine session fed deterministic chunks; each turn's wall time and result are kept."""

    def __init__(self, engine: Engine, stream: int, shape: TurnShape, **options: Any) -> None:
        self.engine = engine
        self.stream = stream
        self.shape = shape
        self.sent = 0
        # The session's sequence (inputs and outputs) after its last turn.
        self.length = 0
        self.sid = engine.open_session(stop_token_ids=(), **options)

    def build(self, length: int) -> None:
        """Feed `length` tokens in build chunks, no output (untimed)."""
        while self.sent < length:
            count = min(self.shape.build_chunk_tokens, length - self.sent)
            self._send(count, 0)

    def turn(self) -> tuple[float, TurnResult]:
        """One micro-turn; its wall time in ms (submission to result) and its result."""
        began = time.perf_counter()
        result = self._send(self.shape.chunk_tokens, self.shape.output_tokens)
        return (time.perf_counter() - began) * 1000, result

    def _send(self, count: int, outputs: int) -> TurnResult:
        chunk = tokens(self.stream, self.sent, count)
        self.sent += count
        result = self.engine.run_turn(self.sid, tokens=chunk, max_output_tokens=outputs, timeout=3600)
        self.length = result.length
        return result

    def close(self) -> None:
        self.engine.close_session(self.sid)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def p99(values: Sequence[float]) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), 99))


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def pool_tokens(tokens_needed: int, page_size: int = 16) -> int:
    """`tokens_needed` rounded up to whole pages."""
    return -(-tokens_needed // page_size) * page_size


@dataclass(frozen=True)
class MemoryMark:
    """The KV owner's counters at one moment (`Engine.stats().memory` holds the live copy counters,
    which go on counting: a mark copies the numbers out)."""

    restores: int
    restored_bytes: int
    restore_seconds: float
    offloads: int
    offload_seconds: float
    recomputes: int
    drops: int

    @classmethod
    def of(cls, engine: Engine) -> MemoryMark:
        memory = engine.stats().memory
        return cls(
            memory.restores.count,
            memory.restores.bytes,
            memory.restores.seconds,
            memory.offloads.count,
            memory.offloads.seconds,
            memory.recomputes,
            memory.drops,
        )

    def since(self, earlier: MemoryMark) -> MemoryMark:
        return MemoryMark(
            self.restores - earlier.restores,
            self.restored_bytes - earlier.restored_bytes,
            self.restore_seconds - earlier.restore_seconds,
            self.offloads - earlier.offloads,
            self.offload_seconds - earlier.offload_seconds,
            self.recomputes - earlier.recomputes,
            self.drops - earlier.drops,
        )

    @property
    def copy_seconds(self) -> float:
        """Both directions' copies: a resume under pressure parks one session and restores another."""
        return self.restore_seconds + self.offload_seconds

    @property
    def restore_gb_s(self) -> float:
        return self.restored_bytes / self.restore_seconds / 1e9 if self.restore_seconds else 0.0
