"""What a rolling deploy costs the clients: the longest wait of any chunk while both workers restart.

    python -m loadtest.rolling_restart [--sessions 8] [--history-tokens 1000] [--json F]

Starts an embedded Valkey, two `tiny` workers and `--gateways` gateways (separate processes; the
sessions alternate between the gateways). Each session first gets a history of
`--history-tokens` (prompt chunks, no output), then streams chunks of `--chunk-tokens` tokens
asking for `--output-tokens` outputs every `--period-s`, at most 4 unanswered, as an interaction
model's client would. One run per mode, each on a fresh stack, the same load:
- `steady`: no restart, the reference for the waits a client sees anyway, and for the outputs;
- `warm`: each worker in turn gets SIGTERM (make-before-break drain: each session's KV pages are
  copied to the other worker while it is served there, the copy catches up from the log, then
  the session is switched; `--drain-handover warm`) and starts again;
- `rebuild`: the same with every copy rebuilt from the log instead (`--drain-handover rebuild`,
  the fallback of a copy, and the drain before issue #34);
- `log`: the same with `--drain-handover log` (break-before-make: the sessions move at once and
  the next worker recomputes them from their logs before it answers);
- `one-worker` (not in the default set): no restart and one worker holding every session, as a
  two-worker rolling restart leaves the survivor while the other is down: the waits a client
  sees from the halved capacity alone, with no handover at all.
A chunk's wait is from its send to its `output.done`. Reported per run: p50, p99, the longest,
each drain's duration, chunks never answered (`lost`), sessions that ended (`ended`), and chunks
whose output differs from the steady run's for the same session and seq (`differ`; the sessions'
inputs are seeded, so the runs send the same chunks); for `warm` the KV copies' MB/s and ms a
session (the drained workers' lines), for `warm` and `rebuild` the copies rebuilt from the log and
their ms a session (the targets' lines); and whether the warm run's longest wait is within 1 s and
within 2x the steady run's p99 (issues #27 and #34). The fault scenario of issue #34 (8 sessions,
~10 chunks/s each, two gateways) is `--gateways 2 --chunk-tokens 48 --output-tokens 2 --modes
steady,warm`. docs/benchmarks.md has the figures and the commands.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import re
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
from shared.protocol.messages import Error, OutputDone, SessionClosed

logger = logging.getLogger(__name__)

VOCAB: Final = 256  # the tiny model's
CHUNK_TOKENS: Final = 4
OUTPUT_TOKENS: Final = 1
PROMPT_PIECE: Final = 256
WINDOW: Final = 4
READY_TIMEOUT_S: Final = 60.0
MODES: Final = ("steady", "warm", "rebuild", "log")
# The drained worker's switch-over line (worker/server/switchover.py) and a target's line for a
# copy rebuilt from the log (worker/server/warm.py).
COPY_LINE: Final = re.compile(r"drain: [^\n]*?(\d+) KV copied, ([\d.]+) MB, ([\d.]+) ms a session")
# A rebalance round's line (worker/server/rebalance.py, with `--rebalance-gap`): sessions moved.
REBALANCE_LINE: Final = re.compile(r"rebalance: (\d+) of \d+ session\(s\) moved to")
REBUILD_LINE: Final = re.compile(r"ready: (\d+) tokens, .*rebuilt from the log, in (\d+) ms")
# The drained worker's summary: sessions switched to warm copies, placed, and KV copies that fell
# back to a rebuild from the log; then its classic handover's: every session handed over
# break-before-make (those left after the switches, and those no worker had room for).
DRAIN_LINE: Final = re.compile(
    r"drain: (\d+) session\(s\) switched to warm copies \((\d+) placed;.*?(\d+) rebuilt from the log"
)
HANDOVER_LINE: Final = re.compile(r"drained: (\d+) session\(s\) handed to their gateways")
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
    # Sessions that ended (closed, or a fatal error), and chunks whose output differs from the
    # steady run's (filled in by `main`).
    ended: int = 0
    differ: int = 0
    # KV copies (count, MB, seconds) and copies rebuilt from the log (count, tokens, seconds).
    copies: int = 0
    copy_mb: float = 0.0
    copy_s: float = 0.0
    rebuilds: int = 0
    rebuilt_tokens: int = 0
    rebuild_s: float = 0.0
    # From the drained workers' summaries: sessions placed, switched to their copy, whose KV copy
    # fell back to a rebuild from the log, and handed over break-before-make (the ones that stall).
    placed: int = 0
    switched: int = 0
    fell_back_to_rebuild: int = 0
    classic: int = 0
    # Sessions the workers' rebalance rounds moved (0 without `--rebalance-gap`).
    rebalanced: int = 0
    # Each session's outputs by seq, for the comparison with the steady run (not in `--json`).
    outputs: list[dict[int, tuple[int, ...]]] = field(default_factory=list)
    # (seconds since the load began, what happened): SIGTERMs, exits, workers ready again.
    events: list[tuple[float, str]] = field(default_factory=list)
    # (seconds since the load began that the chunk was sent, its wait in ms, its session), for
    # `--timeline`.
    waits: list[tuple[float, float, int]] = field(default_factory=list)


class _Stack:
    def __init__(self, workdir: Path, handover: str, gateways: int = 1, rebalance_gap: int = 0) -> None:
        self.workdir = workdir
        self.handover = handover
        self.gateways = gateways
        self.rebalance_gap = rebalance_gap
        self.children: list[Child] = []
        self.workers: dict[str, tuple[Child, int]] = {}
        self.redis_url = ""
        self.gateway_ports: list[int] = []

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
        for index in range(self.gateways):
            self.start_gateway(index)

    def start_gateway(self, index: int) -> None:
        port = free_port()
        self.gateway_ports.append(port)
        argv = [sys.executable, "-m", "microturn", "gateway", "--port", str(port)]
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
        self._spawn(f"gateway-{index}", argv)
        _wait(lambda: http_ready(f"http://127.0.0.1:{port}/readyz"), f"gateway {index}")

    def start_worker(self, worker_id: str) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "microturn", "worker", "--model", "tiny", "--port", str(port)]
        argv += ["--redis-url", self.redis_url, "--worker-id", worker_id, "--kv-tokens", "262144"]
        argv += ["--max-sessions", "256", "--drain-handover", self.handover, "--heartbeat-s", "0.5"]
        if self.rebalance_gap:  # a round every two heartbeats
            argv += ["--rebalance-gap", str(self.rebalance_gap), "--rebalance-period-s", "1"]
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

    def copy_figures(self, run: Run) -> None:
        """The KV copies (drained workers' lines) and the copies rebuilt from the log (targets')."""
        for worker_id in self.workers:
            text = (self.workdir / f"worker-{worker_id}.log").read_text(errors="replace")
            for count, mb, ms in COPY_LINE.findall(text):
                run.copies += int(count)
                run.copy_mb += float(mb)
                run.copy_s += float(ms) * int(count) / 1000
            for switched, placed, rebuilt in DRAIN_LINE.findall(text):
                run.switched += int(switched)
                run.placed += int(placed)
                run.fell_back_to_rebuild += int(rebuilt)
            run.classic += sum(int(count) for count in HANDOVER_LINE.findall(text))
            run.rebalanced += sum(int(count) for count in REBALANCE_LINE.findall(text))
            for tokens, ms in REBUILD_LINE.findall(text):
                run.rebuilds += 1
                run.rebuilt_tokens += int(tokens)
                run.rebuild_s += int(ms) / 1000


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
    outputs: dict[int, tuple[int, ...]] = field(default_factory=dict)
    ended: bool = False
    chunk_tokens: int = CHUNK_TOKENS
    output_tokens: int = OUTPUT_TOKENS

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
            chunk = [self.rng.randrange(1, VOCAB) for _ in range(self.chunk_tokens)]
            await self.client.send_chunk(self.seq, tokens=chunk, max_output_tokens=self.output_tokens)
            await asyncio.sleep(period_s)

    async def receive(self) -> None:
        while True:
            msg = await self.client.recv(timeout=120)
            if isinstance(msg, SessionClosed) or (isinstance(msg, Error) and msg.fatal):
                self.ended = True
            if isinstance(msg, OutputDone):
                self.outputs.setdefault(msg.seq, msg.tokens)
                sent = self.sent_at.pop(msg.seq, None)
                wait = 0.0 if sent is None else time.monotonic() - sent
                self.waits.append(wait)
                if sent is not None:
                    self.timeline.append((sent, wait))
                self.answered.set()


async def _load(stack: _Stack, run: Run, period_s: float, phase_s: float, shape: tuple[int, int]) -> None:
    sessions = []
    for i in range(run.sessions):
        port = stack.gateway_ports[i % len(stack.gateway_ports)]
        client = await RealtimeClient.connect(f"ws://127.0.0.1:{port}/v1/realtime")
        await client.open(stop_token_ids=[], max_output_tokens=0)
        sessions.append(_Session(client, random.Random(i), chunk_tokens=shape[0], output_tokens=shape[1]))
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
    run.ended = sum(s.ended for s in sessions)
    run.outputs = [s.outputs for s in sessions]
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
    gateways: int = 1,
    shape: tuple[int, int] = (CHUNK_TOKENS, OUTPUT_TOKENS),
    rebalance_gap: int = 0,
) -> Run:
    """One run on a fresh stack; its processes' logs go to `logs/<mode>/` (default: a temporary dir).
    `shape`: each streamed chunk's tokens and the outputs it asks for; `rebalance_gap`: the workers'
    `--rebalance-gap` (0: off)."""
    run = Run(mode, sessions, history_tokens)
    with tempfile.TemporaryDirectory(prefix="rolling-restart-") as scratch:
        workdir = Path(scratch) if logs is None else logs / mode
        workdir.mkdir(parents=True, exist_ok=True)
        stack = _Stack(workdir, mode if mode in ("log", "rebuild") else "warm", gateways, rebalance_gap)
        try:
            stack.start(("w0",) if mode == ONE_WORKER else ("w0", "w1"))
            asyncio.run(_load(stack, run, period_s, phase_s, shape))
        finally:
            stack.stop()
        stack.copy_figures(run)
    return run


def _summary(fields: list[tuple[str, object]]) -> dict[str, object]:
    """A run for `--json`: everything but the per-chunk timeline and the outputs."""
    return {name: value for name, value in fields if name not in ("waits", "outputs")}


def _differing(run: Run, reference: Run) -> int:
    """Chunks of `run` whose output differs from `reference`'s for the same session and seq."""
    return sum(
        ours[seq] != theirs[seq]
        for ours, theirs in zip(run.outputs, reference.outputs, strict=True)
        for seq in ours.keys() & theirs.keys()
    )


def longest_by_window(run: Run) -> dict[str, float]:
    """The longest wait (ms) of the chunks whose wait overlaps a drain (SIGTERM to the worker's
    exit), else a restart (exit to ready again: the restarted worker boots on the same cores as the
    one serving everything meanwhile), else neither: where the longest wait of a run comes from."""
    starts = {"SIGTERM": "drain", "exited": "restart"}
    windows: list[tuple[str, float, float]] = []
    for (at, what), (until, _) in zip(run.events, run.events[1:], strict=False):
        kind = next((name for word, name in starts.items() if word in what), None)
        if kind is not None:
            windows.append((kind, at, until))
    longest = {"drain": 0.0, "restart": 0.0, "serving": 0.0}
    for sent, wait_ms, _ in run.waits:
        answered = sent + wait_ms / 1000
        overlapping = [kind for kind, at, until in windows if sent < until and answered > at]
        window = "drain" if "drain" in overlapping else overlapping[0] if overlapping else "serving"
        longest[window] = max(longest[window], wait_ms)
    return longest


def _verdicts(warm: Run, steady: Run) -> list[str]:
    """Issue #34's targets, one line each: the longest wait under 1 s (every scenario), within 2x
    the steady run's p99 (the 8 x 1k, 32 x 1k and 8 x 4k runs), nothing lost, ended or different
    (every scenario), every placed session moved by its copy."""

    def verdict(met: bool) -> str:
        return "met" if met else "MISSED"

    clean = warm.lost == warm.ended == warm.differ == 0
    return [
        f"warm: longest wait {warm.max_ms:.0f} ms <= 1000 ms: {verdict(warm.max_ms <= 1000)}",
        f"warm: longest wait {warm.max_ms:.0f} ms <= 2 x steady p99 = {2 * steady.p99_ms:.0f} ms: "
        f"{verdict(warm.max_ms <= 2 * steady.p99_ms)}",
        f"warm: lost {warm.lost}, ended {warm.ended}, differ {warm.differ}: {verdict(clean)}",
        f"warm: {warm.switched} of {warm.placed} placed sessions switched to their copy, "
        f"{warm.fell_back_to_rebuild} KV copies rebuilt, {warm.classic} break-before-make: "
        f"{verdict(warm.switched == warm.placed and not warm.fell_back_to_rebuild and not warm.classic)}",
    ]


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
    parser.add_argument("--gateways", type=int, default=1, help="the sessions alternate between them")
    parser.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS, help="tokens of a streamed chunk")
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS, help="outputs a chunk asks for")
    parser.add_argument(
        "--rebalance-gap", type=int, default=0, help="the workers' --rebalance-gap (0: no rebalance)"
    )
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
            gateways=args.gateways,
            shape=(args.chunk_tokens, args.output_tokens),
            rebalance_gap=args.rebalance_gap,
        )
        for mode in args.modes.split(",")
    ]
    by_mode = {r.mode: r for r in runs}
    if "steady" in by_mode:
        for r in runs:
            r.differ = _differing(r, by_mode["steady"])
    columns = ("mode", "sessions", "history", "chunks", "p50 ms", "p99 ms", "max ms")
    header = f"{columns[0]:<7} " + " ".join(f"{c:>8}" for c in columns[1:])
    lines = [header + " lost ended differ drains s"]
    for r in runs:
        drains = " ".join(f"{d:.2f}" for d in r.drains_s) or "-"
        lines.append(
            f"{r.mode:<7} {r.sessions:>8} {r.history_tokens:>8} {r.chunks:>8} {r.p50_ms:>8.1f} "
            f"{r.p99_ms:>8.1f} {r.max_ms:>8.1f} {r.lost:>4} {r.ended:>5} {r.differ:>6} {drains}"
        )
    for r in runs:
        if r.placed or r.classic:
            lines.append(
                f"{r.mode}: {r.placed} sessions placed, {r.switched} switched to their copy, "
                f"{r.fell_back_to_rebuild} KV copies fell back to a rebuild, {r.classic} handed over "
                "break-before-make"
            )
        if r.copies:
            lines.append(
                f"{r.mode}: {r.copies} KV copies, {r.copy_mb / r.copies:.1f} MB and "
                f"{1000 * r.copy_s / r.copies:.1f} ms a session ({r.copy_mb / max(r.copy_s, 1e-9):.0f} MB/s)"
            )
        if r.rebalanced:
            lines.append(f"{r.mode}: {r.rebalanced} sessions moved by rebalance rounds")
        if r.rebuilds:
            lines.append(
                f"{r.mode}: {r.rebuilds} copies rebuilt from the log, {r.rebuilt_tokens // r.rebuilds} "
                f"tokens and {1000 * r.rebuild_s / r.rebuilds:.0f} ms a session "
                f"({r.rebuilt_tokens / max(r.rebuild_s, 1e-9):.0f} tokens/s)"
            )
    for r in runs:
        if r.events:
            by_window = longest_by_window(r)
            lines.append(
                f"{r.mode}: longest wait overlapping a drain {by_window['drain']:.0f} ms, a restart "
                f"{by_window['restart']:.0f} ms, neither {by_window['serving']:.0f} ms"
            )
    if "warm" in by_mode and "steady" in by_mode:
        lines += _verdicts(by_mode["warm"], by_mode["steady"])
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        write_json({"runs": [asdict(r, dict_factory=_summary) for r in runs]}, args.json)
    if args.timeline:
        write_json({"runs": [asdict(r) for r in runs]}, args.timeline)
    return 0 if all(r.lost == 0 and r.ended == 0 and r.differ == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
