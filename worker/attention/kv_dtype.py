"""What the KV pool holds: the `--kv-dtype` setting, resolved once at start into a `KVForm`.

- `auto`: on the CPU where the weights are a quantised form (`int4`, `int8`) computing in float32,
  `int8` where the `cpu` attention kernel serves (its extension built, AVX2, `--attention` auto or
  cpu, pages of a multiple of 16; the engine takes float16 should the kernel then fail its start-up
  check), else float16; elsewhere the model's dtype. A step over a long history is bound by reading
  that history's keys and values and weighing them (SmolLM2 keeps 46 KB of them a token in float32:
  244 MB a step at 5,300 positions); float16 halves the read, and int8 rows
  (worker/attention/int8_kv.py) read a key or value row of 64 dims in 68 bytes and multiply it in
  integers. The quantised forms already stand apart from the float path (they quantise the
  activations: worker/model/weight_form.py); what the int8 rows add to that is measured beside
  llama.cpp, the CPU peer, which keeps its KV in float16 by default (docs/benchmarks.md).
  Under `float` the pool keeps the model's dtype: that path is held exact against transformers,
  which keeps float32 keys.
- `float32`, `bfloat16`, `float16`: that dtype. On CUDA only the model's (flashinfer computes in its
  pool's dtype); on the CPU a pool narrower than the model's dtype is read exactly into it and
  computed on there (the `cpu` kernel: float16 under float32; the torch reference: any).
- `int8-keys`: a float16 pool whose key slots hold int8 keys (the `cpu` kernel only; a float32 model
  on the CPU); `int8`: its value slots int8 values too (worker/attention/int8_kv.py).

Either way a key or value is rounded once, to nearest even, as it is written, and every read of it
is exact: a session streamed in micro-turns gets the same bits as its history sent whole, and a KV
copy or a host-tier page means the same bytes under either CPU backend that reads its form. The KV
copy's header names the form (shared/protocol/kv_copy.py): a worker holding another one takes no
copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

from shared.settings import KV_DTYPES, KV_INT8, KV_INT8_KEYS
from worker.attention.base import AttentionShape
from worker.attention.cpu_backend import KERNEL
from worker.attention.int8_kv import PAGE_MULTIPLE
from worker.dtypes import dtype_name, torch_dtype
from worker.model.config import ModelConfig

AUTO: Final = "auto"
# The `--attention` settings under which the `cpu` kernel may serve (`auto` picks it where it runs).
_CPU_KERNEL_ATTENTION: Final = ("auto", "cpu")


@dataclass(frozen=True)
class KVForm:
    """What the KV pool holds: its tensor's dtype (the bytes a slot takes), and whether its key slots
    hold the int8-keys form, and its value slots int8 values (only with the keys)."""

    dtype: torch.dtype
    int8_keys: bool = False
    int8_values: bool = False

    def __post_init__(self) -> None:
        if self.int8_values and not self.int8_keys:
            raise ValueError(f"int8 values come with int8 keys ({KV_INT8})")

    @property
    def name(self) -> str:
        """As the setting and the KV copy's header spell it."""
        if self.int8_values:
            return KV_INT8
        return KV_INT8_KEYS if self.int8_keys else dtype_name(self.dtype)

    def attention_shape(
        self, config: ModelConfig, *, device: torch.device, dtype: torch.dtype, page_size: int
    ) -> AttentionShape:
        """A model's attention shape over a pool of this form."""
        return AttentionShape(
            device,
            dtype,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            page_size,
            self.dtype,
            self.int8_keys,
            self.int8_values,
        )


def choose_kv_form(
    setting: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    weight_form: str,
    attention: str = AUTO,
    page_size: int = PAGE_MULTIPLE,
) -> KVForm:
    """The KV pool's form for `--kv-dtype setting` with the model's `dtype`, resolved weight form,
    `--attention` and page size; raises ValueError for a setting this device cannot serve."""
    if setting not in KV_DTYPES:
        raise ValueError(f"kv_dtype {setting!r} is not one of {', '.join(KV_DTYPES)}")
    on_cpu_float32 = device.type == "cpu" and dtype == torch.float32
    if setting == AUTO:
        if not on_cpu_float32 or weight_form == "float":
            return KVForm(dtype)
        int8 = KERNEL is not None and attention in _CPU_KERNEL_ATTENTION and page_size % PAGE_MULTIPLE == 0
        return KVForm(torch.float16, int8_keys=int8, int8_values=int8)
    if setting in (KV_INT8_KEYS, KV_INT8):
        if not on_cpu_float32 or page_size % PAGE_MULTIPLE:
            raise ValueError(
                f"--kv-dtype {setting}: the cpu attention kernel's form, for a float32 model on the "
                f"CPU with pages of a multiple of {PAGE_MULTIPLE} (not {dtype_name(dtype)} on "
                f"{device.type}, pages of {page_size})"
            )
        return KVForm(torch.float16, int8_keys=True, int8_values=setting == KV_INT8)
    chosen = torch_dtype(setting)
    if device.type != "cpu" and chosen != dtype:
        raise ValueError(
            f"--kv-dtype {setting}: on {device.type} the KV pool holds the model's dtype "
            f"({dtype_name(dtype)}); set --dtype instead"
        )
    return KVForm(chosen)
