"""The flashinfer backend's calls, and the CPU reference, held against the pinned wheel's source.

The wheel is downloaded by `make install` (into .cache/wheels/, like every other install step; a
test never downloads). Without it these tests skip, saying so. The check runs as its own process:
parsing the wheel's large modules inside pytest's deep stack trips CPython 3.11.7's AST bug ("AST
constructor recursion depth mismatch"), which a fresh interpreter does not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_flashinfer_api.py"
BACKEND = REPO / "worker" / "attention" / "flashinfer_backend.py"


def _wheel() -> Path:
    given = os.environ.get("MT_FLASHINFER_WHEEL")
    if given:
        return Path(given)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    version = next(req for req in extras["gpu"] if req.startswith("flashinfer-python")).split("==")[1]
    found = sorted((REPO / ".cache" / "wheels").glob(f"flashinfer_python-{version}-*.whl"))
    if not found:
        pytest.skip(f"no flashinfer-python {version} wheel in .cache/wheels (`make install` downloads it)")
    return found[0]


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(_wheel()), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_every_call_of_the_backend_and_the_reference_match_the_pinned_wheel() -> None:
    done = _check()
    assert done.returncode == 0, done.stdout + done.stderr
    for call in (
        "BatchPrefillWithPagedKVCacheWrapper.plan(",
        "BatchPrefillWithPagedKVCacheWrapper.run(",
        "flashinfer.append_paged_kv_cache(",
        "flashinfer.BatchPrefillWithPagedKVCacheWrapper(",
    ):
        assert call in done.stdout
    assert "4 calls checked, 0 mismatches" in done.stdout


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (("head_dim_qk=", "head_dim="), "no parameter ['head_dim']"),
        (
            ("causal=True,\n            q_data_type=dtype,", "q_data_type=dtype,\n            causal=True,"),
            "out of the wheel's order",
        ),
        (("append_key=k,\n", ""), "required parameters ['append_key'] not passed"),
    ],
)
def test_the_check_fails_a_backend_that_drifted_from_the_wheel(
    edit: tuple[str, str], complaint: str, tmp_path: Path
) -> None:
    source = BACKEND.read_text()
    assert edit[0] in source
    drifted = tmp_path / "flashinfer_backend.py"
    drifted.write_text(source.replace(*edit))
    done = _check("--backend", str(drifted))
    assert done.returncode == 1, done.stdout + done.stderr
    assert complaint in done.stdout
