"""The `streaming` mode: every session keeps its KV cache in the engine between micro-turns.

One client thread per session runs its turns back to back, as a realtime client would, and the
engine batches whatever the sessions have in flight into one forward per step. A turn's latency is
the client's wall time from submit to the result (its last output token). This run also records
the outputs every other mode replays, and samples RSS on session 0.
"""

from __future__ import annotations

import logging
import threading
import time

from loadtest.bench.clients import open_together, run_clients, token_turn
from loadtest.bench.config import RSS_EARLY_TURNS, STREAMING, BenchConfig
from loadtest.bench.memory import RssSamples, rss_mib
from loadtest.bench.results import ModeRun
from loadtest.bench.workload import Workload
from worker.engine import Engine

logger = logging.getLogger(__name__)


def run_streaming(engine: Engine, workload: Workload, config: BenchConfig) -> tuple[ModeRun, RssSamples]:
    run = ModeRun.empty(STREAMING, sessions=config.sessions, turns=config.turns)
    early_turns = min(RSS_EARLY_TURNS, config.turns)
    rss: list[float] = []
    # All clients start their first turn together, so early turns are batched as later ones are.
    start = threading.Barrier(config.sessions)

    def client(session: int) -> None:
        sid = open_together(engine, start)
        try:
            for turn in range(config.turns):
                began = time.perf_counter()
                result = token_turn(engine, sid, workload, session, turn, outputs=config.output_tokens)
                run.turn_ms[turn][session] = (time.perf_counter() - began) * 1000
                workload.record(session, turn, result.tokens)
                if session == 0:
                    rss.append(rss_mib())
        finally:
            engine.close_session(sid)

    run.wall_s = run_clients("streaming", config.sessions, client)
    logger.info("streaming: %d sessions x %d turns in %.1f s", config.sessions, config.turns, run.wall_s)
    return run, RssSamples(early_turns, tuple(rss))
