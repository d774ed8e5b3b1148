"""A command that starts an engine refuses what it cannot serve: exit 2, the reason, no traceback
(worker/engine/engine.py, `START_REFUSALS`). The worker's own cases are with what they refuse
(tests/worker/test_weight_forms.py, tests/worker/test_attention_selection.py)."""

from __future__ import annotations

from tests.processes import run_to_exit


def test_chat_with_a_model_that_is_not_there_says_so_and_exits_2() -> None:
    done = run_to_exit("chat", "--model", "/nonexistent/model.gguf")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "microturn chat: error: model '/nonexistent/model.gguf' is neither a preset" in done.stderr
    assert "Traceback" not in done.stderr
