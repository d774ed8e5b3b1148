from __future__ import annotations

import torch

from loadtest.kv_copy import measure


def test_the_copy_benchmark_reports_both_directions() -> None:
    figures = measure(torch.device("cpu"), torch.float32, pages=4, repeats=1)
    assert figures["bytes_per_copy"] == 4 * 32 * 2 * 16 * 8 * 128 * 4
    assert figures["offload_gb_s"] > 0 and figures["restore_gb_s"] > 0
    assert figures["export_gb_s"] > 0 and figures["export_host_ms"] > 0  # a drain's copy out
