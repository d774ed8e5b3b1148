"""The bench's results as a plain-text table, a JSON document and a latency-per-turn plot.

`format_report` builds the text and `print_report` is the one place library code prints, on behalf
of the CLI. The files go through loadtest/report_files.py (matplotlib lazily, with the Agg backend: the
bench must run headless, and a run without `--plot` does not import it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import report_files
from loadtest.bench.config import HF, REPREFILL, RSS_FLAT_TOLERANCE, STREAMING, BenchConfig
from loadtest.bench.floor import FLOOR_TARGET_X, Floor
from loadtest.bench.memory import RssSamples
from loadtest.bench.results import ModeRun, ModeSummary, speedup, summarize

logger = logging.getLogger(__name__)

# The claims the bench exists to back: streaming's last-10 latency at least this many times lower.
TARGET_SPEEDUP_LAST10 = {REPREFILL: 10.0, HF: 2.0}
# Foreign CPU use above this share of one core over the run marks the timings as contended.
OTHER_CPU_WARN_SHARE = 0.1


@dataclass(frozen=True)
class Checks:
    """Output agreement with streaming; `ok` is what decides the CLI's exit status."""

    reprefill_checked: int
    reprefill_mismatches: tuple[tuple[int, int], ...]
    hf_checked: int
    hf_mismatches: tuple[tuple[int, int], ...]
    hf_mismatch_limit: float  # the fraction of hf turns allowed to differ beyond a near-tie
    hf_near_ties: tuple[tuple[int, int], ...] = ()  # of `hf_mismatches`, those near-ties explain

    @property
    def reprefill_ok(self) -> bool:
        return not self.reprefill_mismatches

    @property
    def hf_ok(self) -> bool:
        return len(self.hf_beyond_near_ties) <= self.hf_mismatch_limit * self.hf_checked

    @property
    def hf_beyond_near_ties(self) -> list[tuple[int, int]]:
        """The differing hf turns no near-tie explains."""
        ties = set(self.hf_near_ties)
        return [turn for turn in self.hf_mismatches if turn not in ties]

    @property
    def ok(self) -> bool:
        return self.reprefill_ok and self.hf_ok


@dataclass
class BenchReport:
    config: BenchConfig
    runs: dict[str, ModeRun]
    rss: RssSamples
    peak_rss_mib: float
    checks: Checks
    wall_s: float
    host: dict[str, Any]
    floor: Floor
    summaries: dict[str, ModeSummary] = field(init=False)

    def __post_init__(self) -> None:
        self.summaries = {name: summarize(run) for name, run in self.runs.items()}

    def speedups(self) -> dict[str, dict[str, float | None]]:
        """Per other mode: how many times lower streaming's last-10 and average latencies are."""
        base = self.summaries[STREAMING]
        return {
            name: {
                "last10": speedup(base.last10_ms, summary.last10_ms),
                "avg": speedup(base.avg_ms, summary.avg_ms),
            }
            for name, summary in self.summaries.items()
            if name != STREAMING
        }

    def targets(self) -> dict[str, bool | None]:
        """Whether streaming's last-10 speedup over each mode reaches its target (None: not measured)."""
        speedups = self.speedups()
        result: dict[str, bool | None] = {}
        for name, target in TARGET_SPEEDUP_LAST10.items():
            if name in speedups:
                value = speedups[name]["last10"]
                result[name] = None if value is None else value >= target
        return result

    def floor_multiples(self) -> dict[str, float | None]:
        """Streaming's average and last-10 latency as multiples of the bandwidth floor."""
        base, floor_ms = self.summaries[STREAMING], self.floor.turn_ms
        return {
            "avg": None if base.avg_ms is None else base.avg_ms / floor_ms,
            "last10": None if base.last10_ms is None else base.last10_ms / floor_ms,
        }

    def faster_than_hf(self) -> tuple[int, int] | None:
        """(turns where streaming's mean beats hf's, turns both timed); None without hf."""
        if HF not in self.runs:
            return None
        streaming, hf = self.runs[STREAMING], self.runs[HF]
        both = sorted(set(streaming.timed_turns) & set(hf.timed_turns))
        faster = sum(streaming.turn_mean_ms(t) < hf.turn_mean_ms(t) for t in both)
        return faster, len(both)

    def to_json(self) -> dict[str, Any]:
        modes: dict[str, Any] = {}
        for name, run in self.runs.items():
            summary = self.summaries[name]
            modes[name] = {
                "avg_ms": summary.avg_ms,
                "head10_ms": summary.head10_ms,
                "last10_ms": summary.last10_ms,
                "tail_head": summary.tail_head,
                "timed_turns": list(summary.timed_turns),
                "turn_ms": run.turn_ms,
                "wall_s": run.wall_s,
            }
        rss = self.rss
        checks = self.checks
        return {
            "config": self.config.as_dict(),
            "modes": modes,
            "speedups": self.speedups(),
            "rss": {
                "early_turns": rss.early_turns,
                "early_mib": rss.early_mib,
                "last_turns": rss.last_turns,
                "last_mib": rss.last_mib,
                "ratio": rss.ratio,
                "flat": rss.flat(RSS_FLAT_TOLERANCE),
                "flat_tolerance": RSS_FLAT_TOLERANCE,
                "peak_mib": self.peak_rss_mib,
                "session0_by_turn_mib": list(rss.by_turn),
            },
            "checks": {
                "reprefill_turns_checked": checks.reprefill_checked,
                "reprefill_mismatches": len(checks.reprefill_mismatches),
                "reprefill_mismatched": [list(m) for m in checks.reprefill_mismatches],
                "hf_turns_checked": checks.hf_checked,
                "hf_mismatches": len(checks.hf_mismatches),
                "hf_mismatched": [list(m) for m in checks.hf_mismatches],
                "hf_near_ties": len(checks.hf_near_ties),
                "hf_beyond_near_ties": [list(m) for m in checks.hf_beyond_near_ties],
                "hf_mismatch_limit": checks.hf_mismatch_limit,
                "targets": {
                    name: {"speedup_last10_min": TARGET_SPEEDUP_LAST10[name], "met": met}
                    for name, met in self.targets().items()
                },
                "ok": checks.ok,
            },
            "floor": {
                "weight_bytes_per_step": self.floor.weight_bytes,
                "copy_gbps": self.floor.copy_gbps,
                "step_ms": self.floor.step_ms,
                "steps_per_turn": self.floor.steps_per_turn,
                "steps_per_turn_taken": self.floor.steps_per_turn_taken,
                "turn_ms": self.floor.turn_ms,
                "streaming_x": self.floor_multiples(),
                "target_x": FLOOR_TARGET_X,
            },
            "faster_than_hf": _faster_json(self.faster_than_hf()),
            "wall_s": self.wall_s,
            "host": self.host,
        }


def _faster_json(faster: tuple[int, int] | None) -> dict[str, int] | None:
    return None if faster is None else {"turns": faster[1], "streaming_faster": faster[0]}


def describe_turns(turns: tuple[int, ...] | list[int]) -> str:
    """Compact turn list: runs of consecutive turns as a-b, e.g. '0,10,20,25-29'."""
    parts: list[str] = []
    i = 0
    while i < len(turns):
        j = i
        while j + 1 < len(turns) and turns[j + 1] == turns[j] + 1:
            j += 1
        parts.append(str(turns[i]) if i == j else f"{turns[i]}-{turns[j]}")
        i = j + 1
    return ",".join(parts)


def _flat_word(flat: bool | None) -> str:
    return "n/a, run more turns" if flat is None else "yes" if flat else "NO"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def format_report(report: BenchReport) -> str:
    c = report.config
    lines = [
        f"microturn bench: model={c.model} device={c.device} dtype={c.dtype} sessions={c.sessions} "
        f"turns={c.turns} input={c.input_tokens} output={c.output_tokens} seed={c.seed}",
        "",
        f"{'mode':<10} {'avg_ms':>10} {'head10_ms':>10} {'last10_ms':>10} {'tail/head':>10} "
        f"{'timed':>6} {'wall_s':>8}",
    ]
    for name, summary in report.summaries.items():
        tail = "-" if summary.tail_head is None else f"{summary.tail_head:.2f}"
        lines.append(
            f"{name:<10} {_ms(summary.avg_ms):>10} {_ms(summary.head10_ms):>10} {_ms(summary.last10_ms):>10} "
            f"{tail:>10} {len(summary.timed_turns):>6} {report.runs[name].wall_s:>8.1f}"
        )
    lines.append("")
    lines.append(
        "timed turns (avg excludes turn 0; head10 = first 10 timed after turn 0; last10 = last 10 timed):"
    )
    for name, summary in report.summaries.items():
        lines.append(f"  {name:<10} {describe_turns(summary.timed_turns)}")
    speedups = report.speedups()
    if speedups:
        lines.append("")
        lines.append("streaming is N times faster (other mode's latency / streaming's):")
        targets = report.targets()
        for name, values in speedups.items():
            met = targets.get(name)
            verdict = (
                ""
                if met is None
                else f"  (target >= {TARGET_SPEEDUP_LAST10[name]:.0f}x: {'met' if met else 'NOT met'})"
            )
            lines.append(
                f"  vs {name:<10} last10 {_times(values['last10']):>9}   "
                f"avg {_times(values['avg']):>9}{verdict}"
            )
    lines += _floor_lines(report)
    rss = report.rss
    flat = rss.flat(RSS_FLAT_TOLERANCE)
    lines += [
        "",
        f"RSS of the process during streaming, session 0: "
        f"after {rss.early_turns} turns {rss.early_mib:.1f} MiB, "
        f"after {rss.last_turns} turns {rss.last_mib:.1f} MiB, ratio {rss.ratio:.4f} "
        f"(flat within {RSS_FLAT_TOLERANCE:.0%}: {_flat_word(flat)})",
        f"peak RSS over the whole bench: {report.peak_rss_mib:.1f} MiB",
        f"total wall time: {report.wall_s:.1f} s on {report.host['cpus']} CPUs "
        f"({report.host['torch_threads']} torch threads); other processes used "
        f"{report.host['other_cpu_s']:.1f} CPU-s meanwhile ({report.host['other_cpu_share']:.0%} of one core)"
        + (
            ""
            if report.host["other_cpu_share"] < OTHER_CPU_WARN_SHARE
            else ": timings are NOT from a quiet machine"
        ),
        "",
    ]
    lines += _check_lines(report)
    return "\n".join(lines)


def _floor_lines(report: BenchReport) -> list[str]:
    floor = report.floor
    lines = [
        "",
        f"bandwidth floor: {floor.weight_bytes / 1e9:.3f} GB of weights per step at "
        f"{floor.copy_gbps:.1f} GB/s (copy, read + write) = {floor.step_ms:.3f} ms/step; "
        f"{floor.steps_per_turn} steps/turn "
        f"(streaming took {floor.steps_per_turn_taken:.2f}) = {floor.turn_ms:.3f} ms/turn",
    ]
    multiples = report.floor_multiples()
    figures = [
        f"{name} {value:.2f}x ({'met' if value <= FLOOR_TARGET_X else 'NOT met'})"
        for name, value in multiples.items()
        if value is not None
    ]
    if figures:
        lines.append(f"  streaming against the floor (target <= {FLOOR_TARGET_X}x): {', '.join(figures)}")
    faster = report.faster_than_hf()
    if faster is not None:
        lines.append(f"  streaming faster than hf at {faster[0]} of the {faster[1]} turns both timed")
    return lines


def _check_lines(report: BenchReport) -> list[str]:
    checks = report.checks
    lines: list[str] = []
    if REPREFILL in report.runs:
        if checks.reprefill_ok:
            lines.append(
                f"check: reprefill outputs equal streaming's at all {checks.reprefill_checked} turns checked"
            )
        else:
            lines.append(
                f"CHECK FAILED: reprefill outputs differ from streaming's at "
                f"{len(checks.reprefill_mismatches)} of {checks.reprefill_checked} turns "
                f"(session, turn): {list(checks.reprefill_mismatches)[:10]}"
            )
    if HF in report.runs:
        count, limit = len(checks.hf_mismatches), checks.hf_mismatch_limit
        ties = len(checks.hf_near_ties)
        differ = (
            f"hf outputs differ from streaming's at {count} of {checks.hf_checked} turns, {ties} of them "
            "near-ties"
        )
        if checks.hf_ok:
            lines.append(
                f"check: {differ} (transformers may flip a near-tie; fails only above {limit:.0%} beyond)"
            )
        else:
            lines.append(
                f"CHECK FAILED: {differ}: {len(checks.hf_beyond_near_ties)} differ beyond a near-tie "
                f"{checks.hf_beyond_near_ties[:10]}, above the {limit:.0%} "
                "allowed: the converted model is not the engine's model"
            )
    return lines


def print_report(report: BenchReport) -> None:
    print(format_report(report))


def write_json(report: BenchReport, path: Path) -> None:
    report_files.write_json(report.to_json(), path)


def write_plot(report: BenchReport, path: Path) -> None:
    """Latency of each timed turn (mean over sessions) against turn number, one line per mode."""
    with report_files.plot_file(path, size=(9, 5.5), dpi=110) as axes:
        for name, run in report.runs.items():
            turns = report.summaries[name].timed_turns
            axes.plot(
                turns,
                [run.turn_mean_ms(t) for t in turns],
                marker="o" if len(turns) < 60 else None,
                markersize=3,
                label=name,
            )
        c = report.config
        axes.set_yscale("log")
        axes.set_xlabel("turn")
        axes.set_ylabel("turn latency, ms (mean over sessions)")
        axes.set_title(
            f"{c.model} on {c.device}: {c.sessions} sessions x {c.turns} turns, "
            f"{c.input_tokens} in / {c.output_tokens} out per turn"
        )
