"""The client threads of the in-engine modes: one thread per session, all starting their turns together.

Why together: early turns are then batched as later ones are, so a mode's head and tail averages
compare like with like. The threads only submit and wait; the engine thread does the work.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from loadtest.bench.workload import Workload
from worker.engine import Engine, TurnResult

# A turn that takes longer than this is a hung engine, not a slow one.
RESULT_TIMEOUT_S = 600.0


def open_together(engine: Engine, start: threading.Barrier) -> str:
    """Open this client's session, then wait until every client has opened its own."""
    try:
        sid = engine.open_session(stop_token_ids=())
    except BaseException:
        start.abort()  # the other clients get BrokenBarrierError instead of waiting forever
        raise
    start.wait()
    return sid


def token_turn(
    engine: Engine, sid: str, workload: Workload, session: int, turn: int, *, outputs: int
) -> TurnResult:
    """Run the workload's turn `turn` of `session` (its input tokens, `outputs` outputs) to its end."""
    return engine.run_turn(
        sid, tokens=workload.inputs[session][turn], max_output_tokens=outputs, timeout=RESULT_TIMEOUT_S
    )


def run_clients(mode: str, sessions: int, client: Callable[[int], None]) -> float:
    """`client(session)` for every session, each on its own thread; the wall time in seconds."""
    began = time.perf_counter()
    with ThreadPoolExecutor(sessions, thread_name_prefix=f"bench-{mode}") as pool:
        for future in [pool.submit(client, s) for s in range(sessions)]:
            future.result()
    return time.perf_counter() - began
