"""The int8-keys form of the KV pool (`--kv-dtype int8-keys`): values as float16, each key row as int8
with one float32 scale, and the scores as integer dot products (worker/attention/cpu_kernel.c).

Why: at a few thousand positions a CPU step is mostly attention (docs/benchmarks.md, #32), and its
scores were float dot products summed across lanes, a key row converted from float16 first. Stored
as int8 a key is 68 bytes of 64 dims, not 128, and 16 keys' dot products run in one register's
lanes (vpdpwssd on AVX-512 VNNI; vpmaddwd on AVX2, the same integers exactly).

A row is rounded at `levels` (KEY_LEVELS for a key as it is written, QUERY_LEVELS for a query head
as a job starts) with scale = absmax / levels, each value rint(x * (levels / absmax)) within
-levels .. levels: `round_rows` here is the kernel's `round_row`, to the same values. The queries
keep 16 bits: rounded to 8 they cost more agreement with the float path than the keys do
(docs/benchmarks.md). The integers are exact, so a session streamed in micro-turns gets the same
bits as its history sent whole, as on the float forms; against the float path the scores carry the
keys' rounding (point 3 of #32 measures what it costs, beside llama.cpp).

The key bytes keep the float16 pool's shape (the host tier, KV copies and the prefix cache move
whole pages of it): KV head h's slots of page p, page_size x head_dim float16s, hold the int8 keys
as [head_dim / 2][page_size][2] bytes, then page_size float32 scales (`read_page`).
"""

from __future__ import annotations

from typing import Final

import torch

# A page's keys run 16 to a register on AVX-512 (8 on AVX2): its page size must be a multiple.
PAGE_MULTIPLE: Final = 16
# The levels either side of zero a key row and a query head are rounded to.
KEY_LEVELS: Final = 127
QUERY_LEVELS: Final = 32767


def round_rows(rows: torch.Tensor, levels: int = KEY_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows [..., dim] -> (their integers [..., dim] as int32, float32 scales [...]), as the
    kernel rounds them."""
    rows = rows.float()
    magnitude = rows.abs()
    absmax = torch.where(magnitude.isnan(), 0.0, magnitude).amax(dim=-1)
    # levels / absmax as a division, as the kernel takes it (a number over a tensor is the tensor's
    # reciprocal times the number in torch: a last bit off, and a rounding boundary crossed now and then).
    inverse = torch.where(absmax > 0, torch.full_like(absmax, levels) / absmax, torch.zeros_like(absmax))
    rounded = torch.round(rows * inverse.unsqueeze(-1)).clamp(-levels, levels)
    rounded = torch.where(rounded.isnan(), 0.0, rounded)
    return rounded.to(torch.int32), absmax / levels


def through_rounding(rows: torch.Tensor, levels: int = KEY_LEVELS) -> torch.Tensor:
    """The rows as their rounding at `levels` holds them (each integer times its row's scale), float32."""
    values, scales = round_rows(rows, levels)
    return values.float() * scales.unsqueeze(-1)


def read_page(page_keys: torch.Tensor, page_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV head's key slots of one page as stored (page_size x head_dim float16s, or their bytes)
    -> (int8 keys [page_size, head_dim], float32 scales [page_size])."""
    raw = page_keys.contiguous().view(torch.uint8).reshape(-1)
    paired = raw[: page_size * head_dim].view(torch.int8).view(head_dim // 2, page_size, 2)
    keys = paired.permute(1, 0, 2).reshape(page_size, head_dim)
    scales = raw[page_size * head_dim : page_size * (head_dim + 4)].view(torch.float32)
    return keys, scales


def pack_pages(keys: torch.Tensor) -> torch.Tensor:
    """Key rows [..., page_size, head_dim] (float) as the kernel writes them into their pages: the key
    slots' bytes [..., page_size * head_dim * 2] (`read_page`'s inverse; a benchmark fills a pool so)."""
    *outer, page_size, head_dim = keys.shape
    values, scales = round_rows(keys)
    paired = values.to(torch.int8).view(*outer, page_size, head_dim // 2, 2).transpose(-3, -2)
    packed = torch.zeros(*outer, page_size * head_dim * 2, dtype=torch.uint8)
    packed[..., : page_size * head_dim] = paired.reshape(*outer, page_size * head_dim).view(torch.uint8)
    scale_bytes = scales.contiguous().view(torch.uint8).reshape(*outer, page_size * 4)
    packed[..., page_size * head_dim : page_size * (head_dim + 4)] = scale_bytes
    return packed
