"""Make-before-break drain: each session's KV moves to its next worker while this one serves it.

SIGTERM (docs/failover.md, "Drain"). The worker stops taking sessions, then for each session held
with a gateway attached:

1. *Place* it: placement (shared/store/placement.py, this worker excluded) picks and charges the
   least-loaded worker with room, so the sessions spread over every worker that has it.
2. *Copy* it there: its KV pages go over a KV copy stream to the target (kv_sender.py; one stream
   per target, taking the sessions in placement order, and a second where one alone would not be
   done in time: `wants_second_stream`), then this
   worker sends `warm(sid, config)` on the target's link (dialed as a gateway dials it, with the
   link secret): the target catches the copy up on the turns logged since its point
   (worker/server/warm.py), or, when the pages could not be used (a format mismatch, a bad checksum,
   a broken stream, no room: counted by reason), rebuilds it from the token log in its background
   prefill class. This worker keeps serving every chunk.
3. *Switch* at a turn boundary once the target answers `warmed`: chunks that arrive from now on
   are left unanswered (the gateway holds them in the session's undurable tail); the ones in
   flight finish here and are logged; the log is flushed; then `migrate(sid, durable_seq,
   target)`. The gateway restores the session on the target, which takes the warm copy over and
   prefills only the turns answered since the copy read the log; the held chunks run there next.

Sessions whose copy is not ready by the deadline (a share of `--drain-timeout-s`), whose target
refused, died or could not be reached, or for which no worker had room, are handed over by the
classic break-before-make `migrate_all` (worker/server/handover.py) that the drain runs after this,
so a drain never outlives its deadline. Why the KV pages, with the rebuild as the fallback:
docs/failover.md, with the figures. Each session's phase moves through its owner
(worker/server/sessions.py): READY -> MOVING -> SWITCHING -> HANDED_OVER. A rebalance
(worker/server/rebalance.py) makes the same moves through the same `Switcher`, for some of a
serving worker's sessions; one it cannot move goes back to READY instead of the classic handover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Final

import websockets
from redis.asyncio import Redis

from shared.errors import CapacityExhausted, MicroturnError
from shared.protocol.link import LinkClose, LinkWarm, LinkWarmed
from shared.protocol.link_client import LinkClient
from shared.store.placement import Placement, place_session
from shared.store.schema import KeySchema
from worker.server.heartbeat import HEARTBEATS_PER_TTL
from worker.server.kv_sender import KVSender
from worker.server.lifecycle import Phase
from worker.server.service import WorkerService
from worker.server.sessions import WorkerSession

logger = logging.getLogger(__name__)

# A switch lets the session's chunks in flight end here for at most `SWITCH_WAIT_S` (about one
# step of a served worker: a turn in the step running now is answered here, not recomputed),
# polling this often; the rest are cancelled by the handover and re-run on the copy from the
# gateway's tail, as after a crash. A turn still queued here would wait behind this worker's other
# sessions and its exports while the target has room, and every chunk of the session arriving
# meanwhile waits with it: waiting for all of them made a drain under load seconds long, and a cap
# of 0.1 s still held a loaded drain's switches 100-130 ms (docs/benchmarks.md, "The switch's wait").
IN_FLIGHT_POLL_S: Final = 0.002
SWITCH_WAIT_S: Final = 0.03
CONNECT_TIMEOUT_S: Final = 2.0
# While no worker has room for the next session, placement is asked again this often (`_place`).
PLACE_RETRY_S: Final = 0.2
# KV copy streams to each target, each taking the next placed session. One at a time costs the
# sessions still served here least: a copy's CPU (the gather, the frames, the target's import) shares
# the cores with both engines, and two at once doubled it in the drain's first hundred ms (8 sessions
# of 4k tokens on a 2-core VM: longest waits 34-62 ms with one stream, 52-88 with two; docs/
# benchmarks.md, "One copy stream a target instead of two"). A second stream overlaps one copy's
# waits (the engine threads between steps, the target's log read) with the other's transfer, ~1.4x
# the rate, so a target gets it where its queue would not be copied in time with one: once the
# queue, at the copies' mean time so far, would take more than SECOND_STREAM_SHARE of the time left.
# Not more than two: where the bytes are what limits, concurrent copies share the rate, so each ends
# later and none switches early. Each holds one session's pages in memory at a time.
MAX_COPY_STREAMS: Final = 2
SECOND_STREAM_SHARE: Final = 0.5


def wants_second_stream(*, streams: int, queued: int, mean_copy_s: float, time_left_s: float) -> bool:
    """Whether a target with `streams` copy streams and `queued` sessions waiting for one gets
    another, its copies so far having taken `mean_copy_s` each, `time_left_s` before the deadline."""
    if streams >= MAX_COPY_STREAMS or queued == 0:
        return False
    return queued * mean_copy_s > SECOND_STREAM_SHARE * time_left_s


@dataclass
class SwitchReport:
    """What a make-before-break drain did, for its log line and its tests."""

    placed: int = 0
    switched: int = 0
    # Chunks this worker answered for sessions whose copies were being warmed elsewhere: > 0 shows
    # the break came after the make.
    served_while_warming: int = 0
    fell_back: list[str] = field(default_factory=list)
    # Of those, the ones with a copy (warm or part-warm) on a target still up: the classic handover
    # names it, so the restore there keeps what the copy has.
    targets: dict[str, str] = field(default_factory=dict)
    # Sessions whose KV pages went over (kv_sender.py): their bytes and seconds (export to stored).
    copied: int = 0
    copy_bytes: int = 0
    copy_seconds: float = 0.0
    # Sessions whose copy the target rebuilt from the log instead, by reason (kv_copy.py).
    rebuilt: dict[str, int] = field(default_factory=dict)

    def copy_figures(self) -> str:
        """The copies' size and speed, for the drain's log line."""
        if not self.copied:
            return "0 KV copied"
        mb = self.copy_bytes / 1e6
        rate = mb / self.copy_seconds if self.copy_seconds else 0.0
        per_session = self.copy_seconds * 1000 / self.copied
        return f"{self.copied} KV copied, {mb:.1f} MB, {per_session:.1f} ms a session, {rate:.0f} MB/s"


@dataclass
class _CopyLane:
    """A target's copy streams: the sessions waiting for one, how many stream, their copies' time."""

    target: LinkClient
    url: str
    queue: asyncio.Queue[WorkerSession] = field(default_factory=asyncio.Queue)
    streams: int = 0
    copies: int = 0
    seconds: float = 0.0


async def switch_over(
    service: WorkerService,
    redis: Redis,
    schema: KeySchema,
    *,
    worker_id: str,
    model: str,
    budget_s: float,
    copy_pages: bool = True,
) -> SwitchReport:
    """Hand every attached session to a warm copy on another worker, within `budget_s`; the
    sessions still here afterwards are for the classic handover. `copy_pages`: each session's KV
    pages go to its target first (kv_sender.py); without, or when a copy falls back, the target
    rebuilds the copy from the log."""
    switcher = Switcher(service, time.monotonic() + budget_s, copy_pages=copy_pages, why="drain")
    bindings = [b for b in service.sessions.live() if b.phase is Phase.READY and b.link is not None]
    # How long placement is asked again while no worker has room: a registry entry that lapsed
    # (a busy worker's late beat) is back within its TTL if the worker lives.
    patience_s = service.settings.heartbeat_s * HEARTBEATS_PER_TTL
    for binding in bindings:
        until = min(switcher.deadline, time.monotonic() + patience_s)
        placement = await _place(redis, schema, worker_id, model, until)
        if placement is None:
            break  # nobody has room: these go break-before-make, and end only if no one ever has
        await switcher.warm(binding, placement.worker_id, placement.url)
    await switcher.wait()
    report = switcher.report
    rebuilt = ", ".join(f"{reason}: {n}" for reason, n in sorted(report.rebuilt.items()))
    logger.info(
        "drain: %d session(s) switched to warm copies (%d placed; %d chunks answered here while they "
        "warmed; %s; %d rebuilt from the log%s); %d left for the classic handover",
        report.switched,
        report.placed,
        report.served_while_warming,
        report.copy_figures(),
        sum(report.rebuilt.values()),
        f" ({rebuilt})" if rebuilt else "",
        len(report.fell_back),
    )
    return report


async def _place(
    redis: Redis, schema: KeySchema, worker_id: str, model: str, deadline: float
) -> Placement | None:
    """The session's next worker, asked again every `PLACE_RETRY_S` while none has room, until
    `deadline` (None then). Room comes back within a heartbeat when a worker's registry entry
    lapsed (a busy worker's late beat; under load, the worker just restarted in a rolling
    restart): given up at once, the rest of the drain would go break-before-make."""
    while True:
        try:
            return await place_session(redis, schema, exclude=(worker_id,), model=model or None)
        except CapacityExhausted:
            if time.monotonic() + PLACE_RETRY_S >= deadline:
                return None
            await asyncio.sleep(PLACE_RETRY_S)


class Switcher:
    """The copies asked for, and the switch of each once its copy is warm: a drain's (above) or a
    rebalance's (rebalance.py). `why` names it in the log. Sessions whose copy or switch did not
    happen by the deadline end in `report.fell_back`, still MOVING unless closed meanwhile: the
    caller decides what becomes of them: a drain hands them over (the classic handover, naming the
    target whose copy is warm: `report.targets`). With `stays` (a rebalance) the finish decides:
    they stay here, READY again, and their copies on the targets are withdrawn (`LinkClose` on the
    link that asked: warm.py `withdraw`), as no restore will take them over."""

    def __init__(
        self, service: WorkerService, deadline: float, *, copy_pages: bool, why: str, stays: bool = False
    ) -> None:
        self.service = service
        self.deadline = deadline
        self.copy_pages = copy_pages
        self.why = why
        self.stays = stays
        # worker id -> its copy streams' queue (the sessions waiting for one, in placement order)
        self.copies: dict[str, _CopyLane] = {}
        self.senders: list[KVSender] = []
        self.copiers: list[asyncio.Task[None]] = []
        self.report = SwitchReport()
        # worker id -> this worker's link to it (None: it could not be reached)
        self.targets: dict[str, LinkClient | None] = {}
        # sid -> (its session, its target, the chunks it had answered when its copy was asked for)
        self.waiting: dict[str, tuple[WorkerSession, LinkClient, int]] = {}
        self.readers: list[asyncio.Task[None]] = []
        # Switches run as tasks of their own, never cancelled: one cut short would leave a session
        # neither here nor told to move.
        self.switches: list[asyncio.Task[None]] = []

    async def warm(self, binding: WorkerSession, worker_id: str, url: str) -> None:
        if worker_id not in self.targets:
            self.targets[worker_id] = None
            try:
                secret, timeout = self.service.settings.link_secret, CONNECT_TIMEOUT_S
                client = await LinkClient.open(worker_id, url, secret=secret, open_timeout_s=timeout)
            except (OSError, TimeoutError, websockets.WebSocketException) as exc:
                logger.warning(
                    "%s: cannot reach worker %s to warm sessions on it: %s", self.why, worker_id, exc
                )
                return
            self.targets[worker_id] = client
            self.readers.append(asyncio.create_task(self._read(client)))
        target = self.targets[worker_id]
        if target is None:
            return
        if binding.phase is not Phase.READY or self.service.sessions.get(binding.sid) is not binding:
            return  # closed (or taken over by another socket) while the target was dialed
        self.service.sessions.start_moving(binding)
        self.waiting[binding.sid] = (binding, target, binding.turns_answered)
        self.report.placed += 1
        if self.copy_pages:  # `warm` follows the copy (kv_sender.py), one session after the other
            lane = self.copies.get(worker_id)
            if lane is None:
                lane = self.copies[worker_id] = _CopyLane(target, url)
                self._open_stream(lane)
            lane.queue.put_nowait(binding)
            return
        # A send that fails: the reader sees the link end and gives these to the classic handover.
        with contextlib.suppress(websockets.WebSocketException):
            await target.send(LinkWarm(binding.sid, binding.config))

    def _open_stream(self, lane: _CopyLane) -> None:
        """One more copy stream to `lane`'s target."""
        sender = KVSender(
            self.service.engine,
            lane.target.worker_id,
            lane.url,
            secret=self.service.settings.link_secret,
            timeout_s=CONNECT_TIMEOUT_S,
        )
        lane.streams += 1
        self.senders.append(sender)
        self.copiers.append(asyncio.create_task(self._copy(lane, sender)))

    async def _copy(self, lane: _CopyLane, sender: KVSender) -> None:
        """Copy each session's KV to the lane's target, then ask for its warm copy (caught up from the
        log); after each copy, a second stream where the queue needs it (`wants_second_stream`)."""
        target = lane.target
        while True:
            binding = await lane.queue.get()
            entry = self.waiting.get(binding.sid)
            if entry is None or entry[1] is not target:
                continue  # the link to the target broke meanwhile: the classic handover takes it
            outcome = await sender.send(binding.sid, binding.config)
            lane.copies += 1
            lane.seconds += outcome.seconds
            queued, mean_s, streams = lane.queue.qsize(), lane.seconds / lane.copies, lane.streams
            left_s = self.deadline - time.monotonic()
            if wants_second_stream(streams=streams, queued=queued, mean_copy_s=mean_s, time_left_s=left_s):
                logger.info(
                    "%s: a second KV copy stream to %s: %d sessions wait, %.0f ms a copy so far, %.1f s left",
                    self.why,
                    target.worker_id,
                    queued,
                    mean_s * 1000,
                    left_s,
                )
                self._open_stream(lane)
            metrics = self.service.metrics
            if outcome.fallback is None:
                self.report.copied += 1
                self.report.copy_bytes += outcome.bytes
                self.report.copy_seconds += outcome.seconds
                metrics.kv_copies_sent += 1
                metrics.kv_copy_bytes_sent += outcome.bytes
                metrics.kv_copy_seconds += outcome.seconds
            else:
                reason = outcome.fallback
                self.report.rebuilt[reason] = self.report.rebuilt.get(reason, 0) + 1
                metrics.kv_copy_fell_back(reason)
                logger.warning(
                    "%s: the KV of %s was not copied to %s (%s: %s): it rebuilds the copy from the log",
                    self.why,
                    binding.sid,
                    target.worker_id,
                    reason,
                    outcome.detail,
                )
            with contextlib.suppress(websockets.WebSocketException):
                await target.send(LinkWarm(binding.sid, binding.config))

    async def wait(self, stop: asyncio.Event | None = None, grace_s: float = 0.0) -> None:
        """Until every copy asked for switched or fell back, or the deadline, which `stop` brings
        forward to `grace_s` from when it is set; then `_finish`. Not to be cancelled (a switch cut
        short would leave its session neither here nor told to move): a caller that must end it
        early sets `stop`."""
        try:
            while self.waiting and time.monotonic() < self.deadline:
                if stop is not None and stop.is_set():
                    self.deadline = min(self.deadline, time.monotonic() + grace_s)
                    stop = None
                await asyncio.sleep(0.01)
        finally:
            await self._finish()

    async def _finish(self) -> None:
        """Stop the copies, let every switch begun end, and move the sessions still waiting to
        `report.fell_back` (with `stays`: READY again, their copies withdrawn)."""
        for task in (*self.readers, *self.copiers):
            task.cancel()
        await asyncio.gather(*(s.close() for s in self.senders), return_exceptions=True)
        await asyncio.gather(*self.switches)
        self.report.fell_back += sorted(self.waiting)
        for sid, (_binding, target, _answered) in self.waiting.items():
            self.report.targets[sid] = target.worker_id
        if self.stays:
            for sid in self.report.fell_back:
                left = self.service.sessions.get(sid)
                if left is not None and left.phase is Phase.MOVING:
                    self.service.sessions.stay(left)
            for sid, worker_id in self.report.targets.items():
                asked = self.targets.get(worker_id)
                if asked is not None:
                    with contextlib.suppress(websockets.WebSocketException):
                        await asked.send(LinkClose(sid))
        # The targets keep other unadopted copies a grace period after this link closes (warm.py).
        clients = [t for t in self.targets.values() if t is not None]
        await asyncio.gather(*(t.close() for t in clients), return_exceptions=True)

    async def _read(self, target: LinkClient) -> None:
        try:
            async for frame in target.frames():
                entry = self.waiting.get(frame.sid)
                if entry is None or entry[1] is not target:
                    continue
                del self.waiting[frame.sid]
                if isinstance(frame, LinkWarmed):
                    self.switches.append(asyncio.create_task(self._switch(entry)))
                else:
                    self.report.fell_back.append(frame.sid)
                    logger.warning(
                        "%s: no copy of %s on %s: %s", self.why, frame.sid, target.worker_id, frame
                    )
        except (websockets.WebSocketException, MicroturnError) as exc:
            logger.warning(
                "%s: the link to worker %s broke while warming: %s", self.why, target.worker_id, exc
            )
        # The link ended: no copy of these will come from there (the classic handover takes them).
        for sid, entry in list(self.waiting.items()):
            if entry[1] is target:
                del self.waiting[sid]
                self.report.fell_back.append(sid)

    async def _switch(self, entry: tuple[WorkerSession, LinkClient, int]) -> None:
        binding, target, answered_before = entry
        self.report.served_while_warming += binding.turns_answered - answered_before
        if await _switch(self.service, binding, target.worker_id, self.deadline, self.why):
            self.report.switched += 1
        else:
            self.report.fell_back.append(binding.sid)
            self.report.targets[binding.sid] = target.worker_id  # its copy there is warm


async def _switch(
    service: WorkerService, binding: WorkerSession, target: str, deadline: float, why: str
) -> bool:
    """Send the session over to its warm copy on `target`: chunks arriving from now on wait in the
    gateway's tail; those in flight end here within `SWITCH_WAIT_S`, else the close cancels them
    (unanswered, unlogged: they re-run on the target with the held ones); the log is made durable,
    then `migrate`. False: the client closed it (or it expired) meanwhile, nothing left to move."""
    sid = binding.sid
    if service.sessions.get(sid) is not binding:
        return False
    began = time.monotonic()
    service.sessions.switch(binding)
    waited_until = min(deadline, began + SWITCH_WAIT_S)
    while binding.in_flight and time.monotonic() < waited_until:
        await asyncio.sleep(IN_FLIGHT_POLL_S)
    if service.sessions.get(sid) is not binding:
        return False
    rerun = binding.in_flight
    # Handed over first: a turn still in flight, or one that ends from now on, is neither answered
    # nor logged here (sessions.py `log_turn`), so it re-runs on the target. The engine's close
    # comes after `migrate`: it waits for this worker's step, which the client need not.
    link = service.sessions.hand_over(binding)
    await service.sessions.flush_durably()
    migrate = service.sessions.release(binding, target)
    if link is not None:
        link.send(migrate)
    switched_ms = (time.monotonic() - began) * 1000
    with contextlib.suppress(MicroturnError):  # gone from the engine already: nothing to close
        await asyncio.wrap_future(service.engine.close_session_async(sid, "closed"))
    logger.info(
        "%s: session %s switched to %s in %.0f ms (%d chunk(s) in flight re-run there)",
        why,
        sid,
        target,
        switched_ms,
        rerun,
    )
    return True
