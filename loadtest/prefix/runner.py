"""Runs the chosen prefix-cache scenarios, prints their figures as a table and writes them as JSON.

python -m loadtest.prefix [--model tiny|smollm2-135m] [--scenarios first_turn,pages,hot_path,placement]
                          [--prefixes 1024,2048] [--json F]

`placement` always runs the `tiny` model (a stack of processes; its figure is a hit rate, not a time).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.long_session.common import TurnShape
from loadtest.long_session.runner import run_scenarios, table
from loadtest.prefix.first_turn import FirstTurnConfig, run_first_turn
from loadtest.prefix.hot_path import HotPathConfig, run_hot_path
from loadtest.prefix.pages import PagesConfig, run_pages
from loadtest.prefix.placement import PlacementConfig, run_placement

logger = logging.getLogger(__name__)

SCENARIOS = ("first_turn", "pages", "hot_path", "placement")


@dataclass(frozen=True)
class PrefixBenchConfig:
    model: str = "tiny"
    scenarios: tuple[str, ...] = SCENARIOS
    first_turn: FirstTurnConfig = field(default_factory=FirstTurnConfig)
    pages: PagesConfig = field(default_factory=PagesConfig)
    hot_path: HotPathConfig = field(default_factory=HotPathConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


def run(config: PrefixBenchConfig, json_path: Path | None = None) -> dict[str, Any]:
    """Every chosen scenario's report, with the machine and each scenario's wall time."""
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "first_turn": lambda: run_first_turn(config.model, config.first_turn),
        "pages": lambda: run_pages(config.model, config.pages),
        "hot_path": lambda: run_hot_path(config.model, config.hot_path),
        "placement": lambda: run_placement(config.placement),
    }
    return run_scenarios(config.model, config.scenarios, runners, json_path)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def parse(argv: Sequence[str] | None) -> tuple[PrefixBenchConfig, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m loadtest.prefix", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny or smollm2-135m")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ", ".join(SCENARIOS)
    )
    parser.add_argument(
        "--prefixes", type=_ints, default=FirstTurnConfig.prefixes, help="P values, e.g. 1024,2048"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--chunk-tokens", type=int, default=TurnShape.chunk_tokens)
    parser.add_argument("--output-tokens", type=int, default=TurnShape.output_tokens)
    parser.add_argument("--samples", type=int, default=FirstTurnConfig.samples, help="first turns per P")
    parser.add_argument(
        "--sessions", type=int, default=PagesConfig.sessions, help="sessions whose pages are counted"
    )
    parser.add_argument("--tail", type=int, default=PagesConfig.tail, help="each session's own tokens")
    parser.add_argument("--off-sessions", type=int, default=PagesConfig.off_sessions)
    parser.add_argument("--pool-sessions", type=int, default=PagesConfig.pool_sessions)
    parser.add_argument("--hot-sessions", type=int, default=HotPathConfig.sessions)
    parser.add_argument("--rounds", type=int, default=HotPathConfig.rounds)
    parser.add_argument("--placement-sessions", type=int, default=PlacementConfig.sessions)
    args = parser.parse_args(argv)
    scenarios = tuple(name for name in args.scenarios.split(",") if name)
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    shape = TurnShape(chunk_tokens=args.chunk_tokens, output_tokens=args.output_tokens)
    config = PrefixBenchConfig(
        model=args.model,
        scenarios=scenarios,
        first_turn=FirstTurnConfig(args.prefixes, args.samples, shape),
        pages=PagesConfig(
            args.prefixes,
            args.sessions,
            args.tail,
            args.off_sessions,
            args.pool_sessions,
            most_sessions=args.sessions,
        ),
        hot_path=HotPathConfig(args.prefixes, args.hot_sessions, args.rounds, shape),
        placement=PlacementConfig(sessions=args.placement_sessions),
    )
    return config, args.json


def main(argv: Sequence[str] | None = None) -> int:
    config, json_path = parse(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = run(config, json_path)
    sys.stdout.write(table(report) + "\n")
    return 0
