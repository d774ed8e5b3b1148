"""What the bench ran on, and whether something else competed for the CPU meanwhile.

On a small CPU machine the latencies are only meaningful if the bench had the cores to itself:
torch's intra-op threads spin at barriers, so one foreign busy process can slow small ops many
times over. The bench cannot prevent that, but it measures it (CPU time the rest of the system
spent during the run) so a noisy result can be recognised as such.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch


def _busy_s() -> float:
    """CPU-seconds the whole system has spent not idle."""
    times = psutil.cpu_times()
    return float(sum(times)) - float(times.idle) - float(getattr(times, "iowait", 0.0))


def _own_s() -> float:
    times = psutil.Process().cpu_times()
    return float(times.user + times.system + times.children_user + times.children_system)


@dataclass(frozen=True)
class HostProbe:
    """Taken at the start of a run; `finish()` turns it into the host figures of the report."""

    started: float
    busy_s: float
    own_s: float
    loadavg_1m: float

    @classmethod
    def start(cls) -> HostProbe:
        return cls(time.monotonic(), _busy_s(), _own_s(), os.getloadavg()[0])

    def finish(self) -> dict[str, Any]:
        wall = time.monotonic() - self.started
        own = _own_s() - self.own_s
        others = max(_busy_s() - self.busy_s - own, 0.0)
        return {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "loadavg_1m_before": self.loadavg_1m,
            "bench_cpu_s": own,
            # CPU time everything else on the machine used meanwhile; near 0 on a quiet machine.
            "other_cpu_s": others,
            "other_cpu_share": others / wall if wall > 0 else 0.0,
        }
