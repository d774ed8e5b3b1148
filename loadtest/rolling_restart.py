"""What a rolling deploy costs the clients: the longest wait of any chunk while both workers restart.

    python -m loadtest.rolling_restart [--sessions 8] [--history-tokens 1000] [--json F]

Starts an embedded Valkey, two `tiny` workers and one gateway (separate processes). Each session
first gets a history of `--history-tokens` (prompt chunks, no output), then streams chunks of 4
tokens asking for 1 output every `--period-s`, at most 4 unanswered, as an interaction model's
client would. Three runs, each on a fresh stack, the same load:
- `steady`: no restart, the reference for the waits a client sees anyway;
- `warm`: each worker in turn gets SIGTERM (make-before-break drain: sessions are rebuilt on the
  other worker while they are served, then switched; `--drain-handover warm`) and starts again;
- `log`: the same with `--drain-handover log` (break-before-make: the sessions move at once and
  the next worker recomputes them from their logs before it answers);
- `one-worker` (not in the default set): no restart and one worker holding every session, as a
  two-worker rolling restart leaves the survivor while the other is down: the waits a client
  sees from the halved capacity alone, with no handover at all.
A chunk's wait is from its send to its `output.done`. Reported per run: p50, p99, the longest, and
each drain's duration; and whether the warm run's longest wait is within 1 s and within 2x the
steady run's p99 (issue #27's target). docs/benchmarks.md has the figures and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

from loadtest.report_files import write_json
from microturn.processes import Child, free_port, http_ready, redis_answers, spawn, valkey_binary
from shared.client.clients import RealtimeClient
from shared.protocol.messages import OutputDone

logger = logging.getLogger(__name__)

VOCAB: Final = 256  # the tiny model's
CHUNK_TOKENS: Final = 4
OUTPUT_TOKENS: Final = 1
PROMPT_PIECE: Final = 256
WINDOW: Final = 4
READY_TIMEOUT_S: Final = 60.0
MODES: Final = ("steady", "warm", "log")
ONE_WORKER: Final = "one-worker"  # a reference mode, not in the default set
NO_RESTART: Final = ("steady", ONE_WORKER)
# What a drain plus a worker's restart take here, so the steady run streams as long as the others.
STEADY_RESTART_S: Final = 4.0


@dataclass
class Run:
    mode: str
    sessions: int
    history_tokens: int
    chunks: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    drains_s: list[float] = field(default_factory=list)
    lost: int = 0
    # (seconds since the load began, what happened): SIGTERMs, exits, workers ready again.
    events: list[tuple[float, str]] = field(default_factory=list)
    # (seconds since the load began that the chunk was sent, its wait in ms, its session), for
    # `--timeline`.
    waits: list[tuple[float, float, int]] = field(default_factory=list)


class _Stack:
    def __init__(self, workdir: Path, handover: str) -> None:
        self.workdir = workdir
        self.handover = handover
        self.children: list[Child] = []
        self.workers: dict[str, tuple[Child, int]] = {}
        self.redis_url = ""
        self.gateway_port = 0

    def _spawn(self, name: str, argv: list[str]) -> Child:
        log = (self.workdir / f"{name}.log").open("ab")
        child = spawn(name, argv, 15.0, log)
        self.children.append(child)
        return child

    def start(self, workers: tuple[str, ...] = ("w0", "w1")) -> None:
        port = free_port()
        self._spawn("valkey", [str(valkey_binary()), "--port", str(port), "--save", "", "--appendonly", "no"])
        _wait(lambda: redis_answers("127.0.0.1", port), "valkey")
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        for worker_id in workers:
            self.start_worker(worker_id)
        self.gateway_port = free_port()
        argv = [sys.executable, "-m", "microturn", "gateway", "--port", str(self.gateway_port)]
        argv += [
            "--redis-url",
            self.redis_url,
            "--auth",
            "off",
            "--max-chunks-per-s",
            "1000",
            "--chunk-burst",
            "200",
        ]
        self._spawn("gateway", argv)
        _wait(lambda: http_ready(f"http://127.0.0.1:{self.gateway_port}/readyz"), "gateway")

    def start_worker(self, worker_id: str) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "microturn", "worker", "--model", "tiny", "--port", str(port)]
        argv += ["--redis-url", self.redis_url, "--worker-id", worker_id, "--kv-tokens", "262144"]
        argv += ["--max-sessions", "256", "--drain-handover", self.handover, "--heartbeat-s", "0.5"]
        child = self._spawn(f"worker-{worker_id}", argv)
        self.workers[worker_id] = (child, port)
        _wait(lambda: http_ready(f"http://127.0.0.1:{port}/readyz"), worker_id)

    def drain(self, worker_id: str) -> float:
        child, _port = self.workers[worker_id]
        started = time.monotonic()
        child.proc.send_signal(signal.SIGTERM)
        child.proc.wait(60)
        return time.monotonic() - started

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


def _wait(ready: object, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


@dataclass
class _Session:
    client: RealtimeClient
    rng: random.Random
    seq: int = 0
    sent_at: dict[int, float] = field(default_factory=dict)
    waits: list[float] = field(default_factory=list)
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (sent at, wait) of streamed chunks
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    stop: bool = False

    async def prompt(self, tokens: int) -> None:
        """The history, a piece at a time (a worker bounds what one session may queue)."""
        while tokens > 0:
            piece = min(tokens, PROMPT_PIECE)
            self.seq += 1
            await self.client.send_chunk(
                self.seq, tokens=[self.rng.randrange(1, VOCAB) for _ in range(piece)]
            )
            tokens -= piece
            while len(self.waits) < self.seq:
                self.answered.clear()
                await asyncio.wait_for(self.answered.wait(), 120)
        self.waits.clear()

    async def stream(self, period_s: float) -> None:
        while not self.stop:
            while len(self.sent_at) >= WINDOW:
                self.answered.clear()
                await asyncio.wait_for(self.answered.wait(), 120)
            self.seq += 1
            self.sent_at[self.seq] = time.monotonic()
            chunk = [self.rng.randrange(1, VOCAB) for _ in range(CHUNK_TOKENS)]
            await self.client.send_chunk(self.seq, tokens=chunk, max_output_tokens=OUTPUT_TOKENS)
            await asyncio.sleep(period_s)

    async def receive(self) -> None:
        while True:
            msg = await self.client.recv(timeout=120)
            if isinstance(msg, OutputDone):
                sent = self.sent_at.pop(msg.seq, None)
                wait = 0.0 if sent is None else time.monotonic() - sent
                self.waits.append(wait)
                if sent is not None:
                    self.timeline.append((sent, wait))
                self.answered.set()


async def _load(stack: _Stack, run: Run, period_s: float, phase_s: float) -> None:
    url = f"ws://127.0.0.1:{stack.gateway_port}/v1/realtime"
    sessions = []
    for i in range(run.sessions):
        client = await RealtimeClient.connect(url)
        await client.open(stop_token_ids=[], max_output_tokens=0)
        sessions.append(_Session(client, random.Random(i)))
    receivers = [asyncio.create_task(s.receive()) for s in sessions]
    await asyncio.gather(*(s.prompt(run.history_tokens) for s in sessions))
    began = time.monotonic()
    streams = [asyncio.create_task(s.stream(period_s)) for s in sessions]
    await asyncio.sleep(phase_s)
    for worker_id in ("w0", "w1"):
        if run.mode in NO_RESTART:
            await asyncio.sleep(STEADY_RESTART_S)  # as long as a drain and a restart, under the same load
        else:
            run.events.append((time.monotonic() - began, f"SIGTERM {worker_id}"))
            run.drains_s.append(await asyncio.to_thread(stack.drain, worker_id))
            run.events.append((time.monotonic() - began, f"{worker_id} exited; starting it again"))
            await asyncio.to_thread(stack.start_worker, worker_id)
            run.events.append((time.monotonic() - began, f"{worker_id} ready"))
        await asyncio.sleep(phase_s)
    for s in sessions:
        s.stop = True
    await asyncio.gather(*streams)
    deadline = time.monotonic() + 60
    while any(s.sent_at for s in sessions) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    run.lost = sum(len(s.sent_at) for s in sessions)
    for task in receivers:
        task.cancel()
    await asyncio.gather(*receivers, return_exceptions=True)
    for s in sessions:
        await s.client.close()
    run.waits = sorted(
        (round(sent - began, 4), round(1000 * wait, 2), i)
        for i, s in enumerate(sessions)
        for sent, wait in s.timeline
    )
    waits = sorted(w for s in sessions for w in s.waits)
    run.chunks = len(waits)
    run.p50_ms = 1000 * waits[len(waits) // 2]
    run.p99_ms = 1000 * waits[min(len(waits) - 1, int(len(waits) * 0.99))]
    run.max_ms = 1000 * waits[-1]


def measure(
    mode: str,
    sessions: int,
    history_tokens: int,
    *,
    period_s: float,
    phase_s: float,
    logs: Path | None = None,
) -> Run:
    """One run on a fresh stack; its processes' logs go to `logs/<mode>/` (default: a temporary dir)."""
    run = Run(mode, sessions, history_tokens)
    with tempfile.TemporaryDirectory(prefix="rolling-restart-") as scratch:
        workdir = Path(scratch) if logs is None else logs / mode
        workdir.mkdir(parents=True, exist_ok=True)
        stack = _Stack(workdir, "log" if mode == "log" else "warm")
        try:
            stack.start(("w0",) if mode == ONE_WORKER else ("w0", "w1"))
            asyncio.run(_load(stack, run, period_s, phase_s))
        finally:
            stack.stop()
    return run


def _summary(fields: list[tuple[str, object]]) -> dict[str, object]:
    """A run for `--json`: everything but the per-chunk timeline."""
    return {name: value for name, value in fields if name != "waits"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.rolling_restart", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--history-tokens", type=int, default=1000)
    parser.add_argument("--period-s", type=float, default=0.1, help="between a session's chunks")
    parser.add_argument(
        "--phase-s", type=float, default=3.0, help="load before, between and after the drains"
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated; also: {ONE_WORKER}")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="keep each process's log under this folder")
    parser.add_argument(
        "--timeline", type=Path, help="write each streamed chunk's send time and wait, and the drains' events"
    )
    args = parser.parse_args(argv)
    known = (*MODES, ONE_WORKER)
    unknown = set(args.modes.split(",")) - set(known)
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}: choose from {', '.join(known)}")
    logging.basicConfig(level=logging.WARNING)
    runs = [
        measure(
            mode,
            args.sessions,
            args.history_tokens,
            period_s=args.period_s,
            phase_s=args.phase_s,
            logs=args.logs,
        )
        for mode in args.modes.split(",")
    ]
    columns = ("mode", "sessions", "history", "chunks", "p50 ms", "p99 ms", "max ms")
    lines = [f"{columns[0]:<7} " + " ".join(f"{c:>8}" for c in columns[1:]) + " lost drains s"]
    for r in runs:
        drains = " ".join(f"{d:.2f}" for d in r.drains_s) or "-"
        lines.append(
            f"{r.mode:<7} {r.sessions:>8} {r.history_tokens:>8} {r.chunks:>7} {r.p50_ms:>8.1f} "
            f"{r.p99_ms:>8.1f} {r.max_ms:>8.1f} {r.lost:>4} {drains}"
        )
    by_mode = {r.mode: r for r in runs}
    if "warm" in by_mode and "steady" in by_mode:
        warm, steady = by_mode["warm"], by_mode["steady"]
        met = warm.max_ms <= min(1000, 2 * steady.p99_ms)
        lines.append(
            f"warm: longest wait {warm.max_ms:.0f} ms (target <= 1000 ms and <= 2 x steady p99 = "
            f"{2 * steady.p99_ms:.0f} ms): {'met' if met else 'MISSED'}"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        write_json({"runs": [asdict(r, dict_factory=_summary) for r in runs]}, args.json)
    if args.timeline:
        write_json({"runs": [asdict(r) for r in runs]}, args.timeline)
    return 0 if all(r.lost == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
