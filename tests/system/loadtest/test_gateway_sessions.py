"""The gateway-sessions benchmark on a small N: its report adds up (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.gateway_sessions import ACTIVE_SESSIONS, CHUNK_PERIOD_S, main


def test_the_report_counts_what_it_held_and_what_redis_ran(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert main(["--sessions", "20", "--concurrency", "8", "--duration-s", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sessions"] == 20 and report["opens_per_s"] > 0
    assert report["rss_after_mib"] > 0 and report["rss_before_mib"] > 0
    for phase in ("alone", "beside_idle"):
        figures = report[phase]
        # Every active session streamed for the whole phase, at most one chunk per period.
        assert ACTIVE_SESSIONS <= figures["chunks"] <= ACTIVE_SESSIONS * (2 / CHUNK_PERIOD_S + 1)
        assert figures["p50_ms"] <= figures["p99_ms"]
        # Each turn is appended to its session's token log in Redis (after the reply went out).
        assert figures["redis_per_session_s"]["append"] > 0
