"""Dtypes as the settings and the KV copy's header spell them (shared/settings.py's DTYPE_NAMES),
and as torch holds them: the one conversion each way."""

from __future__ import annotations

import torch

from shared.settings import DTYPE_NAMES


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of one of DTYPE_NAMES."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_NAMES)}")
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float16` -> `float16`."""
    return str(dtype).removeprefix("torch.")
