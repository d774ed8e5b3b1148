"""One load step: `locust` headless as a subprocess against a running gateway, read back from Locust.

Why a subprocess: Locust monkey-patches the whole process with gevent at import; the benchmark
process (which also runs the stack's supervisor) must never be patched, and this is how an
operator runs the same locustfile.

Why `--json-file` and not the CSV: Locust rewrites its CSV from a timer that stops when the run
ends, before users finish stopping; the JSON stats are saved after every user has stopped (our
users let their in-flight outputs arrive first), so its counts are complete. Percentiles are
Locust's own: its response-time histogram (`response_times`, rounded the way Locust rounds) read
with Locust's percentile rule (`locust.stats.calculate_response_time_percentile`). The CSV is
written too, for people.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from loadtest.capacity.workload import CHUNK_NAME, REPLY_NAME, ChunkLoad

logger = logging.getLogger(__name__)

LOCUSTFILE: Final = Path(__file__).resolve().parents[1] / "locustfile.py"
# Beyond the run itself: Locust's start, users stopping (they drain outputs for up to 10 s).
_SLACK_S: Final = 60.0


class LocustError(RuntimeError):
    """Locust did not run or wrote no statistics."""


@dataclass(frozen=True)
class LocustStats:
    """What Locust counted in one run: chunks (both names) and every failure."""

    requests: int  # chunk and reply requests, answered or failed
    failures: int  # every failed request, chunk or not (open, resume, session)
    chunk_failures: int
    p50_ms: float  # over chunk and reply requests together
    p99_ms: float
    chunk_p99_ms: float
    reply_p99_ms: float


def percentile(response_times: Counter[int], percent: float) -> int:
    """Locust's rule: the smallest recorded time with at most (1 - percent) of requests above it."""
    total = sum(response_times.values())
    allowed = int(total * percent)
    processed = 0
    for value in sorted(response_times, reverse=True):
        processed += response_times[value]
        if total - processed <= allowed:
            return value
    return 0


def stats_from_json(entries: list[dict[str, Any]]) -> LocustStats:
    chunk_times: Counter[int] = Counter()
    by_name: dict[str, Counter[int]] = {CHUNK_NAME: Counter(), REPLY_NAME: Counter()}
    requests = failures = chunk_failures = 0
    for entry in entries:
        failures += int(entry["num_failures"])
        if entry["name"] not in by_name:
            continue
        times = Counter({int(k): int(v) for k, v in entry["response_times"].items()})
        by_name[entry["name"]].update(times)
        chunk_times.update(times)
        requests += int(entry["num_requests"])
        chunk_failures += int(entry["num_failures"])
    return LocustStats(
        requests=requests,
        failures=failures,
        chunk_failures=chunk_failures,
        p50_ms=float(percentile(chunk_times, 0.50)),
        p99_ms=float(percentile(chunk_times, 0.99)),
        chunk_p99_ms=float(percentile(by_name[CHUNK_NAME], 0.99)),
        reply_p99_ms=float(percentile(by_name[REPLY_NAME], 0.99)),
    )


def locust_command(url: str, sessions: int, duration_s: float, load: ChunkLoad, prefix: Path) -> list[str]:
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url]
    argv += ["-u", str(sessions), "-r", str(sessions), "-t", f"{duration_s:g}s", "--only-summary"]
    argv += ["--csv", str(prefix), "--json-file", str(prefix), "--exit-code-on-error", "0"]
    argv += ["--chunk-ms", f"{load.chunk_ms:g}", "--chunk-tokens", str(load.chunk_tokens)]
    argv += ["--reply-every", str(load.reply_every), "--reply-tokens", str(load.reply_tokens)]
    argv += ["--encoding", load.encoding]
    if load.text is not None:
        argv += ["--text", load.text]
    return argv


def run_locust(url: str, sessions: int, duration_s: float, load: ChunkLoad, prefix: Path) -> LocustStats:
    """Run one step to completion; the Locust log goes to `PREFIX.log`."""
    argv = locust_command(url, sessions, duration_s, load, prefix)
    log_path = Path(f"{prefix}.log")
    with log_path.open("wb") as log:
        try:
            status = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, timeout=duration_s + _SLACK_S, check=False
            ).returncode
        except subprocess.TimeoutExpired as exc:
            raise LocustError(f"locust did not finish within {duration_s + _SLACK_S:.0f} s") from exc
    json_path = Path(f"{prefix}.json")
    if status != 0 or not json_path.exists():
        tail = log_path.read_text(errors="replace")[-2000:]
        raise LocustError(f"locust exited with status {status}; its log ends:\n{tail}")
    return stats_from_json(json.loads(json_path.read_text()))
