"""Which held layout each matrix gets under `--weights int4|int8` on CUDA (worker/model/linear_blocks.py).

- `int4`: Q4_0, Q4_1 and Q8_0 matrices as stored; a matrix with no stored blocks (a float
  checkpoint's, or a GGUF's F16/F32 one, handed over dense) quantised into Q4_1 groups (asymmetric,
  a float16 scale and minimum per 32, as llama.cpp would write them), as the CPU's int4 does.
- `int8`: Q8_0 matrices as stored; every other matrix dequantised and requantised to Q8_0 groups.
Parts of one fused projection held in different stored types are held together at 8 bits. The
refusals (a stored type no int4 kernel takes) are made once, earlier, in `resolve_weight_form`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.model.linear_blocks import BLOCK_STORED_TYPES, BlockLinear
from worker.model.stored import StoredTensor

Source = torch.Tensor | StoredTensor


def block_linear(
    form_name: str, parts: Sequence[Source], bias: torch.Tensor | None, device: torch.device
) -> BlockLinear:
    """One matrix from `parts` stacked along their rows, held as `form_name` ("int4" or "int8") says."""
    stored = [p for p in parts if isinstance(p, StoredTensor)]
    kinds = {p.kind for p in stored}
    if len(stored) == len(parts) and len(kinds) == 1 and kinds <= BLOCK_STORED_TYPES:
        (kind,) = kinds
        if form_name == "int4" or kind.name == "Q8_0":
            return BlockLinear.from_stored(StoredTensor.cat(stored), bias, device)
    weight = torch.cat([_dense(p, device) for p in parts])
    if form_name == "int4" and not stored:  # a float checkpoint: quantised into Q4_1 groups at load
        return BlockLinear.q4_1_from_float(weight, bias)
    return BlockLinear.q8_0_from_float(weight, bias)


def _dense(part: Source, device: torch.device) -> torch.Tensor:
    dense = part.dequantize() if isinstance(part, StoredTensor) else part
    return dense.to(device=device, dtype=torch.float32)
