"""The engine against transformers: streamed chunks give the whole-sequence forward's tokens and logprobs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tests.worker.reference import VOCAB, reference_logprobs, write_checkpoint
from worker.engine import Engine


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, PreTrainedModel]:
    directory = tmp_path_factory.mktemp(request.param)
    return directory, write_checkpoint(request.param, directory)


@pytest.fixture(scope="module")
def engine(checkpoint: tuple[Path, PreTrainedModel]) -> Iterator[Engine]:
    with Engine.load(str(checkpoint[0]), kv_tokens=8192, page_size=16) as engine:
        yield engine


def stream_session(engine: Engine, seed: int) -> tuple[list[int], list[tuple[int, int, float]]]:
    """Chunks of 1..40 tokens, each followed by 0..5 greedy outputs; returns the sequence and every output
    as (position in the sequence, token, logprob)."""
    rng = random.Random(seed)
    sid = engine.open_session(stop_token_ids=(), logprobs=True)
    sequence: list[int] = []
    outputs: list[tuple[int, int, float]] = []
    for _ in range(14):
        chunk = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        k = rng.choice([0, 1, 3, 5])
        turn = engine.run_turn(sid, tokens=chunk, max_output_tokens=k, timeout=60)
        sequence += chunk
        assert turn.finish == "length" and len(turn.tokens) == k and turn.logprobs is not None
        for token, logprob in zip(turn.tokens, turn.logprobs, strict=True):
            outputs.append((len(sequence), token, logprob))
            sequence.append(token)
        assert turn.length == len(sequence)
    engine.close_session(sid)
    return sequence, outputs


def test_config_is_read_from_the_checkpoint(engine: Engine, checkpoint: tuple[Path, PreTrainedModel]) -> None:
    hf = checkpoint[1].config
    assert engine.model_config.num_layers == hf.num_hidden_layers
    assert engine.model_config.num_kv_heads == hf.num_key_value_heads
    assert engine.model_config.attention_bias == (hf.model_type == "qwen2")
    assert (engine.model_config.rope_scaling is not None) == (hf.model_type == "llama")


@pytest.mark.parametrize("seed", [1, 2])
def test_streamed_chunks_match_a_whole_sequence_forward(
    engine: Engine, checkpoint: tuple[Path, PreTrainedModel], seed: int
) -> None:
    sequence, outputs = stream_session(engine, seed)
    assert len(sequence) > 5 * 16, "the session must span several pages"
    reference = reference_logprobs(checkpoint[1], sequence)
    for position, token, logprob in outputs:
        # The token at `position` was sampled from the logits of position - 1.
        assert int(reference[position - 1].argmax()) == token, f"greedy token differs at position {position}"
        assert abs(float(reference[position - 1, token]) - logprob) < 1e-4


def test_eight_interleaved_sessions_equal_each_alone(engine: Engine) -> None:
    rng = random.Random(7)
    plans = [
        [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))], rng.choice([0, 2, 4])) for _ in range(6)]
        for _ in range(8)
    ]

    def run_alone(
        plan: list[tuple[list[int], int]],
    ) -> list[tuple[tuple[int, ...], tuple[float, ...] | None]]:
        sid = engine.open_session(stop_token_ids=(), logprobs=True)
        results = [engine.run_turn(sid, tokens=chunk, max_output_tokens=k, timeout=60) for chunk, k in plan]
        engine.close_session(sid)
        return [(r.tokens, r.logprobs) for r in results]

    alone = [run_alone(plan) for plan in plans]
    steps_alone = engine.stats().steps

    sids = [engine.open_session(stop_token_ids=(), logprobs=True) for _ in plans]
    futures = [
        [engine.submit(sid, tokens=chunk, max_output_tokens=k) for chunk, k in plan]
        for sid, plan in zip(sids, plans, strict=True)
    ]
    together = [[(f.result(60).tokens, f.result(60).logprobs) for f in fs] for fs in futures]
    steps_together = engine.stats().steps - steps_alone
    for sid in sids:
        engine.close_session(sid)

    for one, other in zip(alone, together, strict=True):
        assert [tokens for tokens, _ in one] == [tokens for tokens, _ in other]
        for (_, a), (_, b) in zip(one, other, strict=True):
            assert a is not None and b is not None
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    # They really ran batched: far fewer steps than the same turns one session at a time.
    assert steps_together < steps_alone / 2
    assert engine.stats().pages_used == 0
