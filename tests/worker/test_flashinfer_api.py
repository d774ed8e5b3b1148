"""The flashinfer backend's calls, and the CPU reference, held against the pinned wheel's source.

The wheel is downloaded by `make install` (into .cache/wheels/, like every other install step; a
test never downloads). Without it these tests skip, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_flashinfer_api", REPO / "scripts" / "check_flashinfer_api.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check_api = _script()


def _wheel() -> Path:
    given = os.environ.get("MT_FLASHINFER_WHEEL")
    if given:
        return Path(given)
    version = check_api.pinned_requirement().split("==")[1]
    found = sorted((REPO / ".cache" / "wheels").glob(f"flashinfer_python-{version}-*.whl"))
    if not found:
        pytest.skip(f"no flashinfer-python {version} wheel in .cache/wheels (`make install` downloads it)")
    return found[0]


def test_every_call_of_the_backend_and_the_reference_match_the_pinned_wheel(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert check_api.main([str(_wheel())]) == 0
    report = capsys.readouterr().out
    for call in (
        "BatchPrefillWithPagedKVCacheWrapper.plan(",
        "BatchPrefillWithPagedKVCacheWrapper.run(",
        "flashinfer.append_paged_kv_cache(",
        "flashinfer.BatchPrefillWithPagedKVCacheWrapper(",
    ):
        assert call in report
    assert "4 calls checked, 0 mismatches" in report


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
def test_the_check_fails_a_backend_that_drifted_from_the_wheel(edit: tuple[str, str], complaint: str) -> None:
    source = check_api.BACKEND.read_text()
    assert edit[0] in source
    calls = check_api.backend_calls(source.replace(*edit))
    sources = check_api.wheel_sources(_wheel())
    public = check_api.exported(sources["flashinfer/__init__.py"])
    reference = check_api.definitions({"reference": check_api.REFERENCE.read_text()})
    problems = []
    for call in calls:
        wheel = check_api.definitions(check_api.defining_file(sources, public[call.owner or call.name]))
        problems += check_api.check(call, wheel, reference, call.owner)
    assert any(complaint in problem for problem in problems), problems
