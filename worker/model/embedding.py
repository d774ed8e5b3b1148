"""The token embedding lookup: a float table, or the stored GGUF rows dequantised as they are looked up.

A lookup reads only its tokens' rows, so keeping the table in its stored blocks costs a step
almost nothing and keeps the values exact (gguf's own dequantiser, row by row), while the tied
output projection, which reads the whole table every sampled token, gets its own fast form
(worker/model/weight_form.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.stored import StoredTensor


class Embedding(ABC):
    @abstractmethod
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[tokens] ids -> [tokens, hidden] in the model's dtype, on the ids' device: a new tensor,
        which the forward adds into in place (its residual stream)."""

    @property
    @abstractmethod
    def num_bytes(self) -> int: ...

    @property
    @abstractmethod
    def shape(self) -> tuple[int, int]: ...


@dataclass(frozen=True, eq=False)
class FloatEmbedding(Embedding):
    table: torch.Tensor  # [vocab, hidden]

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.table)

    @property
    def num_bytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.table.shape[0]), int(self.table.shape[1]))


@dataclass(frozen=True, eq=False)
class StoredEmbedding(Embedding):
    stored: StoredTensor
    dtype: torch.dtype

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.stored.dequantize_rows(input_ids.cpu().numpy())
        return rows.to(device=input_ids.device, dtype=self.dtype)

    @property
    def num_bytes(self) -> int:
        return self.stored.num_bytes

    @property
    def shape(self) -> tuple[int, int]:
        return self.stored.shape
