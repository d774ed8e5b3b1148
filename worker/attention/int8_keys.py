"""The int8-keys form of the KV pool (`--kv-dtype int8-keys`): values as float16, each key row as int8
with one float32 scale, and the scores as integer dot products (worker/attention/cpu_kernel.c).

Why: at a few thousand positions a CPU step is mostly attention (docs/benchmarks.md, #32), and its
scores were float dot products summed across lanes, a key row converted from float16 first. Stored
as int8 a key is 72 bytes of 64 dims, not 128, and 16 keys' dot products run in one register's lanes
(vpdpbusd on AVX-512 VNNI; vpmaddubsw + vpmaddwd on AVX2, the same integers exactly).

A row (a key as it is written, a query head as a job starts) is rounded with scale = absmax / 127,
each value rint(x * (127 / absmax)) within -127 .. 127: `round_rows` here is the kernel's
`round_int8_row`, to the same bytes. The integers are exact, so a session streamed in micro-turns
gets the same bits as its history sent whole, as on the float forms; against the float path the
scores carry the rounding of both sides (point 3 of #32 measures what it costs, beside llama.cpp).

The key bytes keep the float16 pool's shape (the host tier, KV copies and the prefix cache move
whole pages of it): KV head h's slots of page p, page_size x head_dim float16s, hold the int8 keys
as [head_dim / 4][page_size][4] bytes, each plus 128, then page_size float32 scales (`read_page`).
"""

from __future__ import annotations

from typing import Final

import torch

# A page's keys run 16 to a register on AVX-512 (8 on AVX2): its page size must be a multiple.
PAGE_MULTIPLE: Final = 16
# Added to each stored int8 key value: the keys are vpdpbusd's unsigned operand.
BIAS: Final = 128


def round_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows [..., dim] -> (int8 [..., dim], float32 scales [...]), as the kernel rounds them."""
    rows = rows.float()
    magnitude = rows.abs()
    absmax = torch.where(magnitude.isnan(), 0.0, magnitude).amax(dim=-1)
    inverse = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    rounded = torch.round(rows * inverse.unsqueeze(-1)).clamp(-127, 127)
    rounded = torch.where(rounded.isnan(), 0.0, rounded)
    return rounded.to(torch.int8), absmax / 127.0


def through_int8(rows: torch.Tensor) -> torch.Tensor:
    """The rows as their int8 form holds them (each value times its row's scale), float32."""
    values, scales = round_rows(rows)
    return values.float() * scales.unsqueeze(-1)


def read_page(page_keys: torch.Tensor, page_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV head's key slots of one page as stored (page_size x head_dim float16s, or their bytes)
    -> (int8 keys [page_size, head_dim], float32 scales [page_size])."""
    raw = page_keys.contiguous().view(torch.uint8).reshape(-1)
    grouped = raw[: page_size * head_dim].view(head_dim // 4, page_size, 4)
    keys = (grouped.permute(1, 0, 2).reshape(page_size, head_dim).to(torch.int16) - BIAS).to(torch.int8)
    scales = raw[page_size * head_dim : page_size * (head_dim + 4)].view(torch.float32)
    return keys, scales
