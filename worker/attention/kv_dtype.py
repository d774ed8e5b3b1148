"""What the KV pool holds: the `--kv-dtype` setting, resolved once at start.

- `auto`: float16 on the CPU where the weights are a quantised form (`int4`, `int8`) computing in
  float32, else the model's dtype. A decode step over a long history is bound by reading that
  history's keys and values (SmolLM2 keeps 46 KB of them a token in float32: 244 MB a step at 5,300
  positions); float16 halves the read and the pool's memory per token. The quantised forms already
  stand apart from the float path (they quantise the activations: worker/model/weight_form.py), and
  llama.cpp, the CPU peer, keeps its KV in float16 by default. Under `float` the pool keeps the
  model's dtype: that path is held exact against transformers, which keeps float32 keys.
- `float32`, `bfloat16`, `float16`: that dtype. On CUDA only the model's (flashinfer computes in its
  pool's dtype); on the CPU a pool narrower than the model's dtype is read exactly into it and
  computed on there (the `cpu` kernel: float16 under float32; the torch reference: any).

Either way a key or value is rounded once, to nearest even, as it is written, and every read of it
is exact: a session streamed in micro-turns gets the same bits as its history sent whole, and a KV
copy or a host-tier page means the same bytes under either CPU backend. The KV copy's header names
the pool's dtype (shared/protocol/kv_copy.py): a worker holding another one takes no copy.
"""

from __future__ import annotations

from typing import Final

import torch

from shared.settings import KV_DTYPES
from worker.dtypes import dtype_name, torch_dtype

AUTO: Final = "auto"


def choose_kv_dtype(
    setting: str, *, device: torch.device, dtype: torch.dtype, weight_form: str
) -> torch.dtype:
    """The KV pool's dtype for `--kv-dtype setting` with the model's `dtype` and resolved weight form;
    raises ValueError for a setting this device cannot serve."""
    if setting not in KV_DTYPES:
        raise ValueError(f"kv_dtype {setting!r} is not one of {', '.join(KV_DTYPES)}")
    if setting == AUTO:
        compact = device.type == "cpu" and dtype == torch.float32 and weight_form != "float"
        return torch.float16 if compact else dtype
    chosen = torch_dtype(setting)
    if device.type != "cpu" and chosen != dtype:
        raise ValueError(
            f"--kv-dtype {setting}: on {device.type} the KV pool holds the model's dtype "
            f"({dtype_name(dtype)}); set --dtype instead"
        )
    return chosen
