"""8-bit weights (one scale per output row): with activations quantised per row each step and an
integer product (`Int8Linear`), or with bfloat16 activations (`Int8WeightOnlyLinear`).

`Int8Linear`: each input row is quantised on its own (symmetric, scale = max |x| / 127) and
multiplied by `torch._int_mm` into int32, then scaled back to float. The integer sums are exact,
and every scale is per row, so a row's result does not depend on the rows beside it: a session's
tokens are the same alone or batched, and streamed in micro-turns or sent whole (the engine's
promise). fbgemm's dynamic linear (`quantized::linear_dynamic`) is faster at one row but quantises
the activations over the whole batch, which breaks that promise (docs/benchmarks.md, "Weight forms").

Neither is exact against the float path (`Int8Linear` quantises both operands); their greedy
agreement with the float path is measured instead (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model.linear import Linear

_LEVELS = 127.0
# Below this an activation row is all zeros for int8 purposes; the guard only avoids 0/0.
_TINY = 1e-30


@dataclass(frozen=True, eq=False)
class Int8Linear(Linear):
    weight_t: torch.Tensor  # [in, out] int8: the layout `_int_mm` reads
    scale: torch.Tensor  # [out] float32, w = weight_t.T * scale[:, None]
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float()
        x_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=_TINY) / _LEVELS
        quantised = torch.round(rows / x_scale).to(torch.int8)
        y = (torch._int_mm(quantised, self.weight_t) * (x_scale * self.scale)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight_t.numel() + self.scale.numel() * 4 + extra

    @property
    def out_features(self) -> int:
        return int(self.scale.shape[0])

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        """Symmetric int8 per output row: scale = max |w| / 127 (an all-zero row keeps scale 1)."""
        w = weight.float()
        scale = w.abs().amax(dim=1) / _LEVELS
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[:, None]).to(torch.int8)
        return cls(q.t().contiguous(), scale, bias)


@dataclass(frozen=True, eq=False)
class Int8WeightOnlyLinear(Linear):
    """The same 8-bit rows (one scale per output row), multiplied by `_weight_int8pack_mm` with
    bfloat16 activations: only the weights are quantised, so it stays closer to the float path than
    `Int8Linear`, whose activations are quantised to 8 bits per row (measured on SmolLM2's output
    projection: docs/benchmarks.md, "Weight forms"). Its rows are independent (each output is one
    float32 dot product, then rounded to bfloat16), and it is as fast as `Int8Linear` at one row but
    several times slower at dozens: the output projection, which multiplies only the sampled rows,
    is where it is used (worker/model/weight_form.py)."""

    weight: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] bfloat16, w = weight * scale[:, None]
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        product: torch.Tensor = torch.ops.aten._weight_int8pack_mm(
            x.to(torch.bfloat16), self.weight, self.scale
        )
        y = product.to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() + self.scale.numel() * 2 + extra

    @property
    def out_features(self) -> int:
        return int(self.scale.shape[0])

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8WeightOnlyLinear:
        """Symmetric int8 per output row, as `Int8Linear.from_float` (the scale then in bfloat16)."""
        rows = Int8Linear.from_float(weight, bias)
        return cls(rows.weight_t.t().contiguous(), rows.scale.to(torch.bfloat16), bias)
