"""`python -m loadtest.gateway_sessions`: what N open sessions cost one gateway process.

One real stack (embedded Valkey, one `tiny` worker, one gateway; microturn/stack.py). Then:

1. 8 active sessions stream for `--duration-s` (a chunk of 16 tokens every 200 ms, 8 output tokens
   every 5th chunk, as the Locust user does): their chunk latencies, and the Redis commands the
   whole stack ran meanwhile (`INFO commandstats`, reset first), per active session per second;
2. N idle sessions are opened, `--concurrency` at a time: opens per second, and the gateway's RSS
   before and after (psutil), per session;
3. the same 8 active sessions stream again beside the N idle ones.

The report is printed and, with `--json`, written. docs/scaling.md holds the figures measured here
and the arithmetic built on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from redis.asyncio import Redis

from microturn.processes import free_port
from microturn.stack import Stack, StackOptions
from shared.client import RealtimeClient
from shared.store.values import text

logger = logging.getLogger(__name__)

ACTIVE_SESSIONS = 8
CHUNK_PERIOD_S = 0.2
CHUNK_TOKENS = 16
REPLY_EVERY = 5
REPLY_TOKENS = 8


@dataclass(frozen=True)
class Phase:
    """One streaming phase of the active sessions."""

    chunks: int
    p50_ms: float
    p99_ms: float
    # Redis commands the stack ran during the phase, per active session per second, by command.
    redis_per_session_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    sessions: int
    opens_per_s: float
    rss_before_mib: float
    rss_after_mib: float
    kib_per_session: float
    alone: Phase
    beside_idle: Phase


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def _stream(url: str, index: int, duration_s: float) -> list[float]:
    """One active session: chunks at the realtime pace; each chunk's send-to-done in ms."""
    latencies = []
    async with await RealtimeClient.connect(url) as client:
        await client.open(stop_token_ids=[])
        start = time.monotonic()
        seq = 0
        while time.monotonic() - start < duration_s:
            seq += 1
            outputs = REPLY_TOKENS if seq % REPLY_EVERY == 0 else 0
            tokens = [(index * 997 + seq * 31 + i) % 500 + 1 for i in range(CHUNK_TOKENS)]
            sent = time.monotonic()
            await client.turn(seq, tokens=tokens, max_output_tokens=outputs)
            latencies.append((time.monotonic() - sent) * 1000)
            await asyncio.sleep(max(0.0, start + seq * CHUNK_PERIOD_S - time.monotonic()))
        await client.close()
    return latencies


async def _command_counts(redis: Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {text(name).removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


async def _phase(url: str, redis: Redis, duration_s: float) -> Phase:
    await redis.config_resetstat()
    runs = await asyncio.gather(*(_stream(url, i, duration_s) for i in range(ACTIVE_SESSIONS)))
    counts = await _command_counts(redis)
    counts.pop("info", None)
    counts.pop("config|resetstat", None)
    latencies = [ms for run in runs for ms in run]
    per = {cmd: round(n / ACTIVE_SESSIONS / duration_s, 3) for cmd, n in sorted(counts.items())}
    return Phase(len(latencies), _percentile(latencies, 0.5), _percentile(latencies, 0.99), per)


async def _open_idle(url: str, sessions: int, concurrency: int) -> tuple[list[RealtimeClient], float]:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> RealtimeClient:
        async with gate:
            client = await RealtimeClient.connect(url)
            await client.open(stop_token_ids=[])
            return client

    started = time.monotonic()
    clients = await asyncio.gather(*(one() for _ in range(sessions)))
    return list(clients), sessions / (time.monotonic() - started)


def _rss_mib(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 2**20


async def measure(stack: Stack, sessions: int, concurrency: int, duration_s: float) -> Report:
    url = stack.local_url.replace("http://", "ws://", 1) + "/v1/realtime"
    gateway_pid = next(c.proc.pid for c in stack.children if c.name == "gateway")
    redis = Redis.from_url(stack.redis_url)
    try:
        alone = await _phase(url, redis, duration_s)
        before = _rss_mib(gateway_pid)
        clients, opens_per_s = await _open_idle(url, sessions, concurrency)
        after = _rss_mib(gateway_pid)
        beside = await _phase(url, redis, duration_s)
        await asyncio.gather(*(client.disconnect() for client in clients))
    finally:
        await redis.aclose()
    per_session_kib = (after - before) * 1024 / sessions if sessions else 0.0
    return Report(sessions, opens_per_s, before, after, per_session_kib, alone, beside)


def _raise_file_limit(sessions: int) -> None:
    """Each idle session is a socket here and one in the gateway (a child: it inherits the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, max(soft, 2 * sessions + 1024))
    if wanted > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.gateway_sessions", description=__doc__)
    parser.add_argument("--sessions", type=int, default=5000, help="idle sessions held open")
    parser.add_argument("--concurrency", type=int, default=64, help="opens in flight at once")
    parser.add_argument("--duration-s", type=float, default=20.0, help="each streaming phase")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _raise_file_limit(args.sessions)
    with tempfile.TemporaryDirectory(prefix="gateway-sessions-") as work:
        options = StackOptions(
            model="tiny",
            device="cpu",
            port=free_port(),
            worker_port=free_port(),
            kv_tokens=65536,
            worker_args=("--max-sessions", str(args.sessions + 2 * ACTIVE_SESSIONS)),
            log_path=Path(work) / "stack.log",
        )
        stack = Stack(options)
        try:
            stack.start()
            report = asyncio.run(measure(stack, args.sessions, args.concurrency, args.duration_s))
        finally:
            stack.stop()
    body = json.dumps(asdict(report), indent=2)
    if args.json is not None:
        args.json.write_text(body + "\n")
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
