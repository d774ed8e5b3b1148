"""The prefix-cache benchmark end to end at a tiny size, through `microturn bench --prefix`.

No timing is asserted (timings are the benchmark's to print). What is checked: every scenario ran
and reported, its counters say what the scenario is about (every cached first turn a hit, the
pages with the cache on equal to the prefix once plus the tails, more sessions fitting the pool,
every hot-path session sharing the prefix, a better hit rate with prefix-aware placement), and
the stack of the placement scenario left no process behind.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import psutil

from loadtest.prefix.runner import SCENARIOS
from microturn.main import main

SMALL = [
    "bench",
    "--prefix",
    "--model",
    "tiny",
    "--prefixes",
    "256",
    "--chunk-tokens",
    "8",
    "--output-tokens",
    "2",
    "--samples",
    "2",
    "--sessions",
    "4",
    "--tail",
    "32",
    "--off-sessions",
    "2",
    "--pool-sessions",
    "2",
    "--hot-sessions",
    "2",
    "--rounds",
    "2",
    "--placement-sessions",
    "4",
]


def test_every_scenario_reports_its_figures(tmp_path: Path) -> None:
    json_path = tmp_path / "prefix.json"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([*SMALL, "--json", str(json_path)]) == 0
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == [], [p.cmdline() for p in left]

    report = json.loads(json_path.read_text())
    assert tuple(report["scenarios"]) == SCENARIOS
    for name in SCENARIOS:
        assert name in printed.getvalue()

    first = report["scenarios"]["first_turn"]["P256"]
    assert first["hits"] == 2 and first["tokens_reused"] == 2 * 256
    assert first["cached_first_turn_ms"] > 0 and first["full_prefill_first_turn_ms"] > 0

    pages = report["scenarios"]["pages"]["P256"]
    assert pages["device_pages_cache_on"] == pages["prefix_once_plus_tails"] == 16 + 4 * 2
    assert pages["device_pages_cache_off"] == 4 * 18
    assert pages["sessions_fit_cache_off"] == 2 and pages["sessions_fit_cache_on"] > 2

    hot = report["scenarios"]["hot_path"]["P256"]
    assert hot["shared_pages"] == 16 and hot["turns"] == 4

    placement = report["scenarios"]["placement"]
    preferred, load_only = placement["with_preference"], placement["without_preference"]
    assert preferred["hits"] + preferred["misses"] == load_only["hits"] + load_only["misses"] == 4
    assert preferred["misses"] >= 2 and preferred["hit_rate"] >= load_only["hit_rate"]
