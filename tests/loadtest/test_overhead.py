"""The gateway-overhead benchmark end to end on a small number of round trips.

No timing is asserted (latencies depend on the machine). What is checked: the run starts and stops
its own processes (none left behind), every round trip on both paths came back with the expected
frames and identical outputs, and the table and the JSON report are well formed.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import psutil
import pytest

from loadtest.capacity.config import CapacityConfig
from loadtest.capacity.run import build_parser as capacity_parser
from loadtest.capacity.run import stack_options
from loadtest.overhead import OverheadConfig, OverheadReport, Stats, chunk_tokens, format_report, main
from loadtest.overhead import build_parser as overhead_parser

ROUND_TRIPS, WARMUP = 40, 5
STATS_KEYS = {"p50_ms", "p99_ms", "mean_ms", "min_ms", "max_ms"}


@pytest.fixture(scope="module")
def overhead_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("overhead")
    json_path = out / "overhead.json"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(
            [
                "--gateway-overhead",
                "--round-trips",
                str(ROUND_TRIPS),
                "--warmup",
                str(WARMUP),
                "--json",
                str(json_path),
                "--log-dir",
                str(out / "logs"),
            ]
        )
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == [], [p.cmdline() for p in left]
    report = json.loads(json_path.read_text()) if json_path.exists() else {}
    return code, report, buffer.getvalue(), out


def test_every_round_trip_returned_the_right_frames(
    overhead_run: tuple[int, dict[str, Any], str, Path],
) -> None:
    code, report, _table, out = overhead_run
    assert code == 0, (out / "logs" / "overhead-stack.log").read_text(errors="replace")[-3000:]
    assert report["round_trips_ok"] == ROUND_TRIPS
    assert report["mismatches"] == 0


def test_report_structure(overhead_run: tuple[int, dict[str, Any], str, Path]) -> None:
    _code, report, table, _out = overhead_run
    assert report["config"]["round_trips"] == ROUND_TRIPS
    assert report["config"]["warmup"] == WARMUP
    for path in ("gateway", "direct", "difference"):
        assert set(report[path]) == STATS_KEYS
        assert all(isinstance(value, float) for value in report[path].values())
        assert len(report["samples_ms"][path]) == ROUND_TRIPS
    for path in ("gateway", "direct"):
        assert all(sample > 0 for sample in report["samples_ms"][path])
    pairs = zip(report["samples_ms"]["gateway"], report["samples_ms"]["direct"], strict=True)
    assert report["samples_ms"]["difference"] == pytest.approx([g - d for g, d in pairs])
    assert isinstance(report["goal_met"], bool)
    assert report["goal_p50_difference_ms"] == 1.0
    for row in ("through gateway", "direct link", "difference", "goal: p50 of the difference"):
        assert row in table


def test_stats_and_table_from_known_samples() -> None:
    stats = Stats.of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (stats.p50_ms, stats.min_ms, stats.max_ms, stats.mean_ms) == (3.0, 1.0, 5.0, 3.0)
    assert stats.p99_ms == pytest.approx(4.96)
    report = OverheadReport(OverheadConfig(), stats, stats, Stats.of([0.5]), round_trips_ok=5, mismatches=0)
    assert report.goal_met
    assert "under 1 ms: met" in format_report(report)
    assert "CHECK FAILED" in format_report(
        OverheadReport(OverheadConfig(), stats, stats, stats, round_trips_ok=5, mismatches=2)
    )


def test_chunk_tokens_are_valid_and_vary() -> None:
    chunks = [chunk_tokens(i, 4) for i in range(50)]
    assert all(len(chunk) == 4 and all(1 <= t < 256 for t in chunk) for chunk in chunks)
    assert len(set(chunks)) > 1


def test_the_benchmarks_run_on_the_redis_they_are_given() -> None:
    """`--redis-url` and `--redis-mode` reach the stack the capacity and overhead benchmarks start
    (a run against a real cluster is in docs/benchmarks.md); a mode that does not exist is refused."""
    url = "redis://:pw@10.0.0.1:7000/0"
    args = overhead_parser().parse_args(["--redis-url", url, "--redis-mode", "cluster"])
    assert (args.redis_url, args.redis_mode) == (url, "cluster")
    assert overhead_parser().parse_args([]).redis_url is None  # its own embedded Valkey
    capacity = capacity_parser().parse_args(["--redis-url", url, "--redis-mode", "cluster"])
    config = CapacityConfig(redis_url=capacity.redis_url, redis_mode=capacity.redis_mode)
    options = stack_options(config, config.modes[0], Path("/tmp"))
    assert (options.redis_url, options.redis_mode) == (url, "cluster")
    assert "pw" not in json.dumps(config.to_json())  # a shared report never carries the password
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        overhead_parser().parse_args(["--redis-mode", "sentinel"])
