"""`microturn bench --capacity`: step Locust against a real stack per mode; the largest passing count.

Per mode a fresh stack (embedded Valkey, one worker, one gateway; `microturn.stack`), `no_session`
with the worker's `--no-session`. Per step: scrape both `/metrics`, run Locust for `duration_s`
with S users spawned at once, scrape again; the figures are Locust's, the scrapes check them.
Sessions of a step are closed by its users before the next step starts, so steps do not stack.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from loadtest.capacity.config import MODES, NO_SESSION, CapacityConfig, ModeResult, Step
from loadtest.capacity.locust_run import run_locust
from loadtest.capacity.metrics import ServerCounts, Snapshot
from loadtest.capacity.report import CapacityReport, table, write_json, write_plot
from loadtest.capacity.search import next_sessions
from loadtest.capacity.workload import ENCODINGS, ChunkLoad
from loadtest.stack_redis import add_redis_arguments
from microturn.processes import free_port
from microturn.stack import Stack, StackOptions
from shared.settings import DTYPE_NAMES, copy_fields

logger = logging.getLogger(__name__)


def stack_options(config: CapacityConfig, mode: str, work_dir: Path) -> StackOptions:
    """The stack one mode runs on: the worker as `microturn up` starts it, plus the mode's flags."""
    return StackOptions(
        model=config.model,
        device=config.device,
        port=free_port(),
        worker_port=free_port(),
        kv_tokens=config.kv_tokens,
        redis_url=config.redis_url,
        redis_mode=config.redis_mode,
        worker_args=(
            *(("--no-session",) if mode == NO_SESSION else ()),
            *(("--dtype", config.dtype) if config.dtype else ()),
        ),
        log_path=work_dir / f"{mode}-stack.log",
    )


def run_mode(config: CapacityConfig, mode: str, work_dir: Path) -> ModeResult:
    options = stack_options(config, mode, work_dir)
    worker_port = options.worker_port
    stack = Stack(options)
    result = ModeResult(mode)
    try:
        stack.start()
        gateway, worker = stack.local_url, f"http://127.0.0.1:{worker_port}"
        ws_url = gateway.replace("http://", "ws://", 1)
        outcomes: dict[int, bool] = {}
        while (sessions := next_sessions(outcomes, config.max_sessions, config.start_sessions)) is not None:
            before = Snapshot.take(gateway, worker)
            stats = run_locust(
                ws_url, sessions, config.duration_s, config.load, work_dir / f"{mode}-{sessions}"
            )
            step = Step(
                sessions,
                stats,
                ServerCounts.between(before, Snapshot.take(gateway, worker)),
                config.p99_limit_ms,
            )
            result.steps.append(step)
            outcomes[sessions] = step.passed
            logger.info(
                "%s %d sessions: p50 %.0f ms, p99 %.0f ms, %d errors; locust answered %d, gateway outputs "
                "%d, worker turns %d%s",
                mode,
                sessions,
                stats.p50_ms,
                stats.p99_ms,
                stats.failures,
                step.answered,
                step.servers.gateway_outputs,
                step.servers.worker_turns,
                "" if step.metrics_agree else " (METRICS DISAGREE)",
            )
    finally:
        stack.stop()
    return result


def _host() -> dict[str, object]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "locust": importlib.metadata.version("locust"),  # never `import locust`: it patches with gevent
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def run_capacity(config: CapacityConfig, work_dir: Path) -> CapacityReport:
    report = CapacityReport(config, host=_host())
    started = time.monotonic()
    for mode in config.modes:
        report.modes[mode] = run_mode(config, mode, work_dir)
    report.wall_s = time.monotonic() - started
    return report


def build_parser() -> argparse.ArgumentParser:
    defaults, load = CapacityConfig(), ChunkLoad()
    parser = argparse.ArgumentParser(
        prog="microturn bench --capacity",
        description="Sessions one worker carries at p99 chunk latency <= the limit, measured by Locust.",
    )
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="default: the worker's")
    parser.add_argument("--duration-s", type=float, default=defaults.duration_s, help="seconds per step")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in this order")
    parser.add_argument("--p99-ms", type=float, default=defaults.p99_limit_ms, help="the latency limit")
    parser.add_argument("--start-sessions", type=int, default=defaults.start_sessions)
    parser.add_argument("--max-sessions", type=int, default=defaults.max_sessions)
    parser.add_argument("--kv-tokens", type=int, default=None, help="the worker's KV capacity in tokens")
    parser.add_argument("--chunk-ms", type=float, default=load.chunk_ms)
    parser.add_argument("--chunk-tokens", type=int, default=load.chunk_tokens)
    parser.add_argument("--reply-every", type=int, default=load.reply_every)
    parser.add_argument("--reply-tokens", type=int, default=load.reply_tokens)
    parser.add_argument("--encoding", choices=sorted(ENCODINGS), default=load.encoding)
    add_redis_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--plot", type=Path, default=None, help="write the p99 plot (PNG) here")
    parser.add_argument("--work-dir", type=Path, default=None, help="Locust's files and the stack logs")
    return parser


def config_from_args(args: argparse.Namespace) -> CapacityConfig:
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    load = copy_fields(ChunkLoad, args)
    return copy_fields(CapacityConfig, args, load=load, p99_limit_ms=args.p99_ms, modes=modes)


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="microturn-capacity-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    logger.info("Locust runs and stack logs in %s", work_dir)
    report = run_capacity(config, work_dir)
    print(table(report), flush=True)
    if args.json:
        write_json(report, args.json)
    if args.plot:
        write_plot(report, args.plot)
    return 0
