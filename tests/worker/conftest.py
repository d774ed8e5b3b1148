"""Fixtures of the worker tests: a tiny engine per test, and SmolLM2 loaded once per run
(tests/worker/smollm2.py says why)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest

from tests import transformers_smollm2
from tests.worker.smollm2 import CPU, DTYPE
from worker.engine import Engine
from worker.model.loader import SMOLLM2_PRESET, LoadedModel, load_model
from worker.model.presets import smollm2_gguf_path


@pytest.fixture
def tiny() -> Iterator[Engine]:
    with Engine.load(
        "tiny",
        kv_tokens=4096,
        page_size=16,
        max_chunk_tokens=256,
        max_pending_tokens=64,
        max_pending_outputs=2,
    ) as engine:
        yield engine


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The GGUF file; the tests of the file itself skip without it (the engine's tests fail)."""
    try:
        return smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_path: Path) -> gguf.GGUFReader:
    """The SmolLM2 GGUF's reader (tests/worker/smollm2.py: one per run)."""
    return gguf.GGUFReader(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_model() -> LoadedModel:
    """SmolLM2's config, weights and tokenizer as the engine loads them, on the CPU in float32, in the
    float weight form (the dequantised weights transformers runs too)."""
    return load_model(SMOLLM2_PRESET, device=CPU, dtype=DTYPE, weights="float")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_transformers_dir: Path) -> Any:
    """transformers' own model of the same GGUF file: the reference the real weights are held to
    (converted once per run, tests/transformers_smollm2.py)."""
    model = transformers_smollm2.model(smollm2_transformers_dir)
    assert next(model.parameters()).dtype == DTYPE
    return model


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path: Path, smollm2_transformers_dir: Path) -> Any:
    """transformers' own tokenizer of the same GGUF file (converted with the model)."""
    return transformers_smollm2.tokenizer(smollm2_transformers_dir)
