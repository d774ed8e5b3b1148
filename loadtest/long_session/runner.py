"""Runs the chosen long-session scenarios, prints their figures as a table and writes them as JSON.

    python -m loadtest.long_session [--model tiny|smollm2-135m] [--scenarios host,overflow,open,soak]
                                    [--json F]

The soak runs the `tiny` model whatever `--model` says (the issue's soak is on `tiny`: 20,000 turns
of SmolLM2 on the CPU would take most of a day).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from loadtest.long_session.common import TurnShape
from loadtest.long_session.host import HostConfig, run_host
from loadtest.long_session.open_sessions import OpenSessionsConfig, run_open
from loadtest.long_session.overflow import OverflowConfig, run_overflow
from loadtest.long_session.soak import SoakConfig, run_soak
from loadtest.report_files import write_json

logger = logging.getLogger(__name__)

SCENARIOS = ("host", "overflow", "open", "soak")


@dataclass(frozen=True)
class LongSessionConfig:
    model: str = "tiny"
    scenarios: tuple[str, ...] = SCENARIOS
    host: HostConfig = field(default_factory=HostConfig)
    overflow: OverflowConfig = field(default_factory=OverflowConfig)
    open: OpenSessionsConfig = field(default_factory=OpenSessionsConfig)
    soak: SoakConfig = field(default_factory=SoakConfig)


def machine() -> dict[str, Any]:
    """Where the figures come from: the benchmarks share this machine with whatever else runs."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count() or 0,
        "torch_threads": torch.get_num_threads(),
        "memory_gib": psutil.virtual_memory().total / 2**30,
        "load_average_at_start": list(os.getloadavg()),
        "niceness": os.nice(0),
    }


def run(config: LongSessionConfig, json_path: Path | None = None) -> dict[str, Any]:
    """Every chosen scenario's report, with the machine and each scenario's wall time; written to
    `json_path` after each scenario, so a long run stopped part-way keeps what it measured."""
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "host": lambda: run_host(config.model, config.host),
        "overflow": lambda: run_overflow(config.model, config.overflow),
        "open": lambda: run_open(config.model, config.open),
        "soak": lambda: run_soak(config.soak),
    }
    return run_scenarios(config.model, config.scenarios, runners, json_path)


def run_scenarios(
    model: str,
    chosen: Sequence[str],
    runners: Mapping[str, Callable[[], dict[str, Any]]],
    json_path: Path | None,
) -> dict[str, Any]:
    """Run the `chosen` scenarios in order: the report (the model, the machine, each scenario's
    figures and wall time), written to `json_path` after each scenario, so a long run stopped
    part-way keeps what it measured. Every benchmark with scenarios (this one, loadtest/prefix/)."""
    report: dict[str, Any] = {"model": model, "machine": machine(), "scenarios": {}}
    for name in chosen:
        began = time.monotonic()
        result = runners[name]()
        result["wall_s"] = time.monotonic() - began
        report["scenarios"][name] = result
        logger.info("%s done in %.0f s", name, result["wall_s"])
        if json_path is not None:
            write_json(report, json_path)
    return report


def _rows(prefix: str, value: Any) -> list[tuple[str, str]]:
    if isinstance(value, Mapping):
        return [
            row for key, item in value.items() for row in _rows(f"{prefix}.{key}" if prefix else key, item)
        ]
    if isinstance(value, list):
        return (
            [(prefix, ", ".join(_cell(v) for v in value))]
            if all(not isinstance(v, Mapping) for v in value)
            else [row for i, item in enumerate(value) for row in _rows(f"{prefix}[{i}]", item)]
        )
    return [(prefix, _cell(value))]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def table(report: Mapping[str, Any]) -> str:
    """The report as a two-column table, one figure a line."""
    rows = _rows("", {"model": report["model"], **report["scenarios"]})
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def parse(argv: Sequence[str] | None) -> tuple[LongSessionConfig, Path | None]:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.long_session", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="tiny", help="tiny or smollm2-135m (the soak always runs tiny)")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ", ".join(SCENARIOS)
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--chunk-tokens", type=int, default=TurnShape.chunk_tokens)
    parser.add_argument("--output-tokens", type=int, default=TurnShape.output_tokens)
    parser.add_argument("--host-lengths", type=_ints, default=HostConfig.lengths, help="e.g. 512,2048,8192")
    parser.add_argument("--host-samples", type=int, default=HostConfig.samples)
    parser.add_argument("--recompute-samples", type=int, default=HostConfig.recompute_samples)
    parser.add_argument("--limits", type=_ints, default=OverflowConfig.limits, help="e.g. 1024,512")
    parser.add_argument("--turns-past", type=int, default=OverflowConfig.turns_past)
    parser.add_argument("--cliff-turns-past", type=int, default=OverflowConfig.cliff_turns_past)
    parser.add_argument("--open-device-sessions", type=int, default=OpenSessionsConfig.device_sessions)
    parser.add_argument("--open-length", type=int, default=OpenSessionsConfig.length)
    parser.add_argument("--soak-turns", type=int, default=SoakConfig.turns)
    parser.add_argument(
        "--soak-window", type=int, default=SoakConfig.window, help="turns per window and between samples"
    )
    parser.add_argument("--soak-limit", type=int, default=SoakConfig.max_context_tokens)
    parser.add_argument(
        "--redis-url", default=None, help="the soak's Redis; default: the stack's embedded one"
    )
    args = parser.parse_args(argv)
    scenarios = tuple(name for name in args.scenarios.split(",") if name)
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    shape = TurnShape(chunk_tokens=args.chunk_tokens, output_tokens=args.output_tokens)
    config = LongSessionConfig(
        model=args.model,
        scenarios=scenarios,
        host=HostConfig(args.host_lengths, args.host_samples, args.recompute_samples, shape),
        overflow=OverflowConfig(
            limits=args.limits,
            turns_past=args.turns_past,
            cliff_turns_past=args.cliff_turns_past,
            shape=shape,
        ),
        open=OpenSessionsConfig(args.open_device_sessions, args.open_length, shape=shape),
        soak=SoakConfig(
            turns=args.soak_turns,
            window=args.soak_window,
            sample_every=args.soak_window,
            max_context_tokens=args.soak_limit,
            redis_url=args.redis_url,
            shape=shape,
        ),
    )
    return config, args.json


def main(argv: Sequence[str] | None = None) -> int:
    config, json_path = parse(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = run(config, json_path)
    sys.stdout.write(table(report) + "\n")
    return 0
