"""Rebalance: a worker holding many more sessions than a peer moves some of them there, by copy.

Why: placement spreads sessions as they open and nothing else moves them. After a rolling restart
the worker restarted last holds none of the open sessions (each drain sent its sessions to the
others), and with long sessions the pool stays lopsided for as long as they live: one worker serves
twice its share while another idles (docs/failover.md, "What a rolling restart leaves behind, and
the rebalance").

With `--rebalance-gap N` (0, the default, is off), every `--rebalance-period-s` a worker reads the
registry; when it holds at least N sessions more than the least-loaded `ready` worker of its model,
it moves half the difference there (at most `MOVES_PER_ROUND`), by the drain's own make-before-break
moves (switchover.py `Switcher`: the KV pages copied, `warm`, the switch at a turn boundary, then
`migrate` naming the target, so the gateway restores each session onto its copy). Unlike a drain,
nothing forces a session off: one whose copy is refused, fails or is late stays here, served as
before (MOVING back to READY). Half the difference, so two workers never move sessions back and
forth: after a round they are at most one apart, below any gap of 2 or more (between two workers;
several that weigh the same idle peer at once can overshoot it, and a jittered period makes that
rare). A drain ends the loop through `draining`; a round in progress asks for no more copies, lets
those asked switch for up to `DRAIN_GRACE_S`, and the drain waits for it (app.py), never cancels
it: a switch cut short would leave its session neither here nor told to move. Every session is then
moved or READY again, for the drain's own moves, and a copy a round left unswitched on its target is
withdrawn there at the round's end (switchover.py `stays`, warm.py `withdraw`), so a drain's or the
next round's copy of that session to the same target is not refused as already there.

Nothing here runs on the chunk path: the registry is read once a period, off the event loop's
per-chunk work, and a round's cost is that of its copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Final

from redis.asyncio import Redis, RedisError

from shared.store.registry import WorkerInfo, read_workers
from shared.store.schema import STATE_READY, KeySchema
from worker.server.lifecycle import Phase
from worker.server.service import WorkerService
from worker.server.sessions import WorkerSession
from worker.server.switchover import Switcher

logger = logging.getLogger(__name__)

# Sessions one round moves at most: a round is a partial drain, and its copies share the worker
# with the sessions it serves; what is left moves in the next rounds.
MOVES_PER_ROUND: Final = 8
# How long a round's copies and switches may take; the sessions not switched by then stay here.
ROUND_BUDGET_S: Final = 10.0
# How long a round's copies already asked for may still switch once a drain began (the drain waits):
# a session left unswitched stays here, and the drain then copies it a second time. A round of 8
# moves took 0.4-0.9 s under load.
DRAIN_GRACE_S: Final = 3.0
# A round's period is drawn from period x [1, 1 + PERIOD_JITTER], so the workers' rounds spread out
# and none comes sooner than the period settings.py checked against the heartbeat.
PERIOD_JITTER: Final = 0.5


@dataclass(frozen=True)
class RoundPlan:
    """Where a round sends sessions, and how many."""

    worker_id: str
    url: str
    count: int


def plan_move(own: WorkerInfo, workers: Iterable[WorkerInfo], *, gap: int) -> RoundPlan | None:
    """The move a worker holding `own.sessions` should make towards the least-loaded other `ready`
    worker of its model with room (ties: the lowest id), or None below `gap` (>= 2)."""
    peers = [
        w
        for w in workers
        if w.worker_id != own.worker_id
        and w.state == STATE_READY
        and w.model == own.model
        and w.sessions < w.max_sessions
    ]
    if not peers:
        return None
    least = min(peers, key=lambda w: (w.sessions, w.worker_id))
    difference = own.sessions - least.sessions
    if difference < gap:
        return None
    count = min(difference // 2, least.max_sessions - least.sessions, MOVES_PER_ROUND)
    return RoundPlan(least.worker_id, least.url, count) if count > 0 else None


async def rebalance_loop(
    service: WorkerService,
    redis: Redis,
    schema: KeySchema,
    identity: WorkerInfo,
    *,
    gap: int,
    period_s: float,
    draining: asyncio.Event,
) -> None:
    """Weigh a rebalance about every `period_s`, and make it; ends once `draining` is set (a round
    in progress ends early, its switches done)."""
    while not draining.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(draining.wait(), period_s * random.uniform(1.0, 1.0 + PERIOD_JITTER))
            return
        try:
            workers = await read_workers(redis, schema)
        except RedisError as exc:  # the heartbeat reports an outage; the next period tries again
            logger.debug("rebalance: cannot read the registry: %s", exc)
            continue
        if draining.is_set():
            return  # the drain began while the registry was read: its moves take every session
        held = service.sessions.live()
        own = replace(identity, sessions=len(held))
        move = plan_move(own, workers, gap=gap)
        if move is None:
            continue
        movable = [b for b in held if b.phase is Phase.READY and b.link is not None]
        if not movable:
            continue
        try:
            await move_sessions(
                service, random.sample(movable, min(move.count, len(movable))), move, draining
            )
        except Exception:  # a bug in a round must not end rebalancing for the worker's life
            logger.exception("rebalance: a round towards %s failed", move.worker_id)


async def move_sessions(
    service: WorkerService, bindings: list[WorkerSession], move: RoundPlan, draining: asyncio.Event
) -> int:
    """Move `bindings` (READY) to `move`'s worker; the number switched. Those that could not move
    stay here, READY again; a drain (`draining`) ends the round early, its switches done."""
    switcher = Switcher(
        service, time.monotonic() + ROUND_BUDGET_S, copy_pages=True, why="rebalance", stays=True
    )
    started = time.monotonic()
    try:
        for binding in bindings:
            if draining.is_set():
                break
            await switcher.warm(binding, move.worker_id, move.url)
    finally:
        # Whatever stopped the loop: the copies asked for switch or fall back, every switch begun ends.
        # The sessions not switched are READY again here (the Switcher's `stays`).
        await switcher.wait(stop=draining, grace_s=DRAIN_GRACE_S)
        report = switcher.report
        service.metrics.sessions_rebalanced += report.switched
        logger.info(
            "rebalance: %d of %d session(s) moved to %s in %.0f ms (%s); %d stay here",
            report.switched,
            len(bindings),
            move.worker_id,
            (time.monotonic() - started) * 1000,
            report.copy_figures(),
            len(report.fell_back),
        )
    return report.switched
