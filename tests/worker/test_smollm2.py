"""Real weights: SmolLM2-135M-Instruct from the GGUF, streamed in micro-turns, against transformers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.worker.smollm2 import engine_on
from worker.engine import Engine
from worker.model.loader import LoadedModel

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def engine(smollm2_model: LoadedModel) -> Iterator[Engine]:
    # float: the dequantised weights, which transformers runs too (the quantised forms: test_weight_forms.py)
    with engine_on(smollm2_model, kv_tokens=4096) as engine:
        yield engine


def test_capital_of_france_streamed_in_4_token_chunks_matches_transformers(
    engine: Engine, hf_smollm2: Any
) -> None:
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    prompt = tokenizer.encode(tokenizer.chat_prompt(QUESTION, system=SYSTEM))
    sid = engine.open_session()
    chunks = [prompt[i : i + 4] for i in range(0, len(prompt), 4)]
    for chunk in chunks[:-1]:
        assert engine.run_turn(sid, tokens=chunk, max_output_tokens=0, timeout=60).tokens == ()
    reply = engine.run_turn(sid, tokens=chunks[-1], max_output_tokens=40, timeout=120)
    assert reply.finish == "stop"
    assert "Paris" in (reply.text or "")

    with torch.no_grad():
        generated = hf_smollm2.generate(
            torch.tensor([prompt]),
            max_new_tokens=40,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_ids[0],
        )
    expected = generated[0, len(prompt) :].tolist()
    assert list(reply.tokens) == expected
