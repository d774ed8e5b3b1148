"""glibc's malloc keeps a worker's freed buffers for the next one, so a buffer the size of a drain's
KV copy comes back already mapped instead of a page fault per 4 KB (worker/malloc.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import REPO

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")

# Faults taken by the second of two 8 MB buffers, the first freed before it: bytearray(n) writes
# every page, so a fresh mapping faults ~2,048 times and a reused heap block hardly at all.
_SECOND_BUFFER_FAULTS = (
    "import resource\n"
    "def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "first = bytearray(8 << 20); del first\n"
    "before = faults(); second = bytearray(8 << 20); print(faults() - before)\n"
)


def _run(code: str, **env: str) -> list[str]:
    tunables = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
    environment = {k: v for k, v in os.environ.items() if k not in tunables} | env
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, env=environment
    )
    return done.stdout.split()


def test_a_freed_buffer_is_reused_without_page_faults() -> None:
    tuned = "from worker.malloc import reuse_freed_memory; print(reuse_freed_memory())\n"
    ok, faults = _run(tuned + _SECOND_BUFFER_FAULTS)
    assert ok == "True" and int(faults) < 100
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[always]" in thp.read_text():
        return  # a fresh mapping takes a few 2 MB faults there: no contrast to show
    (untuned_faults,) = _run(_SECOND_BUFFER_FAULTS)
    assert int(untuned_faults) > 1000  # glibc's defaults: a fresh mapping each time


def test_an_operators_own_tunables_are_kept() -> None:
    code = "from worker.malloc import reuse_freed_memory; print(reuse_freed_memory())"
    assert _run(code, MALLOC_MMAP_THRESHOLD_="131072") == ["False"]
    assert _run(code, GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000000") == ["False"]


def test_the_worker_entry_point_sets_them_before_it_serves() -> None:
    # worker.server.main replaced by a stub that measures what a freed buffer costs by then.
    code = (
        "import sys, types\n"
        "stub = types.ModuleType('worker.server.main')\n"
        f"stub.serve = lambda settings: exec({_SECOND_BUFFER_FAULTS!r}, {{}}) or 0\n"
        "sys.modules['worker.server.main'] = stub\n"
        "from microturn.main import _worker\n"
        "_worker(['--model', 'tiny'])\n"
    )
    (faults,) = _run(code)
    assert int(faults) < 100
