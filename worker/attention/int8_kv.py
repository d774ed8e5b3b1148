"""The int8 forms of the KV pool (worker/attention/cpu_kernel.c reads them):

- `--kv-dtype int8-keys`: values as float16, each key row as int8 with one float32 scale, and the
  scores as integer dot products;
- `--kv-dtype int8`: the keys so, and each value row as int8 with one float32 scale too, weighed in
  integers.

Why: at a few thousand positions a CPU step is mostly attention (docs/benchmarks.md, #32), and a
decode step's attention is reading its history. Stored as int8 a key is 68 bytes of 64 dims, not
128, and 16 keys' dot products run in one register's lanes (vpdpwssd on AVX-512 VNNI; vpmaddwd on
AVX2, the same integers exactly); a value row is 68 bytes too, and two positions' rows multiply a
head's two weights in one instruction.

A row is rounded at `levels` (ROW_LEVELS for a key or value as it is written, QUERY_LEVELS for a
query head as a job starts) with scale = absmax / levels, each value rint(x * (levels / absmax))
within -levels .. levels: `round_rows` here is the kernel's `round_row`, to the same values. The
queries keep 16 bits: rounded to 8 they cost more agreement with the float path than the keys do
(docs/benchmarks.md). A head's weights over a block of 64 value rows (softmax term x the row's
scale) are rounded to int16, 32767 levels below the head's largest weight in the block (the kernel's
`round_weights`; the tests bound what it moves). The integers are exact,
so a session streamed in micro-turns gets the same bits as its history sent whole, as on the float
forms; against the float path the outputs carry the rounding (point 3 of #32 measures what it costs,
beside llama.cpp).

The bytes keep the float16 pool's shape (the host tier, KV copies and the prefix cache move whole
pages of it): KV head h's key slots of page p, page_size x head_dim float16s, hold the int8 keys as
[head_dim / 2][page_size][2] bytes (`read_page`), its value slots the int8 values as
[page_size / 2][head_dim][2] bytes (`read_value_page`), each then page_size float32 scales.
"""

from __future__ import annotations

from typing import Final

import torch

# A page's keys run 16 to a register on AVX-512 (8 on AVX2): its page size must be a multiple.
PAGE_MULTIPLE: Final = 16
# The levels either side of zero a key or value row, and a query head, are rounded to.
ROW_LEVELS: Final = 127
QUERY_LEVELS: Final = 32767


def round_rows(rows: torch.Tensor, levels: int = ROW_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
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


def through_rounding(rows: torch.Tensor, levels: int = ROW_LEVELS) -> torch.Tensor:
    """The rows as their rounding at `levels` holds them (each integer times its row's scale), float32."""
    values, scales = round_rows(rows, levels)
    return values.float() * scales.unsqueeze(-1)


def _page_bytes(page: torch.Tensor, page_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV head's slots of one page (page_size x head_dim float16s, or their bytes) -> (its int8 bytes,
    its float32 scales [page_size])."""
    raw = page.contiguous().view(torch.uint8).reshape(-1)
    scales = raw[page_size * head_dim : page_size * (head_dim + 4)].view(torch.float32)
    return raw[: page_size * head_dim].view(torch.int8), scales


def read_page(page_keys: torch.Tensor, page_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV head's key slots of one page as stored -> (int8 keys [page_size, head_dim], float32 scales
    [page_size])."""
    raw, scales = _page_bytes(page_keys, page_size, head_dim)
    return raw.view(head_dim // 2, page_size, 2).permute(1, 0, 2).reshape(page_size, head_dim), scales


def read_value_page(
    page_values: torch.Tensor, page_size: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV head's value slots of one page as stored -> (int8 values [page_size, head_dim], float32
    scales [page_size])."""
    raw, scales = _page_bytes(page_values, page_size, head_dim)
    return raw.view(page_size // 2, head_dim, 2).permute(0, 2, 1).reshape(page_size, head_dim), scales


def _packed(
    paired: torch.Tensor, scales: torch.Tensor, outer: list[int], page_size: int, head_dim: int
) -> torch.Tensor:
    """A page's int8 bytes (`paired`, in their layout) and row scales as its slots' bytes."""
    packed = torch.zeros(*outer, page_size * head_dim * 2, dtype=torch.uint8)
    packed[..., : page_size * head_dim] = paired.reshape(*outer, page_size * head_dim).view(torch.uint8)
    packed[..., page_size * head_dim : page_size * (head_dim + 4)] = (
        scales.contiguous().view(torch.uint8).reshape(*outer, page_size * 4)
    )
    return packed


def pack_pages(keys: torch.Tensor) -> torch.Tensor:
    """Key rows [..., page_size, head_dim] (float) as the kernel writes them into their pages: the key
    slots' bytes [..., page_size * head_dim * 2] (`read_page`'s inverse; a benchmark fills a pool so)."""
    *outer, page_size, head_dim = keys.shape
    values, scales = round_rows(keys)
    paired = values.to(torch.int8).view(*outer, page_size, head_dim // 2, 2).transpose(-3, -2)
    return _packed(paired, scales, outer, page_size, head_dim)


def pack_value_pages(values: torch.Tensor) -> torch.Tensor:
    """Value rows [..., page_size, head_dim] (float) as the kernel writes them into their pages
    (`read_value_page`'s inverse)."""
    *outer, page_size, head_dim = values.shape
    rounded, scales = round_rows(values)
    paired = rounded.to(torch.int8).view(*outer, page_size // 2, 2, head_dim).transpose(-2, -1)
    return _packed(paired, scales, outer, page_size, head_dim)
