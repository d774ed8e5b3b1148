"""`overflow`: one session with `truncate` running far past its context limit.

A main session (`max_context_tokens` = the limit, `keep_prefix_tokens`, `retention_ratio`) takes
micro-turns until it has taken `turns_past` turns since its first cut. Each turn's wall time is
kept with its cut (`TurnResult.cut`). Figures per limit and ratio:

- the median turn before the first cut and after it (target with ratio 0.8: within 1.1x), the p99
  over the turns from the first cut on;
- the cut turns' median and max beside a reference: the same turn on a fresh session whose history
  is just the `recent` tokens the cut kept, so it prefills them (the cut's whole re-prefill; the
  kept prefix's KV is not recomputed, so a cut turn should cost no more);
- beside it (ratio < 1 only), a second session streams the same turns from its own thread, reopened
  fresh whenever it would reach the limit (so it never cuts): its median and p99 turn, and the
  median and longest of its turns that overlapped a cut of the main session (a cut's re-prefill
  goes in pieces, so other sessions' turns share steps with it rather than wait behind it). The
  references are measured while it still streams, so a cut and its reference have the same
  neighbour.

The same run with `retention_ratio` 1.0 (the rule before #24: every turn past the limit cuts to
exactly the limit) shows the cliff the ratio removes; it runs fewer turns past the limit (each is a
re-prefill of the whole window).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from loadtest.long_session.common import (
    Streamer,
    TurnShape,
    median,
    p99,
    pool_tokens,
    ratio,
    tokens,
)
from worker.engine import Engine

logger = logging.getLogger(__name__)

AFTER_VS_BEFORE_TARGET = 1.1


@dataclass(frozen=True)
class OverflowConfig:
    limits: tuple[int, ...] = (1024, 512)
    keep_prefix_tokens: int = 32
    retention_ratio: float = 0.8
    turns_past: int = 200
    # Turns past the limit with retention_ratio 1.0 (each one re-prefills the whole window).
    cliff_turns_past: int = 20
    reference_samples: int = 3
    side_session: bool = True
    shape: TurnShape = field(default_factory=TurnShape)


@dataclass(frozen=True)
class Timed:
    began: float
    ended: float
    ms: float
    cut_recent: int | None = None


class SideStream:
    """A second session streaming from its own thread until stopped; never cut (reopened instead)."""

    def __init__(self, engine: Engine, shape: TurnShape, limit: int) -> None:
        self.engine, self.shape, self.limit = engine, shape, limit
        self.turns: list[Timed] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="long-session-side", daemon=True)

    def __enter__(self) -> SideStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:  # a neighbour that failed must fail the run, not thin its figures
            raise RuntimeError("the side session failed") from self.error

    def _run(self) -> None:
        try:
            self._stream()
        except BaseException as exc:
            self.error = exc

    def _stream(self) -> None:
        stream = 1000
        session = Streamer(self.engine, stream, self.shape)
        while not self._stop.is_set():
            if session.length + self.shape.grows_by > self.limit:
                session.close()
                stream += 1
                session = Streamer(self.engine, stream, self.shape)
            began = time.perf_counter()
            ms, _result = session.turn()
            self.turns.append(Timed(began, time.perf_counter(), ms))
        session.close()


def _reference_ms(engine: Engine, recent: int, config: OverflowConfig) -> float:
    """A turn on a fresh session whose history is `recent` tokens: it prefills them, then the turn."""
    samples = []
    for k in range(config.reference_samples):
        fresh = Streamer(engine, 5000 + k, config.shape, history=tokens(6000 + k, 0, recent))
        samples.append(fresh.turn()[0])
        fresh.close()
    return median(samples)


def _main_session(
    engine: Engine, limit: int, retention: float, turns_past: int, config: OverflowConfig
) -> list[Timed]:
    session = Streamer(
        engine,
        1,
        config.shape,
        max_context_tokens=limit,
        context_policy="truncate",
        keep_prefix_tokens=config.keep_prefix_tokens,
        retention_ratio=retention,
    )
    turns: list[Timed] = []
    past = 0
    while past < turns_past:
        began = time.perf_counter()
        ms, result = session.turn()
        turns.append(Timed(began, time.perf_counter(), ms, result.cut.recent if result.cut else None))
        if past or result.cut is not None:
            past += 1
    session.close()
    return turns


def _references(engine: Engine, turns: list[Timed], config: OverflowConfig) -> float:
    """The median reference turn over the distinct numbers of recent tokens the cuts kept."""
    recents = sorted({t.cut_recent for t in turns if t.cut_recent is not None})
    return median([_reference_ms(engine, recent, config) for recent in recents])


def _one_run(
    model: str, limit: int, retention: float, turns_past: int, config: OverflowConfig, *, side: bool
) -> dict[str, Any]:
    grows = config.shape.grows_by
    with Engine.load(model, kv_tokens=pool_tokens(3 * (limit + 2 * grows) + 256), host_kv_tokens=0) as engine:
        if side:
            # The reference prefills run while the side session still streams: a cut turn and
            # its reference share the engine with the same neighbour.
            with SideStream(engine, config.shape, limit) as beside:
                turns = _main_session(engine, limit, retention, turns_past, config)
                side_turns = list(beside.turns)
                reference = _references(engine, turns, config)
        else:
            turns, side_turns = _main_session(engine, limit, retention, turns_past, config), []
            reference = _references(engine, turns, config)
        first_cut = next(i for i, t in enumerate(turns) if t.cut_recent is not None)
        before, after = turns[:first_cut], turns[first_cut:]
        cuts = [t for t in after if t.cut_recent is not None]
        recents = sorted({t.cut_recent for t in cuts if t.cut_recent is not None})
    row: dict[str, Any] = {
        "turns_before_first_cut": len(before),
        "turns_past_limit": len(after),
        "cuts": len(cuts),
        "kept_recent_tokens": recents[len(recents) // 2],
        "median_before_ms": median([t.ms for t in before]),
        "median_after_ms": median([t.ms for t in after]),
        "p99_after_ms": p99([t.ms for t in after]),
        "cut_median_ms": median([t.ms for t in cuts]),
        "cut_max_ms": max(t.ms for t in cuts),
        "prefill_of_kept_recent_ms": reference,
    }
    row["after_vs_before"] = ratio(row["median_after_ms"], row["median_before_ms"])
    row["cut_vs_prefill_of_kept_recent"] = ratio(row["cut_median_ms"], reference)
    if side_turns:
        near_cut = [s for s in side_turns if any(s.began < c.ended and c.began < s.ended for c in cuts)]
        row["side_turns"] = len(side_turns)
        row["side_median_ms"] = median([s.ms for s in side_turns])
        row["side_p99_ms"] = p99([s.ms for s in side_turns])
        row["side_turns_near_cut"] = len(near_cut)
        if near_cut:
            row["side_median_near_cut_ms"] = median([s.ms for s in near_cut])
            row["side_max_near_cut_ms"] = max(s.ms for s in near_cut)
            row["side_near_cut_vs_median"] = ratio(row["side_max_near_cut_ms"], row["side_median_ms"])
    return row


def run_overflow(model: str, config: OverflowConfig) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    targets: dict[str, bool] = {}
    for limit in config.limits:
        logger.info("overflow: limit %d, ratio %.2f", limit, config.retention_ratio)
        ratio_row = _one_run(
            model, limit, config.retention_ratio, config.turns_past, config, side=config.side_session
        )
        logger.info("overflow %d ratio %.2f: %s", limit, config.retention_ratio, ratio_row)
        cliff_row = _one_run(model, limit, 1.0, config.cliff_turns_past, config, side=False)
        logger.info("overflow %d ratio 1.0: %s", limit, cliff_row)
        rows[str(limit)] = {f"ratio_{config.retention_ratio}": ratio_row, "ratio_1.0": cliff_row}
        targets[f"after_within_{AFTER_VS_BEFORE_TARGET}x_of_before_at_{limit}"] = (
            ratio_row["after_vs_before"] <= AFTER_VS_BEFORE_TARGET
        )
        targets[f"cut_at_most_prefill_of_kept_recent_at_{limit}"] = (
            ratio_row["cut_vs_prefill_of_kept_recent"] <= 1.0
        )
    return {
        "config": {
            "limits": list(config.limits),
            "keep_prefix_tokens": config.keep_prefix_tokens,
            "retention_ratio": config.retention_ratio,
            "turns_past": config.turns_past,
            "cliff_turns_past": config.cliff_turns_past,
            "chunk_tokens": config.shape.chunk_tokens,
            "output_tokens": config.shape.output_tokens,
        },
        "limits": rows,
        "targets": targets,
    }
