"""Reference attention in plain torch, over a head-major paged pool; the CPU default.

Each layer's K (and V) is [kv_heads, num_pages * page_size, dim]. A row whose pages are
consecutive reads its keys as a view of the pool, one contiguous matrix per head, with no copy:
the page allocator keeps sessions contiguous where it can, and decode attention then costs one
read of the session's KV. A long row of few query tokens whose pages form a few runs (a shared
prefix's pages, then the session's own: worker/engine/memory/prefix_cache.py) reads each run as a
view too, when every run but the last holds whole KV tiles (below). Other rows gather their slots
first (correct, slower).

Every row, whatever its length, takes one path, built so that a query's output does not depend on
how its session's tokens were split into steps nor on the rows beside it (the engine's promise:
streamed in micro-turns = sent whole, alone = batched, bit for bit):
- scores: the query heads of a KV head are folded into the query axis and multiplied by the keys in
  one matmul (GQA never repeats K/V); a score is one dot product of `head_dim` values, which BLAS
  sums in one order whatever the matrix sizes as long as the product has at least MIN_ROWS rows and
  MIN_COLUMNS columns (worker/numerics.py): fewer folded queries are padded with zero queries, and
  a session's first keys with zero keys, whose scores are then set to -inf;
- the softmax's max is exact in any order; its sum and the weighted sum of values are taken in
  fixed tiles of KV_TILE positions aligned to position 0 (one batched matmul, of one shape per tile,
  over every tile and KV head, against the values padded with zeros to whole tiles); the tiles'
  weighted values are summed in one fixed tree over tile indices (`_attend`), their softmax sums by
  one cumulative sum. A query sees the same tiles with the same values whether the keys after it
  are absent (a chunk) or masked (the whole history): a masked key's weight is exactly 0, and so
  is a padded one's.
Long rows (re-prefills, restores) run in blocks of QUERY_BLOCK queries, which bounds the scores'
memory; each block reads the keys up to its last query only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata
from worker.numerics import MIN_COLUMNS, MIN_ROWS

# Queries of a row computed together: the scores of a block are [kv_heads, group * block, kv_len].
QUERY_BLOCK = 64
# The positions whose softmax terms and weighted values one matmul sums; tiles are summed in a fixed tree.
KV_TILE = 64
# A row of at least VIEW_RUNS_MIN_KV positions whose pages form at most MAX_VIEW_RUNS runs of
# consecutive pages reads them as views (when every run but the last is whole tiles). Shorter rows
# gather: a short gather costs little.
MAX_VIEW_RUNS = 4
VIEW_RUNS_MIN_KV = 512


@dataclass(frozen=True)
class _Block:
    first_token: int  # index of the block's first query token in the step
    q_len: int
    kv_len: int  # the keys the block's last query sees
    # [group * q_len, kv_len] True where a key is hidden (None for one query token).
    hidden: torch.Tensor | None


@dataclass(frozen=True)
class _Row:
    # The row's KV slots: contiguous slices of the pool in position order (every one but the last
    # a whole number of tiles), or gathered slot ids.
    kv: tuple[slice, ...] | torch.Tensor
    blocks: tuple[_Block, ...]


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

        # Per row: slices of the pool when its pages are consecutive (or, for a long row, a few
        # runs of consecutive pages), else where its gathered slot ids sit in the one device copy
        # (start, length).
        row_kv: list[tuple[slice, ...] | tuple[int, int]] = []
        for i, kv_len in enumerate(meta.kv_lens):
            pages = all_pages[page_bounds[i] : page_bounds[i + 1]]
            most = MAX_VIEW_RUNS if kv_len >= VIEW_RUNS_MIN_KV else 1
            runs = _runs(pages, kv_len, page_size, most)
            if runs is not None and all((run.stop - run.start) % KV_TILE == 0 for run in runs[:-1]):
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
            blocks = []
            for offset in range(0, q_len, QUERY_BLOCK):
                block_len = min(QUERY_BLOCK, q_len - offset)
                block_kv = kv_len - q_len + offset + block_len
                hidden = self._hidden(block_len, block_kv, device)
                blocks.append(_Block(first_token + offset, block_len, block_kv, hidden))
            rows.append(_Row(slots, tuple(blocks)))
        self._plan = _Plan(on_device[: len(meta.positions)], tuple(rows))

    def _hidden(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
        """A block's bottom-right-aligned causal mask over its folded rows (see `_Block.hidden`)."""
        if q_len == 1:
            return None
        queries = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
        hidden = torch.arange(kv_len, device=device).unsqueeze(0) > queries
        return hidden.repeat(self.num_heads // self.num_kv_heads, 1)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() must run before forward()"
        keys = self.kv_pool.keys(layer)  # [kv_heads, slots, dim]
        values = self.kv_pool.values(layer)
        keys.index_copy_(1, plan.write_slots, k.transpose(0, 1))
        values.index_copy_(1, plan.write_slots, v.transpose(0, 1))

        out = torch.empty_like(q)
        for row in plan.rows:
            if isinstance(row.kv, tuple):
                row_keys = [keys[:, run] for run in row.kv]
                row_values = [values[:, run] for run in row.kv]
            else:
                row_keys = [keys.index_select(1, row.kv)]
                row_values = [values.index_select(1, row.kv)]
            for block in row.blocks:
                tokens = slice(block.first_token, block.first_token + block.q_len)
                out[tokens] = self._attend(
                    q[tokens],
                    _prefix(row_keys, block.kv_len),
                    _prefix(row_values, block.kv_len),
                    block.hidden,
                )
        return out

    def _attend(
        self,
        query: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        hidden: torch.Tensor | None,
    ) -> torch.Tensor:
        """query [q, heads, dim] against the keys/values [kv_heads, run, dim] of consecutive runs of
        positions (every run but the last whole tiles) -> [q, heads, dim]."""
        q_len = query.shape[0]
        kv_heads, dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        rows = group * q_len
        # [q, kv_heads, group, dim] -> [kv_heads, group * q, dim]: rows ordered (group, query), padded
        # with zero queries to MIN_ROWS (worker/numerics.py: fewer rows take other BLAS kernels).
        folded = query.view(q_len, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, rows, dim)
        if rows < MIN_ROWS:
            folded = torch.constant_pad_nd(folded, (0, 0, 0, MIN_ROWS - rows))
        products = folded.shape[1]
        key = keys[0] if len(keys) == 1 else torch.cat(keys, dim=1)
        kv_len = key.shape[1]
        tiles = -(-kv_len // KV_TILE)
        width = tiles * KV_TILE
        if kv_len < MIN_COLUMNS:  # a session's first positions: padded keys, so the same kernels run
            key = torch.constant_pad_nd(key, (0, 0, 0, MIN_COLUMNS - kv_len))
        # Scores [kv_heads, products, width]: one dot product of `dim` values each, -inf past the keys.
        scores = torch.matmul(folded, key.transpose(1, 2)).mul_(1.0 / math.sqrt(dim))
        if scores.shape[-1] < width:
            scores = torch.constant_pad_nd(scores, (0, width - scores.shape[-1]), float("-inf"))
        elif kv_len < width:
            scores.narrow(-1, kv_len, width - kv_len).fill_(float("-inf"))
        if hidden is not None:
            scores.narrow(1, 0, rows).narrow(-1, 0, kv_len).masked_fill_(hidden, float("-inf"))
        # The softmax's terms: a masked or absent key's is exactly 0.
        terms = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_().view(kv_heads, products, tiles, KV_TILE)
        total = terms.sum(dim=-1).cumsum(dim=-1).narrow(-1, tiles - 1, 1)  # [kv_heads, products, 1]

        # Every tile's weighted values in one batched product of one shape per tile, against the
        # values padded with zeros to whole tiles: [kv_heads, tiles, products, dim]. Then the tiles
        # are summed by folding the tiles at and above the largest power of two below their count
        # onto those below, in place, until one is left. A query's tiles come first and every tile
        # after them is all zeros (masked or absent), so a longer history's first folds add exactly
        # 0 to them and its later folds are the ones a shorter history makes: the sum is the same
        # whichever way the history was chunked.
        value = values[0] if len(values) == 1 else torch.cat(values, dim=1)
        value = torch.constant_pad_nd(value, (0, 0, 0, width - kv_len))
        weighted = torch.bmm(
            terms.transpose(1, 2).reshape(kv_heads * tiles, products, KV_TILE),
            value.reshape(kv_heads * tiles, KV_TILE, dim),
        ).view(kv_heads, tiles, products, dim)
        count = tiles
        while count > 1:
            half = 1 << (count - 1).bit_length() - 1
            weighted.narrow(1, 0, count - half).add_(weighted.narrow(1, half, count - half))
            count = half
        attended = weighted.select(1, 0).div_(total).narrow(1, 0, rows)
        attended = attended.view(kv_heads, group, q_len, dim).permute(2, 0, 1, 3)
        return attended.reshape(q_len, self.num_heads, dim)


def _prefix(runs: list[torch.Tensor], length: int) -> list[torch.Tensor]:
    """The first `length` positions of consecutive runs [kv_heads, run, dim]."""
    taken: list[torch.Tensor] = []
    for run in runs:
        if length <= 0:
            break
        taken.append(run[:, :length])
        length -= run.shape[1]
    return taken


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
