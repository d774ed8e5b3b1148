"""`microturn bench --gateway-overhead`: what the gateway adds to one chunk's round trip (docs/design.md §9).

Why this shape: the gateway's cost is small next to a forward pass, so it can only be seen as a
difference between two measurements of the same thing. Each iteration sends the same chunk (the
same tokens, the same output count) once through the gateway (client WebSocket -> gateway -> link ->
worker) and once directly on a worker link (`/v1/link`, msgpack frames), back to back, alternating
which goes first, so both paths see the same machine state (CPU frequency, caches, the other
processes) and the per-iteration difference cancels the engine's own time. The two sessions get
identical inputs, so with the tiny model's greedy sampling they must also produce identical
outputs: every round trip is checked, and a wrong frame fails the run rather than skewing it.

It starts what it measures (an embedded Valkey, one `tiny` worker, one gateway; separate processes
via `microturn.stack`) with the gateway's per-session rate limit lifted: back-to-back chunks are the
point here, not a misbehaving client. Auth is on, as in production (`--auth off` to compare): the
client presents an API key with a session limit and a daily token budget, so every chunk goes
through the per-key budget check and every `done` through the usage count.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection

from gateway.auth.api_keys import KeyStore
from loadtest.report_files import write_json
from loadtest.stack_redis import add_redis_arguments
from microturn.processes import StackError, free_port
from microturn.stack import Stack, StackOptions
from shared.client.clients import RealtimeClient
from shared.protocol.key_limits import KeyLimits
from shared.protocol.link import (
    LinkChunk,
    LinkDone,
    LinkError,
    LinkOpen,
    LinkOpened,
)
from shared.protocol.link_codec import decode_link, encode_link
from shared.protocol.messages import InputChunk, OpenConfig
from shared.settings import AUTH_MODES, BENCH_MODEL, copy_fields
from shared.store.connection import resilient_redis
from shared.store.schema import KeySchema

logger = logging.getLogger(__name__)

GOAL_P50_DIFF_MS: Final = 1.0
_TIMEOUT_S: Final = 30.0
# Lifts the gateway's per-session token bucket (20 chunks/s by default) for back-to-back chunks.
_NO_RATE_LIMIT: Final = ("--max-chunks-per-s", "1000000", "--chunk-burst", "1000000")


class RoundTripError(RuntimeError):
    """A round trip came back wrong (an error frame, a wrong seq, a wrong token count)."""


@dataclass(frozen=True)
class OverheadConfig:
    round_trips: int = 500
    warmup: int = 20
    input_tokens: int = 4
    output_tokens: int = 1
    model: str = BENCH_MODEL
    device: str = "cpu"
    encoding: Literal["json", "msgpack"] = "json"
    kv_tokens: int = 0  # 0: enough for every token both sessions will hold
    auth: bool = True
    redis_url: str | None = None  # None: an embedded Valkey
    redis_mode: str = "standalone"


@dataclass(frozen=True)
class Stats:
    p50_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        values = np.asarray(samples, dtype=np.float64)
        return cls(
            p50_ms=float(np.percentile(values, 50)),
            p99_ms=float(np.percentile(values, 99)),
            mean_ms=float(values.mean()),
            min_ms=float(values.min()),
            max_ms=float(values.max()),
        )


@dataclass
class OverheadReport:
    config: OverheadConfig
    gateway: Stats
    direct: Stats
    difference: Stats
    round_trips_ok: int
    mismatches: int
    goal_p50_difference_ms: float = GOAL_P50_DIFF_MS
    samples_ms: dict[str, list[float]] = field(default_factory=dict)

    @property
    def goal_met(self) -> bool:
        return self.difference.p50_ms < self.goal_p50_difference_ms

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["goal_met"] = self.goal_met
        return body


def chunk_tokens(iteration: int, count: int, vocab: int = 256) -> tuple[int, ...]:
    """Deterministic, varied input tokens (ids 1..vocab-1, valid for every preset)."""
    return tuple(1 + (iteration * 31 + k * 7) % (vocab - 1) for k in range(count))


# ---- the two paths -------------------------------------------------------------------------------


class GatewayPath:
    """One client session through the gateway (the public protocol)."""

    def __init__(self, client: RealtimeClient, output_tokens: int) -> None:
        self.client = client
        self.output_tokens = output_tokens

    @classmethod
    async def open(cls, url: str, config: OverheadConfig, api_key: str | None) -> GatewayPath:
        client = await RealtimeClient.connect(url, config.encoding, api_key=api_key)
        await client.open(stop_token_ids=[], max_output_tokens=0, timeout=_TIMEOUT_S)
        return cls(client, config.output_tokens)

    async def round_trip(self, seq: int, tokens: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
        started = time.perf_counter_ns()
        done = await self.client.turn(
            seq, tokens=tokens, max_output_tokens=self.output_tokens, timeout=_TIMEOUT_S
        )
        elapsed_ms = (time.perf_counter_ns() - started) / 1e6
        if done.seq != seq or len(done.tokens) != self.output_tokens or done.finish != "length":
            raise RoundTripError(f"gateway: unexpected done for seq {seq}: {done}")
        return elapsed_ms, done.tokens

    async def close(self) -> None:
        await self.client.close(timeout=_TIMEOUT_S)


class DirectPath:
    """One session opened straight on the worker's link, as a gateway would."""

    def __init__(self, ws: ClientConnection, sid: str, output_tokens: int) -> None:
        self.ws = ws
        self.sid = sid
        self.output_tokens = output_tokens

    @classmethod
    async def open(cls, url: str, config: OverheadConfig) -> DirectPath:
        ws = await websockets.connect(url, compression=None, proxy=None, open_timeout=_TIMEOUT_S)
        sid = f"overhead-{uuid.uuid4().hex[:12]}"
        await ws.send(encode_link(LinkOpen(sid, OpenConfig(stop_token_ids=()))))
        frame = decode_link(await asyncio.wait_for(ws.recv(), _TIMEOUT_S))
        if not isinstance(frame, LinkOpened) or frame.sid != sid:
            await ws.close()
            raise RoundTripError(f"direct: expected opened for {sid}, got {frame}")
        return cls(ws, sid, config.output_tokens)

    async def round_trip(self, seq: int, tokens: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
        frame = encode_link(LinkChunk(self.sid, InputChunk(seq, tokens, None, self.output_tokens)))
        started = time.perf_counter_ns()
        await self.ws.send(frame)
        while True:
            reply = decode_link(await asyncio.wait_for(self.ws.recv(), _TIMEOUT_S))
            if isinstance(reply, LinkDone) and reply.done.seq == seq:
                break
            if isinstance(reply, LinkError):
                error = reply.error
                raise RoundTripError(f"direct: error for seq {seq}: {error.code} {error.message}")
        elapsed_ms = (time.perf_counter_ns() - started) / 1e6
        done = reply.done
        if reply.sid != self.sid or len(done.tokens) != self.output_tokens or done.finish != "length":
            raise RoundTripError(f"direct: unexpected done for seq {seq}: {reply}")
        return elapsed_ms, done.tokens

    async def close(self) -> None:
        await self.ws.close()


# ---- the measurement -----------------------------------------------------------------------------


async def create_key(redis_url: str, redis_mode: str) -> str:
    """An API key whose limits are checked on every chunk but never reached by the run."""
    redis = resilient_redis(redis_url, redis_mode)
    try:
        limits = KeyLimits(max_sessions=4, max_tokens_per_day=10**12)
        secret, _ = await KeyStore(redis, KeySchema()).create(f"overhead-{uuid.uuid4().hex[:8]}", limits)
        return secret
    finally:
        await redis.aclose()


async def measure(
    gateway_url: str, link_url: str, config: OverheadConfig, redis_url: str | None = None
) -> OverheadReport:
    """Interleaved round trips on both paths; raises `RoundTripError` on any wrong frame."""
    api_key = await create_key(redis_url, config.redis_mode) if config.auth and redis_url else None
    gateway = await GatewayPath.open(gateway_url, config, api_key)
    try:
        direct = await DirectPath.open(link_url, config)
        try:
            through: list[float] = []
            straight: list[float] = []
            mismatches = 0
            for i in range(config.warmup + config.round_trips):
                seq = i + 1
                tokens = chunk_tokens(i, config.input_tokens)
                # Alternate who goes first so neither path always runs right after the other's turn.
                if i % 2 == 0:
                    g_ms, g_out = await gateway.round_trip(seq, tokens)
                    d_ms, d_out = await direct.round_trip(seq, tokens)
                else:
                    d_ms, d_out = await direct.round_trip(seq, tokens)
                    g_ms, g_out = await gateway.round_trip(seq, tokens)
                if g_out != d_out:
                    mismatches += 1
                if i >= config.warmup:
                    through.append(g_ms)
                    straight.append(d_ms)
        finally:
            await direct.close()
    finally:
        await gateway.close()
    difference = [g - d for g, d in zip(through, straight, strict=True)]
    return OverheadReport(
        config=config,
        gateway=Stats.of(through),
        direct=Stats.of(straight),
        difference=Stats.of(difference),
        round_trips_ok=len(through),
        mismatches=mismatches,
        samples_ms={"gateway": through, "direct": straight, "difference": difference},
    )


def run_overhead(config: OverheadConfig, log_dir: Path) -> OverheadReport:
    """Start Valkey + one worker + one gateway, measure, stop them (always)."""
    kv_tokens = config.kv_tokens or max(
        4096, 4 * (config.warmup + config.round_trips) * (config.input_tokens + config.output_tokens)
    )
    options = StackOptions(
        model=config.model,
        device=config.device,
        port=free_port(),
        worker_port=free_port(),
        kv_tokens=kv_tokens,
        ready_timeout_s=300.0,
        gateway_args=_NO_RATE_LIMIT,
        auth="on" if config.auth else "off",
        redis_url=config.redis_url,
        redis_mode=config.redis_mode,
        log_path=log_dir / "overhead-stack.log",
    )
    stack = Stack(options)
    try:
        stack.start()
        gateway_url = f"ws://127.0.0.1:{options.port}/v1/realtime"
        link_url = f"ws://127.0.0.1:{options.worker_port}/v1/link"
        logger.info("measuring %d round trips (+%d warm-up) on each path", config.round_trips, config.warmup)
        return asyncio.run(measure(gateway_url, link_url, config, stack.redis_url))
    finally:
        stack.stop()


def format_report(report: OverheadReport) -> str:
    c = report.config
    lines = [
        f"gateway overhead: {report.round_trips_ok} round trips of {c.input_tokens} tokens in, "
        f"{c.output_tokens} out ({c.model} on {c.device}, client encoding {c.encoding}, "
        f"auth {'on' if c.auth else 'off'}), interleaved",
        f"{'':<18}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'min ms':>10}",
    ]
    for name, stats in (
        ("through gateway", report.gateway),
        ("direct link", report.direct),
        ("difference", report.difference),
    ):
        lines.append(
            f"{name:<18}{stats.p50_ms:>10.3f}{stats.p99_ms:>10.3f}{stats.mean_ms:>10.3f}{stats.min_ms:>10.3f}"
        )
    verdict = "met" if report.goal_met else "NOT met"
    lines.append(f"goal: p50 of the difference under {report.goal_p50_difference_ms:g} ms: {verdict}")
    if report.mismatches:
        lines.append(f"CHECK FAILED: the two paths' outputs differ in {report.mismatches} round trips")
    else:
        lines.append("check: every round trip returned the expected frames, identical on both paths")
    return "\n".join(lines)


def print_report(report: OverheadReport) -> None:
    """The table on stdout: the command's output (logs go to stderr)."""
    print(format_report(report))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="microturn bench --gateway-overhead",
        description="Time the same chunk round trip through the gateway and directly on a worker link.",
    )
    defaults = OverheadConfig()
    parser.add_argument("--round-trips", "-n", type=int, default=defaults.round_trips)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--input-tokens", type=int, default=defaults.input_tokens)
    parser.add_argument("--output-tokens", type=int, default=defaults.output_tokens)
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--encoding", choices=("json", "msgpack"), default=defaults.encoding)
    parser.add_argument("--kv-tokens", type=int, default=defaults.kv_tokens)
    auth_default = "on" if defaults.auth else "off"
    parser.add_argument("--auth", choices=AUTH_MODES, default=auth_default, help="the gateway's API-key auth")
    add_redis_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, help="also write the report (with samples) here")
    parser.add_argument("--log-dir", type=Path, default=None, help="children's logs; default a temp dir")
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args([a for a in argv if a != "--gateway-overhead"])
    if args.round_trips < 1 or args.warmup < 0 or args.input_tokens < 1 or args.output_tokens < 0:
        raise SystemExit("--round-trips and --input-tokens must be >= 1, --warmup and --output-tokens >= 0")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = copy_fields(OverheadConfig, args, auth=args.auth == "on")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="microturn-overhead-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        report = run_overhead(config, log_dir)
    except (RoundTripError, StackError) as exc:
        logger.error("%s (process logs in %s)", exc, log_dir)
        return 1
    print_report(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(report.to_json(), args.json, indent=2)
    return 0 if report.mismatches == 0 else 1
