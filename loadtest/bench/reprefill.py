"""The `reprefill` mode: no session survives a turn, so every turn recomputes the whole history.

This is what a stateless server does with a conversation: each request carries the full context.
Each timed turn opens a fresh session with `history=` everything before it and submits the turn's
chunk; the engine prefills history and chunk in one go inside the turn, so the timing (open plus
turn) covers the re-prefill. The cost grows with the history, so only `sampled_turns` are run; the
history of a sampled turn comes from streaming's record, untimed. Outputs must equal streaming's:
both are the same greedy model over the same sequence.
"""

from __future__ import annotations

import logging
import threading
import time

from loadtest.bench.clients import run_clients, token_turn
from loadtest.bench.config import REPREFILL, BenchConfig
from loadtest.bench.results import ModeRun
from loadtest.bench.workload import Workload, sampled_turns
from worker.engine import Engine

logger = logging.getLogger(__name__)


def run_reprefill(engine: Engine, workload: Workload, config: BenchConfig) -> ModeRun:
    run = ModeRun.empty(REPREFILL, sessions=config.sessions, turns=config.turns)
    turns = sampled_turns(config.turns)
    start = threading.Barrier(config.sessions)
    lock = threading.Lock()

    def client(session: int) -> None:
        start.wait()
        for turn in turns:
            history = workload.history(session, turn)
            began = time.perf_counter()
            sid = engine.open_session(stop_token_ids=(), history=history)
            try:
                result = token_turn(engine, sid, workload, session, turn, outputs=config.output_tokens)
                run.turn_ms[turn][session] = (time.perf_counter() - began) * 1000
            finally:
                engine.close_session(sid)
            expected = workload.outputs(session, turn)
            with lock:
                run.checked += 1
                if result.tokens != expected:
                    run.mismatches.append((session, turn))
                    logger.warning(
                        "reprefill session %d turn %d generated %s, streaming %s",
                        session,
                        turn,
                        result.tokens,
                        expected,
                    )

    run.wall_s = run_clients("reprefill", config.sessions, client)
    logger.info(
        "reprefill: %d sampled turns x %d sessions in %.1f s", len(turns), config.sessions, run.wall_s
    )
    return run
