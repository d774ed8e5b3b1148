"""`--kv-dtype` (worker/attention/kv_dtype.py): what the KV pool holds, resolved once at start, and
the refusals a worker says before it loads anything."""

from __future__ import annotations

import logging

import pytest
import torch

from shared.settings import EngineSettings, parse_settings
from tests.worker.cpu_kernel import needs_cpu_kernel
from worker.attention import BackendRefused
from worker.attention.cpu_backend import KERNEL
from worker.attention.kv_dtype import KVForm, choose_kv_form
from worker.engine import Engine
from worker.engine.config import EngineConfig

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def test_auto_keeps_int8_rows_for_the_quantised_forms_on_the_cpu_and_the_models_dtype_elsewhere() -> None:
    int8 = KERNEL is not None  # float16 where no kernel runs
    quantised_cpu_pool = KVForm(torch.float16, int8_keys=int8, int8_values=int8)
    cases = [
        (CPU, torch.float32, "int4", quantised_cpu_pool),
        (CPU, torch.float32, "int8", quantised_cpu_pool),
        (CPU, torch.float32, "float", KVForm(torch.float32)),  # the path held exact against transformers
        (CPU, torch.bfloat16, "int4", KVForm(torch.bfloat16)),
        (CUDA, torch.bfloat16, "int4", KVForm(torch.bfloat16)),
        (CUDA, torch.float16, "float", KVForm(torch.float16)),
    ]
    for device, dtype, form, want in cases:
        assert choose_kv_form("auto", device=device, dtype=dtype, weight_form=form) == want, (
            device,
            dtype,
            form,
        )
    # The torch reference reads no int8 rows, nor pages the kernel cannot hold them in: float16 then.
    assert choose_kv_form(
        "auto", device=CPU, dtype=torch.float32, weight_form="int4", attention="torch"
    ) == KVForm(torch.float16)
    assert choose_kv_form("auto", device=CPU, dtype=torch.float32, weight_form="int4", page_size=8) == KVForm(
        torch.float16
    )


def test_an_explicit_kv_dtype_is_kept_on_the_cpu_and_refused_on_cuda_unless_it_is_the_models() -> None:
    assert choose_kv_form("float16", device=CPU, dtype=torch.float32, weight_form="float") == KVForm(
        torch.float16
    )
    assert choose_kv_form("float32", device=CPU, dtype=torch.float32, weight_form="int4") == KVForm(
        torch.float32
    )
    assert choose_kv_form("bfloat16", device=CUDA, dtype=torch.bfloat16, weight_form="float") == KVForm(
        torch.bfloat16
    )
    int8_keys = choose_kv_form("int8-keys", device=CPU, dtype=torch.float32, weight_form="float")
    assert int8_keys == KVForm(torch.float16, int8_keys=True) and int8_keys.name == "int8-keys"
    int8 = choose_kv_form("int8", device=CPU, dtype=torch.float32, weight_form="int4")
    assert int8 == KVForm(torch.float16, int8_keys=True, int8_values=True) and int8.name == "int8"
    with pytest.raises(ValueError, match="int8 values come with int8 keys"):
        KVForm(torch.float16, int8_values=True)
    with pytest.raises(ValueError, match="int8: the cpu attention kernel's form"):
        choose_kv_form("int8", device=CUDA, dtype=torch.bfloat16, weight_form="float")
    with pytest.raises(ValueError, match="on cuda the KV pool holds the model's dtype"):
        choose_kv_form("float16", device=CUDA, dtype=torch.bfloat16, weight_form="float")
    with pytest.raises(ValueError, match="int8-keys: the cpu attention kernel's form"):
        choose_kv_form("int8-keys", device=CUDA, dtype=torch.bfloat16, weight_form="float")
    with pytest.raises(ValueError, match="pages of 8"):
        choose_kv_form("int8-keys", device=CPU, dtype=torch.float32, weight_form="int4", page_size=8)
    with pytest.raises(
        ValueError, match="kv_dtype 'float8' is not one of auto, float32, bfloat16, float16, int8-keys, int8"
    ):
        choose_kv_form("float8", device=CPU, dtype=torch.float32, weight_form="float")


def test_a_bad_kv_dtype_is_a_start_up_error() -> None:
    with pytest.raises(ValueError, match="kv_dtype 'int4' is not one of"):
        EngineConfig(model="tiny", kv_dtype="int4")
    with pytest.raises(SystemExit):  # argparse: a usage error, before anything loads
        parse_settings(EngineSettings, ["--kv-dtype", "int4"], prog="worker")
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


@needs_cpu_kernel
@pytest.mark.parametrize("form", ["int8-keys", "int8"])
def test_the_int8_forms_keep_the_pools_bytes_and_a_session_streams_as_it_answers_whole(form: str) -> None:
    """`--kv-dtype int8-keys` and `int8` through the engine: a float16 pool's bytes a page (the int8 rows
    sit in their float16 slots), named in the KV copy's header so a worker of another form takes none
    of its pages, and a history sent in micro-turns gives the tokens it gives sent whole."""
    with Engine.load("tiny", kv_tokens=4096, host_kv_tokens=0, kv_dtype="float16") as half:
        half_format = half.kv_format
    other = "int8" if form == "int8-keys" else "int8-keys"
    with Engine.load("tiny", kv_tokens=256, host_kv_tokens=0, kv_dtype=other) as other_engine:
        other_format = other_engine.kv_format
    with Engine.load("tiny", kv_tokens=4096, host_kv_tokens=0, kv_dtype=form) as engine:
        assert engine.kv_format.dtype == form
        assert engine.kv_format.page_bytes == half_format.page_bytes
        assert engine.kv_format.mismatch(half_format) == "dtype"
        assert engine.kv_format.mismatch(other_format) == "dtype"
        generator = torch.Generator().manual_seed(8)
        chunks = [torch.randint(1, 500, (n,), generator=generator).tolist() for n in (1, 9, 30, 2, 70, 5)]
        streamed = engine.open_session(stop_token_ids=(), max_output_tokens=3)
        history: list[int] = []
        for seq, chunk in enumerate(chunks, 1):
            tokens = engine.run_turn(streamed, tokens=chunk, seq=seq, timeout=60).tokens
            whole = engine.open_session(stop_token_ids=(), max_output_tokens=3, history=history)
            assert engine.run_turn(whole, tokens=chunk, seq=1, timeout=60).tokens == tokens, seq
            engine.close_session(whole)
            history += chunk + list(tokens)


@pytest.mark.parametrize("form", ["int8-keys", "int8"])
def test_an_int8_form_under_the_torch_reference_is_a_clear_start_up_error(form: str) -> None:
    with pytest.raises(BackendRefused, match="the int8 forms are the cpu attention kernel's"):
        Engine.load("tiny", kv_tokens=256, host_kv_tokens=0, kv_dtype=form, attention="torch")


@needs_cpu_kernel
def test_auto_falls_back_to_float16_where_the_kernel_fails_its_start_up_check(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`auto` picks int8 rows for a quantised form because the cpu kernel runs; should that kernel then
    fail its start-up check, the torch reference serves, on float16 (an explicit int8 form refuses)."""
    from worker import attention

    checked = attention.compare_with_torch

    def broken_on_int8_keys(
        backend: type[attention.AttentionBackend], shape: attention.AttentionShape
    ) -> str | None:
        return "broken on purpose" if shape.int8_keys else checked(backend, shape)

    monkeypatch.setattr(attention, "compare_with_torch", broken_on_int8_keys)
    with (
        caplog.at_level(logging.WARNING),
        Engine.load("tiny", weights="int8", kv_tokens=256, host_kv_tokens=0) as engine,
    ):
        assert engine.kv_format.dtype == "float16"
    assert "broken on purpose" in caplog.text and "holds float16 instead" in caplog.text
    with pytest.raises(BackendRefused, match="broken on purpose"):
        Engine.load("tiny", weights="int8", kv_tokens=256, host_kv_tokens=0, kv_dtype="int8-keys")
