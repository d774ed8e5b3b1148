"""Helpers of the fault suite (tests/gateway/test_fault_*.py): a Redis that can be killed and
restarted empty on the same port, and a client session that streams at a steady pace while it
records every message, so a test can count answers per chunk across a failure.

Why a streamer and not `RealtimeClient.turn`: the faults under test happen *between* a chunk and its
answer; chunks must be in flight (several per session) when a worker dies or drains, which a
send-and-wait loop would rarely produce.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest
from redis.asyncio import Redis

from shared.client.clients import ConnectionLost, RealtimeClient, SessionClosedError
from shared.protocol.messages import Error, OutputDone, ServerMessage, SessionClosed, SessionRestored
from shared.store.registry import read_session
from shared.store.schema import KeySchema
from tests.shared.redis_servers import REDIS_SERVER, ServerUnavailable, answers_ping, free_port
from tests.system.gateway.conftest import GATEWAY_FLAGS, WORKER_FLAGS
from tests.system.gateway.reference import SESSION_CONFIG, stream, text_stream
from tests.system.gateway.stack import Stack, running_stack, stop

logger = logging.getLogger(__name__)

START_TIMEOUT_S: Final = 10.0


@dataclass
class RestartableRedis:
    """A real redis-server without persistence: a restart comes back with no keys at all."""

    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which(REDIS_SERVER)
        if binary is None:
            raise ServerUnavailable(f"{REDIS_SERVER} is not installed")
        self.starts += 1
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.workdir)]
        with open(self.workdir / f"redis-{self.port}-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers_ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None


@contextlib.contextmanager
def restartable_redis(workdir: Path) -> Iterator[RestartableRedis]:
    server = RestartableRedis(workdir)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@contextlib.contextmanager
def fault_stack(
    tmp_path: Path, *, workers: int = 2, gateways: int = 2
) -> Iterator[tuple[RestartableRedis, Stack, str]]:
    """A Redis the test may kill and restart, and the stack on it under a fresh key prefix
    (workers and gateways with the suite's flags); skips when no redis-server is installed."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    try:
        redis_cm = restartable_redis(tmp_path)
        server = redis_cm.__enter__()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    try:
        flags = {"worker_flags": WORKER_FLAGS, "gateway_flags": GATEWAY_FLAGS}
        with running_stack(
            server.url, prefix, tmp_path, workers=workers, gateways=gateways, **flags
        ) as stack:
            yield server, stack, prefix
    finally:
        redis_cm.__exit__(None, None, None)


@dataclass
class Streamer:
    """One session streaming chunks of reference stream `seed` (its text stream when `text`) every
    `period_s`, at most `window` chunks unanswered, and recording everything it receives."""

    client: RealtimeClient
    seed: int
    turns: int
    period_s: float = 0.05
    window: int = 4
    text: bool = False
    session_id: str = ""
    resume_token: str = ""
    dones: dict[int, list[OutputDone]] = field(default_factory=dict)
    errors: list[Error] = field(default_factory=list)
    restored: list[float] = field(default_factory=list)  # monotonic arrival of each session.restored
    notices: list[ServerMessage] = field(default_factory=list)  # other unsolicited messages
    closed: SessionClosed | None = None
    sent: int = 0
    first_sent_at: float = 0.0
    last_done_at: float = 0.0
    # seq -> monotonic send time, and each answered chunk's wait from its send to its first done.
    sent_at: dict[int, float] = field(default_factory=dict)
    waits: dict[int, float] = field(default_factory=dict)
    _answered: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    async def open(cls, url: str, seed: int, turns: int, *, text: bool = False, **kwargs: float) -> Streamer:
        client = await RealtimeClient.connect(url)
        opened = await client.open(**SESSION_CONFIG)
        streamer = cls(client, seed, turns, text=text, **kwargs)  # type: ignore[arg-type]
        streamer.session_id, streamer.resume_token = opened.session_id, opened.resume_token
        return streamer

    def unanswered(self) -> int:
        return sum(1 for seq in range(1, self.sent + 1) if seq not in self.dones)

    async def send_until(self, last: int) -> None:
        """Send chunks up to seq `last` at the pace, keeping at most `window` unanswered."""
        chunks = stream(self.seed, self.turns)
        texts = text_stream(self.seed, self.turns) if self.text else []
        while self.sent < last:
            while self.unanswered() >= self.window:
                self._answered.clear()
                await asyncio.wait_for(self._answered.wait(), 60)
            self.sent += 1
            self.sent_at[self.sent] = time.monotonic()
            if self.sent == 1:
                self.first_sent_at = self.sent_at[1]
            if self.text:
                piece, k = texts[self.sent - 1]
                await self.client.send_chunk(self.sent, text=piece, max_output_tokens=k)
            else:
                await self.client.send_chunk(self.sent, tokens=chunks[self.sent - 1])
            await asyncio.sleep(self.period_s)

    async def answered(self, last: int) -> None:
        """Wait until every chunk up to seq `last` has its answer (a done, or an error naming it)."""
        while any(seq not in self.dones for seq in range(1, last + 1)):
            self._answered.clear()
            await asyncio.wait_for(self._answered.wait(), 60)

    async def receive(self) -> None:
        """Record messages until every chunk up to `turns` is answered or the session ends."""
        while len(self.dones) < self.turns:
            try:
                msg = await self.client.recv(timeout=60)
            except (ConnectionLost, SessionClosedError) as exc:
                logger.warning("stream %d ended: %s", self.seed, exc)
                return
            if isinstance(msg, OutputDone):
                self.dones.setdefault(msg.seq, []).append(msg)
                self.last_done_at = time.monotonic()
                if msg.seq in self.sent_at:
                    self.waits.setdefault(msg.seq, self.last_done_at - self.sent_at[msg.seq])
                self._answered.set()
            elif isinstance(msg, Error):
                self.errors.append(msg)
                if msg.seq is not None:  # an answered chunk (counted lost: it would need a resend)
                    self.dones.setdefault(msg.seq, [])
                self._answered.set()
                if msg.fatal:
                    return
            elif isinstance(msg, SessionRestored):
                self.restored.append(time.monotonic())
            elif isinstance(msg, SessionClosed):
                self.closed = msg
                return
            else:
                self.notices.append(msg)

    def outputs(self) -> list[list[int]]:
        return [list(self.dones[seq][0].tokens) for seq in sorted(self.dones) if self.dones[seq]]


@dataclass(frozen=True)
class Tally:
    """What the fault suite prints and asserts, over all sessions of a scenario."""

    sessions: int
    continued: int  # every chunk answered, no session end
    lost: int  # chunks with no output.done (an error answer counts as lost)
    duplicated: int  # chunks with more than one output.done
    identical: int  # sessions whose outputs equal the uninterrupted reference
    restored: int  # session.restored notices received
    chunks_per_s: float  # answered chunks per second per session, averaged over the sessions
    longest_wait_s: float  # the longest any chunk waited from its send to its output.done

    def line(self, name: str) -> str:
        return (
            f"[fault] {name}: sessions={self.sessions} continued={self.continued} lost_turns={self.lost} "
            f"duplicate_answers={self.duplicated} identical_to_reference={self.identical} "
            f"restores={self.restored} chunks_per_s_per_session={self.chunks_per_s:.1f} "
            f"longest_wait_s={self.longest_wait_s:.2f}"
        )


def tally(streamers: list[Streamer], expected: dict[int, list[list[int]]]) -> Tally:
    lost = duplicated = identical = continued = restored = 0
    rates = []
    for s in streamers:
        if s.last_done_at > s.first_sent_at:
            rates.append(len(s.dones) / (s.last_done_at - s.first_sent_at))
        counts = Counter({seq: len(s.dones.get(seq, [])) for seq in range(1, s.turns + 1)})
        lost += sum(1 for n in counts.values() if n == 0)
        duplicated += sum(1 for n in counts.values() if n > 1)
        if all(n == 1 for n in counts.values()) and s.closed is None and not s.errors:
            continued += 1
        if s.outputs() == expected[s.seed][: s.turns] and len(s.outputs()) == s.turns:
            identical += 1
        restored += len(s.restored)
    rate = sum(rates) / len(rates) if rates else 0.0
    longest = max((wait for s in streamers for wait in s.waits.values()), default=0.0)
    return Tally(len(streamers), continued, lost, duplicated, identical, restored, rate, longest)


@dataclass(frozen=True)
class Kill:
    victim: str
    moved: list[Streamer]
    in_flight: int
    killed_at: float


async def kill_busiest_worker(
    stack: Stack, streamers: list[Streamer], redis: Redis, schema: KeySchema, turns: int
) -> Kill:
    """Once the streamers are running: keep them sending up to `turns`, and SIGKILL the worker that
    holds the most sessions while chunks are in flight on it (the worst moment), or after 2 s."""
    placed = {}
    for s in streamers:
        record = await read_session(redis, schema, s.session_id)
        assert record is not None
        placed[s.seed] = record.worker
    victim = Counter(placed.values()).most_common(1)[0][0]
    moved = [s for s in streamers if placed[s.seed] == victim]
    senders = asyncio.gather(*(s.send_until(turns) for s in streamers))
    deadline = time.monotonic() + 2.0
    while sum(s.unanswered() for s in moved) < len(moved) and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    in_flight = sum(s.unanswered() for s in moved)
    killed_at = time.monotonic()
    stop(stack.workers[victim], signal.SIGKILL)
    await senders
    return Kill(victim, moved, in_flight, killed_at)
