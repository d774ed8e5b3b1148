"""SmolLM2-135M loaded once per test run: the worker tests that need its real weights, its GGUF
reader or transformers' own model of the same file share one of each.

Why shared: each load parses the GGUF's 49k-token vocabulary and dequantizes every tensor (seconds
of CPU, tens of seconds on a loaded 2-core machine), and nothing a test does changes them: an engine
reads the weights, never writes them, so engines with different options can sit on one load.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from worker.engine import Engine
from worker.engine.config import EngineConfig
from worker.model.loader import SMOLLM2_PRESET, LoadedModel

CPU: Final = torch.device("cpu")
DTYPE: Final = torch.float32


def engine_on(loaded: LoadedModel, **options: Any) -> Engine:
    """`Engine.load("smollm2-135m", **options)` on weights already loaded: the same engine, built by
    the same constructor `Engine.load` calls, on the CPU in float32 as those weights are."""
    config = EngineConfig(model=SMOLLM2_PRESET, **{"weights": "float", **options})
    assert (torch.device(config.device), config.dtype) == (CPU, "float32"), "the shared load is CPU float32"
    assert config.weights == "float", "the shared load is the float weight form"
    return Engine(config, loaded)
