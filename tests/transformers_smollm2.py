"""transformers' own SmolLM2, converted from the GGUF once per test run and read back by every user.

What the tests hold the engine to is transformers' conversion of the file (its GGUF reader, its
dequantisation, its config and tokenizer), never our loader's. That conversion costs about 17 s of
CPU (transformers parses the GGUF twice and rebuilds its tensor-name map per tensor), and the run
needs it in two processes: the pytest process (the worker tests' `hf_smollm2`) and the OpenAI
prefix reference's subprocess (tests/system/gateway/openai_reference.py). So the first of them to
ask converts it and saves the result, plain float32 safetensors with its config and tokenizer
files, into the run's temporary directory; every later load reads that back (a tenth of a second),
weights and generations bitwise the same. Nothing is downloaded and nothing is kept past the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

# The conversion's directory under a run's base temporary directory.
DIRECTORY: Final = "smollm2-transformers"
# Written last: a directory without it is a conversion that did not finish.
_DONE: Final = "converted"


def checkpoint_dir(base: Path) -> Path:
    """Where the run whose base temporary directory is `base` keeps the conversion."""
    return base / DIRECTORY


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One converter at a time across processes; the others wait, then read its result."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def converted(directory: Path) -> Path:
    """`directory`, holding transformers' conversion of the SmolLM2 GGUF (converted now if no
    process of the run has yet)."""
    with _locked(directory):
        if not (directory / _DONE).exists():
            _convert(directory)
    return directory


def _convert(directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.model.presets import smollm2_gguf_path

    path = smollm2_gguf_path()
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    # Its weights are float32 tensors by now; only these marks of their GGUF origin remain, and
    # save_pretrained refuses a model that carries them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    shutil.rmtree(directory, ignore_errors=True)  # a conversion that died half way
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(directory)
    (directory / _DONE).touch()


def model(directory: Path) -> Any:
    """transformers' model of the GGUF, in float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(str(converted(directory)), dtype=torch.float32)
    return loaded.eval()


def tokenizer(directory: Path) -> Any:
    """transformers' tokenizer of the GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(converted(directory)))
