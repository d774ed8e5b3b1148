"""`--kv-dtype` (worker/attention/kv_dtype.py): what the KV pool holds, resolved once at start, and
the refusals a worker says before it loads anything."""

from __future__ import annotations

import pytest
import torch

from shared.settings import EngineSettings, parse_settings
from worker.attention.kv_dtype import choose_kv_dtype
from worker.engine import Engine
from worker.engine.config import EngineConfig

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def test_auto_keeps_float16_kv_for_the_quantised_forms_on_the_cpu_and_the_models_dtype_elsewhere() -> None:
    cases = [
        (CPU, torch.float32, "int4", torch.float16),
        (CPU, torch.float32, "int8", torch.float16),
        (CPU, torch.float32, "float", torch.float32),  # the path held exact against transformers
        (CPU, torch.bfloat16, "int4", torch.bfloat16),
        (CUDA, torch.bfloat16, "int4", torch.bfloat16),
        (CUDA, torch.float16, "float", torch.float16),
    ]
    for device, dtype, form, want in cases:
        assert choose_kv_dtype("auto", device=device, dtype=dtype, weight_form=form) == want, (
            device,
            dtype,
            form,
        )


def test_an_explicit_kv_dtype_is_kept_on_the_cpu_and_refused_on_cuda_unless_it_is_the_models() -> None:
    assert choose_kv_dtype("float16", device=CPU, dtype=torch.float32, weight_form="float") == torch.float16
    assert choose_kv_dtype("float32", device=CPU, dtype=torch.float32, weight_form="int4") == torch.float32
    assert (
        choose_kv_dtype("bfloat16", device=CUDA, dtype=torch.bfloat16, weight_form="float") == torch.bfloat16
    )
    with pytest.raises(ValueError, match="on cuda the KV pool holds the model's dtype"):
        choose_kv_dtype("float16", device=CUDA, dtype=torch.bfloat16, weight_form="float")
    with pytest.raises(ValueError, match="kv_dtype 'float8' is not one of auto, float32, bfloat16, float16"):
        choose_kv_dtype("float8", device=CPU, dtype=torch.float32, weight_form="float")


def test_a_bad_kv_dtype_is_a_start_up_error() -> None:
    with pytest.raises(ValueError, match="kv_dtype 'int8' is not one of"):
        EngineConfig(model="tiny", kv_dtype="int8")
    with pytest.raises(SystemExit):  # argparse: a usage error, before anything loads
        parse_settings(EngineSettings, ["--kv-dtype", "int8"], prog="worker")
    assert parse_settings(EngineSettings, ["--kv-dtype", "float16"], prog="worker").kv_dtype == "float16"


def test_a_float16_pool_halves_the_kv_and_a_session_streams_as_it_answers_whole() -> None:
    """The engine's promise under a float16 pool, through the engine's own (auto) backend: a history
    sent in micro-turns gives the tokens it gives sent whole; the pool's bytes a token are half."""
    with Engine.load("tiny", kv_tokens=4096, host_kv_tokens=0) as full:
        full_bytes = full.kv_format.page_bytes
        assert full.kv_format.dtype == "float32"
    with Engine.load("tiny", kv_tokens=4096, host_kv_tokens=0, kv_dtype="float16") as engine:
        assert engine.kv_format.dtype == "float16"
        assert engine.kv_format.page_bytes * 2 == full_bytes
        generator = torch.Generator().manual_seed(7)
        chunks = [torch.randint(1, 500, (n,), generator=generator).tolist() for n in (1, 9, 30, 2, 70, 5)]
        streamed = engine.open_session(stop_token_ids=(), max_output_tokens=3)
        history: list[int] = []
        for seq, chunk in enumerate(chunks, 1):
            tokens = engine.run_turn(streamed, tokens=chunk, seq=seq, timeout=60).tokens
            whole = engine.open_session(stop_token_ids=(), max_output_tokens=3, history=history)
            assert engine.run_turn(whole, tokens=chunk, timeout=60).tokens == tokens
            engine.close_session(whole)
            history += [*chunk, *tokens]
