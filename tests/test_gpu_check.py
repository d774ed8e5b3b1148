"""scripts/gpu-check.sh finds the CUDA tests by file name (`tests/**/test_*_cuda.py`), so that the GPU
machine collects only them and needs none of the packages the rest of the suite imports. A CUDA test
in a file of another name would never run there: this keeps the name and the mark together."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).parent
CUDA_MARK = re.compile(r"pytest\.mark\.cuda\b")


def test_every_test_marked_cuda_lives_in_a_file_the_gpu_check_runs() -> None:
    marked = {path for path in TESTS.rglob("test_*.py") if CUDA_MARK.search(path.read_text())}
    named = set(TESTS.rglob("test_*_cuda.py"))
    assert marked, "no CUDA test found: the pattern above no longer matches how they are marked"
    assert sorted(map(str, marked - named)) == [], "rename these to test_*_cuda.py"
    assert sorted(map(str, named - marked)) == [], "these are named for the GPU but not marked cuda"
