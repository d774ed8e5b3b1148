"""Reference attention in plain torch, over a head-major paged pool; the CPU default.

Each layer's K (and V) is [kv_heads, num_pages * page_size, dim]. A row whose pages are
consecutive reads its keys as a view of the pool, one contiguous matrix per head, with no copy:
the page allocator keeps sessions contiguous where it can, and decode attention then costs one
read of the session's KV. A long row of few query tokens whose pages form a few runs (a shared
prefix's pages, then the session's own: worker/engine/memory/prefix_cache.py) reads each run as a
view too: its scores are computed run by run into one row, and its output is the sum of each run's
share. Other rows on scattered pages gather their slots first (correct, slower).

Short rows (decode, micro-turn appends) run as two matmuls with the query heads of a KV head
folded into the query axis, so GQA never repeats K/V and strided views are read in place; long
appends (restores, re-prefills) run SDPA, whose kernels bound the score memory. Both apply the
bottom-right-aligned causal mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionBackend, AttentionMetadata

# Rows with at most this many query tokens take the folded-matmul path; its scores are
# [kv_heads, group * q_len, kv_len], small for micro-turns at any context length.
FOLDED_MAX_QUERY = 64
# A folded row of at least VIEW_RUNS_MIN_KV positions whose pages form at most MAX_VIEW_RUNS runs
# of consecutive pages reads them as views. Shorter rows gather: a short gather costs little, and
# a gathered row computes bit for bit what a contiguous one does (summing run by run does not).
MAX_VIEW_RUNS = 4
VIEW_RUNS_MIN_KV = 512


@dataclass(frozen=True)
class _Row:
    first_token: int  # index of the row's first query token in the step
    q_len: int
    # The row's KV slots: contiguous slices of the pool in position order, or gathered slot ids.
    kv: tuple[slice, ...] | torch.Tensor
    # Folded rows: [group * q_len, kv_len] True where a key is hidden (None for one query token).
    # SDPA rows: [q_len, kv_len] True where a key is visible (None when plain causal, q == kv).
    mask: torch.Tensor | None


@dataclass(frozen=True)
class _Plan:
    write_slots: torch.Tensor  # [tokens] pool slot of every new token
    rows: tuple[_Row, ...]


class TorchAttention(AttentionBackend):
    name = "torch"
    kv_layout = "head_major"

    _plan: _Plan | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        # Everything is decided on the host from the page tables; the slot ids go to the device
        # in one copy at the end. Nothing here reads a device tensor back.
        device = self.kv_pool.device
        page_size = self.kv_pool.page_size
        page_ids = meta.kv_page_indices.to(torch.int64)
        page_bounds = meta.kv_page_indptr.tolist()
        all_pages = meta.kv_page_indices.tolist()
        row_of_token = torch.repeat_interleave(
            torch.arange(meta.num_rows), torch.tensor(meta.q_lens, dtype=torch.int64)
        )
        token_pages = page_ids[
            meta.kv_page_indptr.to(torch.int64)[row_of_token]
            + torch.div(meta.positions, page_size, rounding_mode="floor")
        ]
        slot_ids = [token_pages * page_size + meta.positions % page_size]  # the write slots first
        slot_count = len(meta.positions)

        # Per row: slices of the pool when its pages are consecutive (or, for a folded row, a few
        # runs of consecutive pages), else where its gathered slot ids sit in the one device copy
        # (start, length).
        row_kv: list[tuple[slice, ...] | tuple[int, int]] = []
        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens, strict=True)):
            pages = all_pages[page_bounds[i] : page_bounds[i + 1]]
            viewed = q_len <= FOLDED_MAX_QUERY and kv_len >= VIEW_RUNS_MIN_KV
            runs = _runs(pages, kv_len, page_size, MAX_VIEW_RUNS if viewed else 1)
            if runs is not None:
                row_kv.append(runs)
            else:
                kv_positions = torch.arange(kv_len)
                row_pages = page_ids[page_bounds[i] : page_bounds[i + 1]]
                slot_ids.append(
                    row_pages[torch.div(kv_positions, page_size, rounding_mode="floor")] * page_size
                    + kv_positions % page_size
                )
                row_kv.append((slot_count, kv_len))
                slot_count += kv_len
        on_device = torch.cat(slot_ids).to(device)

        rows = []
        row_starts = meta.qo_indptr[:-1].tolist()
        for first_token, q_len, kv_len, kv in zip(row_starts, meta.q_lens, meta.kv_lens, row_kv, strict=True):
            slots = kv if isinstance(kv[0], slice) else on_device[kv[0] : kv[0] + kv[1]]
            rows.append(_Row(first_token, q_len, slots, self._mask(q_len, kv_len, device)))
        self._plan = _Plan(on_device[: len(meta.positions)], tuple(rows))

    def _mask(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
        """The row's bottom-right-aligned causal mask, built on the device (see `_Row.mask`)."""
        if q_len == 1:
            return None
        queries = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
        visible = torch.arange(kv_len, device=device).unsqueeze(0) <= queries
        if q_len <= FOLDED_MAX_QUERY:
            return ~visible.repeat(self.num_heads // self.num_kv_heads, 1)
        return visible if q_len < kv_len else None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() must run before forward()"
        keys = self.kv_pool.keys(layer)  # [kv_heads, slots, dim]
        values = self.kv_pool.values(layer)
        keys.index_copy_(1, plan.write_slots, k.transpose(0, 1))
        values.index_copy_(1, plan.write_slots, v.transpose(0, 1))

        out = torch.empty_like(q)
        for row in plan.rows:
            tokens = slice(row.first_token, row.first_token + row.q_len)
            if isinstance(row.kv, tuple) and len(row.kv) > 1:
                runs = [(keys[:, run], values[:, run]) for run in row.kv]
                out[tokens] = self._folded_runs(q[tokens], runs, row.mask)
                continue
            if isinstance(row.kv, tuple):
                key, value = keys[:, row.kv[0]], values[:, row.kv[0]]
            else:
                key, value = keys.index_select(1, row.kv), values.index_select(1, row.kv)
            if row.q_len <= FOLDED_MAX_QUERY:
                out[tokens] = self._folded(q[tokens], key, value, row.mask)
            else:
                attended = F.scaled_dot_product_attention(
                    q[tokens].transpose(0, 1),
                    key,
                    value,
                    attn_mask=row.mask,
                    is_causal=row.mask is None,
                    enable_gqa=True,
                )
                out[tokens] = attended.transpose(0, 1)
        return out

    def _folded(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """query [q, heads, dim] against key/value [kv_heads, kv, dim] -> [q, heads, dim]."""
        return self._folded_runs(query, [(key, value)], hidden)

    def _folded_runs(
        self,
        query: torch.Tensor,
        runs: list[tuple[torch.Tensor, torch.Tensor]],
        hidden: torch.Tensor | None,
    ) -> torch.Tensor:
        """query [q, heads, dim] against the keys/values [kv_heads, run, dim] of consecutive runs of
        positions -> [q, heads, dim]. One softmax over all the runs' scores; no K/V is copied."""
        q_len = query.shape[0]
        group = self.num_heads // self.num_kv_heads
        # [q, kv_heads, group, dim] -> [kv_heads, group * q, dim]: rows ordered (group, query).
        folded = query.view(q_len, self.num_kv_heads, group, self.head_dim).permute(1, 2, 0, 3)
        folded = folded.reshape(self.num_kv_heads, group * q_len, self.head_dim)
        parts = [torch.matmul(folded, key.transpose(1, 2)) for key, _ in runs]
        scores = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).mul_(
            1.0 / math.sqrt(self.head_dim)
        )
        if hidden is not None:
            scores.masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        if len(runs) == 1:
            attended = torch.matmul(weights, runs[0][1])
        else:
            bounds = [0]
            for _, value in runs:
                bounds.append(bounds[-1] + value.shape[1])
            attended = torch.matmul(weights[..., bounds[0] : bounds[1]], runs[0][1])
            for i, (_, value) in enumerate(runs[1:], start=1):
                attended.add_(torch.matmul(weights[..., bounds[i] : bounds[i + 1]], value))
        attended = attended.view(self.num_kv_heads, group, q_len, self.head_dim).permute(2, 0, 1, 3)
        return attended.reshape(q_len, self.num_heads, self.head_dim)


def _runs(pages: list[int], kv_len: int, page_size: int, most: int) -> tuple[slice, ...] | None:
    """The pool slices of a row's first `kv_len` positions on `pages`, one per run of consecutive
    pages; None when they form more than `most` runs."""
    runs: list[slice] = []
    start = 0  # the first page of the current run, as an index into `pages`
    for i in range(1, len(pages) + 1):
        if i < len(pages) and pages[i] == pages[i - 1] + 1:
            continue
        if len(runs) == most:
            return None
        first = pages[start] * page_size
        length = min(i * page_size, kv_len) - start * page_size
        runs.append(slice(first, first + length))
        start = i
    return tuple(runs)
