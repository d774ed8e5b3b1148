"""The CPU single-thread rule: a step of at most `cpu_single_thread_max_tokens` tokens runs on one
intra-op thread, a larger one on every thread the process had, and the bound is a checked setting."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from worker.engine.config import EngineConfig
from worker.engine.model_runner import ForwardRow, ModelRunner
from worker.model.loader import load_model

CPU = torch.device("cpu")


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_steps_up_to_the_bound_run_on_one_thread_and_larger_ones_on_all(two_threads: None) -> None:
    loaded = load_model("tiny", device=CPU, dtype=torch.float32)
    runner = ModelRunner(
        loaded,
        device=CPU,
        dtype=torch.float32,
        num_pages=8,
        page_size=16,
        attention="torch",
        single_thread_max_tokens=4,
    )
    runner.step([ForwardRow(token_ids=[1, 2, 3, 4], start=0, pages=[0], sampling=None, generator=None)])
    assert torch.get_num_threads() == 1
    runner.step([ForwardRow(token_ids=[5, 6, 7, 8, 9], start=4, pages=[0], sampling=None, generator=None)])
    assert torch.get_num_threads() == 2
    runner.close()


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_single_thread_max_tokens"):
        EngineConfig(model="tiny", cpu_single_thread_max_tokens=-1)
