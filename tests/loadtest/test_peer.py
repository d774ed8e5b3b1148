"""`microturn bench --peer llamacpp`: it skips cleanly without llama-cpp-python, and where the extra
is installed it runs both engines on the same token ids, llama.cpp in a process of its own."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from loadtest import peer
from shared.settings import OWN_CORES_SINGLE_THREAD_MAX_TOKENS


def test_without_llama_cpp_python_the_peer_bench_skips_and_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    assert peer.main(["--peer", "llamacpp"]) == 0
    assert "skipped: the llama.cpp peer needs llama-cpp-python" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (the peer extra)")
def test_the_peer_bench_times_both_engines_on_every_turn(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        from worker.model.presets import smollm2_gguf_path

        smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    assert (
        peer.main(["--turns", "2", "--prompt-tokens", "16", "--chunk-tokens", "4", "--output-tokens", "2"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["cpu_single_thread_max_tokens"] == OWN_CORES_SINGLE_THREAD_MAX_TOKENS
    assert set(report["turn_median_ms"]) == {"microturn", "llamacpp"}
    assert all(ms > 0 for ms in report["turn_median_ms"].values())
    assert report["greedy_agreement"].endswith("/4")
