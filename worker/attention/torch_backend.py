"""Reference attention in plain torch: gather each row's pages, then SDPA with a bottom-right causal mask.

Runs anywhere torch runs (the CPU default, and the reference the flashinfer backend is tested
against). Rows that decode one token are batched into one padded SDPA call; longer appends run
one row at a time so the mask never grows with the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class _AppendRow:
    tokens: slice
    kv_slots: torch.Tensor  # [kv_len] flat slot ids
    mask: torch.Tensor | None  # [q_len, kv_len] bool; None when q_len == kv_len (plain causal)


@dataclass(frozen=True)
class _DecodeGroup:
    token_index: torch.Tensor  # [rows] the decode tokens' indices in the step
    kv_slots: torch.Tensor  # [rows * max_kv] flat slot ids, each row padded with a valid slot
    max_kv: int
    mask: torch.Tensor  # [rows, 1, 1, max_kv] bool, False on padding


@dataclass(frozen=True)
class _Plan:
    write_slots: torch.Tensor  # [tokens] flat slot id of every new token
    decode: _DecodeGroup | None
    appends: tuple[_AppendRow, ...]


def _slots_of(
    meta: AttentionMetadata, rows: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    page_starts = meta.kv_page_indptr.to(positions.device, torch.int64)[rows]
    pages = meta.kv_page_indices.to(torch.int64)[
        page_starts + torch.div(positions, page_size, rounding_mode="floor")
    ]
    return pages * page_size + positions % page_size


class TorchAttention(AttentionBackend):
    name = "torch"

    _plan: _Plan | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        device = meta.positions.device
        page_size = self.kv_pool.page_size
        q_lens = torch.tensor(meta.q_lens, device=device)
        row_of_token = torch.repeat_interleave(torch.arange(meta.num_rows, device=device), q_lens)
        write_slots = _slots_of(meta, row_of_token, meta.positions, page_size)

        decode_rows = [i for i, n in enumerate(meta.q_lens) if n == 1]
        decode = None
        if decode_rows:
            rows = torch.tensor(decode_rows, device=device)
            kv_lens = torch.tensor([meta.kv_lens[i] for i in decode_rows], device=device)
            max_kv = int(max(meta.kv_lens[i] for i in decode_rows))
            cols = torch.arange(max_kv, device=device).unsqueeze(0)
            clamped = torch.minimum(cols, kv_lens.unsqueeze(1) - 1)
            slots = _slots_of(meta, rows.unsqueeze(1).expand_as(clamped), clamped, page_size)
            token_index = torch.tensor([int(meta.qo_indptr[i]) for i in decode_rows], device=device)
            padding = (cols < kv_lens.unsqueeze(1)).view(len(decode_rows), 1, 1, max_kv)
            decode = _DecodeGroup(token_index, slots.reshape(-1), max_kv, padding)

        appends = []
        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens, strict=True)):
            if q_len == 1:
                continue
            start = int(meta.qo_indptr[i])
            kv_positions = torch.arange(kv_len, device=device)
            slots = _slots_of(meta, torch.full_like(kv_positions, i), kv_positions, page_size)
            mask = None
            if q_len != kv_len:
                offset = kv_len - q_len
                mask = kv_positions.unsqueeze(0) <= (torch.arange(q_len, device=device).unsqueeze(1) + offset)
            appends.append(_AppendRow(slice(start, start + q_len), slots, mask))
        self._plan = _Plan(write_slots, decode, tuple(appends))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() must run before forward()"
        keys = self.kv_pool.keys(layer).view(-1, self.num_kv_heads, self.head_dim)
        values = self.kv_pool.values(layer).view(-1, self.num_kv_heads, self.head_dim)
        keys.index_copy_(0, plan.write_slots, k)
        values.index_copy_(0, plan.write_slots, v)

        out = torch.empty_like(q)
        if plan.decode is not None:
            group = plan.decode
            rows = group.token_index.shape[0]
            # One query token per row: the query heads sharing a KV head become that head's "query
            # length", so K/V are read once per KV head and never repeated for GQA.
            query = q[group.token_index].view(rows, self.num_kv_heads, -1, self.head_dim)
            shape = (rows, group.max_kv, self.num_kv_heads, self.head_dim)
            key = keys.index_select(0, group.kv_slots).view(shape).transpose(1, 2)
            value = values.index_select(0, group.kv_slots).view(shape).transpose(1, 2)
            attended = F.scaled_dot_product_attention(query, key, value, attn_mask=group.mask)
            out[group.token_index] = attended.reshape(rows, self.num_heads, self.head_dim)
        for row in plan.appends:
            query = q[row.tokens].transpose(0, 1)  # [heads, q_len, dim]
            key = keys.index_select(0, row.kv_slots).transpose(0, 1)
            value = values.index_select(0, row.kv_slots).transpose(0, 1)
            attended = F.scaled_dot_product_attention(
                query, key, value, attn_mask=row.mask, is_causal=row.mask is None, enable_gqa=True
            )
            out[row.tokens] = attended.transpose(0, 1)
        return out
