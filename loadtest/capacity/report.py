"""The capacity report: the JSON of the issue, a table on stdout, the p99-against-sessions plot."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import report_files
from loadtest.capacity.config import CapacityConfig, ModeResult

logger = logging.getLogger(__name__)


@dataclass
class CapacityReport:
    config: CapacityConfig
    modes: dict[str, ModeResult] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def ratio(self) -> float | None:
        """Streaming's sessions over no_session's (None unless both ran and no_session carried any)."""
        streaming, baseline = self.modes.get("streaming"), self.modes.get("no_session")
        if streaming is None or baseline is None or baseline.sessions == 0:
            return None
        return streaming.sessions / baseline.sessions

    @property
    def streaming_at_least_5x(self) -> bool | None:
        """The issue's bar: streaming carries >= 5x no_session's sessions (and carries some)."""
        streaming, baseline = self.modes.get("streaming"), self.modes.get("no_session")
        if streaming is None or baseline is None:
            return None
        return streaming.sessions > 0 and streaming.sessions >= 5 * baseline.sessions

    def to_json(self) -> dict[str, Any]:
        return {
            "config": {**self.config.to_json(), "host": self.host},
            "modes": {name: result.to_json() for name, result in self.modes.items()},
            "ratio": self.ratio,
            "streaming_at_least_5x": self.streaming_at_least_5x,
            "metrics_agree": all(s.metrics_agree for r in self.modes.values() for s in r.steps),
            "wall_s": round(self.wall_s, 1),
        }


def table(report: CapacityReport) -> str:
    limit = report.config.p99_limit_ms
    lines = [
        f"{'mode':<11} {'sessions':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}  "
        f"{'locust ok':>9} {'gw out':>7} {'wk turns':>8} {'gw err':>6}  agree",
    ]
    for name, result in report.modes.items():
        for step in sorted(result.steps, key=lambda s: s.sessions):
            mark = "" if step.passed else f"  > {limit:g} ms" if step.locust.failures == 0 else "  errors"
            lines.append(
                f"{name:<11} {step.sessions:>8} {step.locust.p50_ms:>8.0f} {step.locust.p99_ms:>8.0f} "
                f"{step.locust.failures:>6}  {step.answered:>9} {step.servers.gateway_outputs:>7} "
                f"{step.servers.worker_turns:>8} {step.servers.gateway_errors:>6}  "
                f"{'yes' if step.metrics_agree else 'NO'}{mark}"
            )
    for name, result in report.modes.items():
        lines.append(f"{name}: {result.sessions} sessions at p99 <= {limit:g} ms with no errors")
    if report.ratio is not None:
        lines.append(f"streaming carries {report.ratio:.1f}x the sessions of no_session")
    elif report.streaming_at_least_5x:
        lines.append("no_session carries no session within the limit; streaming does")
    return "\n".join(lines)


def write_json(report: CapacityReport, path: Path) -> None:
    report_files.write_json(report.to_json(), path)


def write_plot(report: CapacityReport, path: Path) -> None:
    """p99 chunk latency against sessions, one line per mode, the limit as a dashed line."""
    config = report.config
    with report_files.plot_file(path, size=(8, 5), dpi=120) as axes:
        for name, result in report.modes.items():
            steps = sorted(result.steps, key=lambda s: s.sessions)
            axes.plot(
                [s.sessions for s in steps],
                [s.locust.p99_ms for s in steps],
                marker="o",
                label=f"{name}: {result.sessions} sessions",
            )
        axes.axhline(
            config.p99_limit_ms, color="grey", linestyle="--", label=f"p99 limit {config.p99_limit_ms:g} ms"
        )
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("concurrent sessions")
        axes.set_ylabel("p99 chunk latency (ms, Locust)")
        load = config.load
        axes.set_title(
            f"{config.model}: {load.chunks_per_s:g} chunks/s of {load.chunk_tokens} tokens, "
            f"{load.reply_tokens}-token reply every {load.reply_every}th, {config.duration_s:g} s steps"
        )
