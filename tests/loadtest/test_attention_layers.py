"""The attention benchmark runs every backend it is asked for over a real pool and says what each
step cost; a backend that cannot run here is refused by name, as the worker refuses it."""

from __future__ import annotations

import pytest

from loadtest.attention_layers import run
from worker.attention.cpu_backend import KERNEL


def test_it_times_each_backend_asked_for_over_each_kv_dtype() -> None:
    backends = ["torch", "cpu"] if KERNEL is not None else ["torch"]
    kv_dtypes = ("float32", "float16")
    result = run(
        "tiny", backends=backends, rows=2, queries=3, context=40, threads=1, repeats=3, kv_dtypes=kv_dtypes
    )
    assert set(result["backends"]) == {f"{b} {kv}" for b in backends for kv in kv_dtypes}
    if KERNEL is not None:  # the kernel's own forms, their rows filled as the kernel writes them
        int8_forms = run(
            "tiny",
            backends=["cpu"],
            rows=2,
            queries=3,
            context=40,
            threads=1,
            repeats=3,
            kv_dtypes=("int8-keys", "int8"),
        )
        result["backends"].update(int8_forms["backends"])
        assert {"cpu int8-keys", "cpu int8"} <= set(result["backends"])
    for figures in result["backends"].values():
        assert 0 < figures["fastest_ms"] <= figures["median_ms"]
        assert figures["gmac_per_s"] >= 0  # rounded: a slow machine's tiny step may show 0.0


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        run("tiny", backends=["nope"], rows=1, queries=1, context=8, threads=1, repeats=1)
