"""The OpenMP spin is chosen before torch loads libgomp, by what the process's cores are shared with."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.processes import REPO

_CHOOSE = "from worker.openmp import choose_spin; print(choose_spin(shared_cores={shared}))"
_AFTER = "import os; print(os.environ.get('GOMP_SPINCOUNT', 'unset'))"


def _run(code: str, **env: str) -> list[str]:
    environment = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | env
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, env=environment
    )
    return done.stdout.split()


def test_shared_cores_spin_briefly_and_owned_cores_keep_libgomps_default() -> None:
    assert _run(f"{_CHOOSE.format(shared=True)}; {_AFTER}") == ["True", "100"]
    assert _run(f"{_CHOOSE.format(shared=False)}; {_AFTER}") == ["True", "unset"]


def test_an_operators_own_spin_is_kept() -> None:
    assert _run(f"{_CHOOSE.format(shared=True)}; {_AFTER}", GOMP_SPINCOUNT="5000") == ["True", "5000"]


def test_too_late_once_torch_is_loaded() -> None:
    assert _run(f"import torch; {_CHOOSE.format(shared=True)}; {_AFTER}") == ["False", "unset"]


def test_the_worker_entry_point_chooses_before_anything_loads_torch() -> None:
    # worker.server.main (which loads torch) replaced by a stub that reports what it finds.
    code = (
        "import os, sys, types\n"
        "stub = types.ModuleType('worker.server.main')\n"
        "spin = lambda: os.environ.get('GOMP_SPINCOUNT', 'unset')\n"
        "stub.serve = lambda settings: print(spin(), 'torch' in sys.modules) or 0\n"
        "sys.modules['worker.server.main'] = stub\n"
        "from microturn.main import _worker\n"
    )
    assert _run(code + "_worker(['--model', 'tiny'])") == ["100", "False"]
    assert _run(code + "_worker(['--model', 'tiny', '--cpu-single-thread-max-tokens', '0'])") == [
        "unset",
        "False",
    ]
