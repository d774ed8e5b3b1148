"""Real weights: SmolLM2-135M-Instruct from the GGUF, streamed in micro-turns, against transformers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from worker.engine import Engine
from worker.model.presets import smollm2_gguf_path

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    # float: the dequantised weights, which transformers runs too (the quantised forms: test_weight_forms.py)
    with Engine.load("smollm2-135m", kv_tokens=4096, weights="float") as engine:
        yield engine


def test_capital_of_france_streamed_in_4_token_chunks_matches_transformers(engine: Engine) -> None:
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

    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=40,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_ids[0],
        )
    expected = generated[0, len(prompt) :].tolist()
    assert list(reply.tokens) == expected
