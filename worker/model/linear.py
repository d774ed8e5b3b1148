"""The one interface every weight matrix is multiplied through: `y = x @ W.T (+ bias)`.

A weight form (worker/model/weight_form.py) turns each of the model's matrices into a `Linear`
once, at load; the forward pass only calls them, so it never knows how a matrix is held.
`FloatLinear` is the float path, `F.linear` on a dense tensor (on the CPU at least
worker/numerics.py's MIN_ROWS rows, so that a row's sums do not depend on the step's size); the
quantised kinds live in their own files (linear_int8.py, linear_int4.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.numerics import at_least_rows


class Linear(ABC):
    """A [out_features, in_features] matrix, held however its form holds it."""

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, in_features] in the model's dtype -> [tokens, out_features] in the same dtype."""

    @property
    @abstractmethod
    def num_bytes(self) -> int:
        """The resident bytes of everything the product reads (values, scales, bias)."""

    @property
    @abstractmethod
    def out_features(self) -> int: ...


@dataclass(frozen=True, eq=False)
class FloatLinear(Linear):
    weight: torch.Tensor  # [out, in], the model's dtype
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        # MKL sums a row of a product of fewer than MIN_ROWS rows in another order (numerics.py).
        return F.linear(at_least_rows(x), self.weight, self.bias)[: x.shape[0]]

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + extra

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])
