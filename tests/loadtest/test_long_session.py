"""The long-session benchmark end to end at a tiny size, through `microturn bench --long-session`.

No timing is asserted (timings are the benchmark's to print). What is checked: every scenario ran
and reported every figure as a positive number, its counters say what the scenario is about (turns
resumed from the host with no recompute, cuts made, 8N sessions open with no recompute, the soak's
samples taken), the targets are verdicts, the table names every scenario, and the soak's stack
left no process behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from microturn.main import main

SCENARIOS = ("host", "overflow", "open", "soak")
SMALL = [
    "bench",
    "--long-session",
    "--model",
    "tiny",
    "--chunk-tokens",
    "8",
    "--output-tokens",
    "2",
    "--host-lengths",
    "256",
    "--host-samples",
    "4",
    "--recompute-samples",
    "2",
    "--limits",
    "128",
    "--turns-past",
    "10",
    "--cliff-turns-past",
    "3",
    "--open-device-sessions",
    "2",
    "--open-length",
    "64",
    "--soak-turns",
    "120",
    "--soak-window",
    "40",
    "--soak-limit",
    "128",
]


def _figures(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a scenario's report but its config and its targets."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in ("config", "targets"):
                yield from _figures(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _figures(item, f"{path}[{index}]")
    else:
        yield path, value


def test_every_scenario_reports_its_figures(tmp_path: Path) -> None:
    json_path = tmp_path / "long.json"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([*SMALL, "--json", str(json_path)]) == 0
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == [], [p.cmdline() for p in left]

    report = json.loads(json_path.read_text())
    assert report["model"] == "tiny" and report["machine"]["cpus"] > 0
    assert tuple(report["scenarios"]) == SCENARIOS
    for name, scenario in report["scenarios"].items():
        assert name in printed.getvalue()
        assert scenario["config"] and scenario["targets"], name
        assert all(isinstance(verdict, bool) for verdict in scenario["targets"].values()), name
        for path, value in _figures(scenario, name):
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (path, value)
            if isinstance(value, float):
                assert value > 0 and math.isfinite(value), (path, value)
            else:
                assert value >= 0, (path, value)

    host = report["scenarios"]["host"]["lengths"]["256"]
    assert host["host_restores"] >= 4 and host["host_recomputes"] == 0 and host["host_drops"] == 0
    assert host["recompute_recomputes"] == 2

    overflow = report["scenarios"]["overflow"]["limits"]["128"]
    assert overflow["ratio_0.8"]["turns_past_limit"] == 10 and overflow["ratio_0.8"]["cuts"] >= 1
    assert overflow["ratio_0.8"]["side_turns"] > 0
    cliff = overflow["ratio_1.0"]
    assert cliff["cuts"] == cliff["turns_past_limit"] == 3  # the old rule cuts on every turn

    opened = report["scenarios"]["open"]["counts"]
    assert opened["sessions_open"] == 8 * opened["device_pool_sessions"] == 16
    assert opened["recomputes"] == 0 and opened["drops"] == 0 and opened["restores"] >= opened["turns"] - 2

    soak = report["scenarios"]["soak"]
    assert [sample["turn"] for sample in soak["samples"]] == [40, 80, 120]
    assert all(sample["log_bytes"] > 0 and sample["record_bytes"] > 0 for sample in soak["samples"])
