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
memory; each block reads the keys up to its last query only. Every product writes into a block's
buffers (`_Work`); a one-token row's are allocated once per step and reused by all layers (a decode
step is dozens of small ops per layer, and their allocations and views were a good part of its
cost), shared by the step's one-token rows of as many tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
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


# A one-token row's buffers are allocated once per step and reused by every layer (and by the
# step's other one-token rows of as many tiles) up to this many positions; longer rows, and rows of
# several tokens, allocate theirs per layer.
WORKSPACE_MAX_KV = 8192


@dataclass(frozen=True)
class _Work:
    """The buffers of one block's attention: every product writes into them (`_attend`)."""

    queries: torch.Tensor  # [kv_heads, products, dim]: folded queries, zero rows past them
    scores: torch.Tensor  # [kv_heads, products, width]: -inf past the keys
    terms: torch.Tensor  # [kv_heads, tiles, products, KV_TILE]: the softmax's terms, tile-major
    values: torch.Tensor  # [kv_heads, width, dim]: the row's values, zeros past them
    weighted: torch.Tensor  # [kv_heads * tiles, products, dim]: every tile's weighted values
    folds: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (into, from) views of `weighted`, in order

    @classmethod
    def new(
        cls, kv_heads: int, products: int, tiles: int, dim: int, like: torch.Tensor, *, filled: bool
    ) -> _Work:
        """`filled`: -inf scores and zero values throughout; else only the queries' padding is
        zero, and the user fills the rest past its keys."""
        width = tiles * KV_TILE
        weighted = like.new_empty(kv_heads * tiles, products, dim)
        by_tile = weighted.view(kv_heads, tiles, products, dim)
        # The tiles at and above the largest power of two below their count fold onto those below.
        folds = []
        count = tiles
        while count > 1:
            half = 1 << (count - 1).bit_length() - 1
            folds.append((by_tile.narrow(1, 0, count - half), by_tile.narrow(1, half, count - half)))
            count = half
        return cls(
            queries=like.new_zeros(kv_heads, products, dim),
            scores=like.new_full((kv_heads, products, width), float("-inf"))
            if filled
            else like.new_empty(kv_heads, products, width),
            terms=like.new_empty(kv_heads, tiles, products, KV_TILE),
            values=like.new_zeros(kv_heads, width, dim) if filled else like.new_empty(kv_heads, width, dim),
            weighted=weighted,
            folds=tuple(folds),
        )


@dataclass(frozen=True)
class _Block:
    first_token: int  # index of the block's first query token in the step
    q_len: int
    kv_len: int  # the keys the block's last query sees
    # [group * q_len, kv_len] -inf where a key is hidden, else 0: added to the scores, which is
    # many times faster than a masked fill (None for one query token).
    hidden: torch.Tensor | None
    # The step's buffers for this block (one-token rows), else None: allocated per layer.
    work: _Work | None = None
    # Whether another block sharing `work` has more keys: this one then restores the -inf scores
    # and zero values past its own keys before it runs.
    shared_tail: bool = False


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

    @classmethod
    def unavailable(cls, shape: AttentionShape) -> str | None:
        if shape.int8_keys:
            return "it reads keys and values as floats; the int8 forms are the cpu attention kernel's"
        return None

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

        # One-token rows of as many tiles share one set of buffers for the whole step.
        works: dict[int, _Work] = {}
        longest: dict[int, int] = {}
        for q_len, kv_len in zip(meta.q_lens, meta.kv_lens, strict=True):
            tiles = -(-kv_len // KV_TILE)
            if q_len == 1 and kv_len <= WORKSPACE_MAX_KV:
                longest[tiles] = max(longest.get(tiles, 0), kv_len)
                if tiles not in works:
                    works[tiles] = self._work(1, tiles, filled=True)
        rows = []
        row_starts = meta.qo_indptr[:-1].tolist()
        for first_token, q_len, kv_len, kv in zip(row_starts, meta.q_lens, meta.kv_lens, row_kv, strict=True):
            slots = kv if isinstance(kv[0], slice) else on_device[kv[0] : kv[0] + kv[1]]
            blocks = []
            for offset in range(0, q_len, QUERY_BLOCK):
                block_len = min(QUERY_BLOCK, q_len - offset)
                block_kv = kv_len - q_len + offset + block_len
                hidden = self._hidden(block_len, block_kv, device)
                tiles = -(-block_kv // KV_TILE)
                work = works.get(tiles) if block_len == 1 and block_kv <= WORKSPACE_MAX_KV else None
                shared_tail = work is not None and longest[tiles] > block_kv
                blocks.append(_Block(first_token + offset, block_len, block_kv, hidden, work, shared_tail))
            rows.append(_Row(slots, tuple(blocks)))
        self._plan = _Plan(on_device[: len(meta.positions)], tuple(rows))

    def _work(self, q_len: int, tiles: int, *, filled: bool) -> _Work:
        products = max(self.num_heads // self.num_kv_heads * q_len, MIN_ROWS)
        like = torch.empty((), dtype=self.dtype, device=self.kv_pool.device)  # computed in the model's dtype
        return _Work.new(self.num_kv_heads, products, tiles, self.head_dim, like, filled=filled)

    def _hidden(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
        """A block's bottom-right-aligned causal mask over its folded rows (see `_Block.hidden`)."""
        if q_len == 1:
            return None
        queries = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
        hidden = torch.arange(kv_len, device=device).unsqueeze(0) > queries
        bias = torch.zeros(hidden.shape, dtype=self.dtype, device=device)
        return bias.masked_fill_(hidden, float("-inf")).repeat(self.num_heads // self.num_kv_heads, 1)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() must run before forward()"
        keys = self.kv_pool.keys(layer)  # [kv_heads, slots, dim]
        values = self.kv_pool.values(layer)
        # A narrower pool (float16 keys and values under float32 queries) takes them rounded to nearest
        # even, as the cpu kernel writes them: either backend's pages are the same bytes.
        keys.index_copy_(1, plan.write_slots, k.transpose(0, 1).to(keys.dtype))
        values.index_copy_(1, plan.write_slots, v.transpose(0, 1).to(values.dtype))

        out = torch.empty_like(q)
        for row in plan.rows:
            if isinstance(row.kv, tuple):
                row_keys = [keys[:, run] for run in row.kv]
                row_values = [values[:, run] for run in row.kv]
            else:
                row_keys = [keys.index_select(1, row.kv)]
                row_values = [values.index_select(1, row.kv)]
            for block in row.blocks:
                self._attend(
                    q.narrow(0, block.first_token, block.q_len),
                    _prefix(row_keys, block.kv_len),
                    _prefix(row_values, block.kv_len),
                    block,
                    out.narrow(0, block.first_token, block.q_len),
                )
        return out

    def _attend(
        self,
        query: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        block: _Block,
        out: torch.Tensor,
    ) -> None:
        """query [q, heads, dim] against the keys/values [kv_heads, run, dim] of consecutive runs of
        positions (every run but the last whole tiles) -> out [q, heads, dim]."""
        q_len, kv_len = block.q_len, block.kv_len
        kv_heads, dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        rows = group * q_len
        tiles = -(-kv_len // KV_TILE)
        width = tiles * KV_TILE
        work = block.work or self._work(q_len, tiles, filled=False)
        # Whether the buffers past this block's keys must be set (-inf scores, zero values) first.
        tail = kv_len < width and (block.work is None or block.shared_tail)
        products = work.queries.shape[1]
        # [q, kv_heads, group, dim] -> [kv_heads, group * q, dim]: rows ordered (group, query), then
        # zero queries up to MIN_ROWS (worker/numerics.py: fewer rows take other BLAS kernels).
        work.queries.narrow(1, 0, rows).view(kv_heads, group, q_len, dim).copy_(
            query.view(q_len, kv_heads, group, dim).permute(1, 2, 0, 3)
        )
        key = keys[0] if len(keys) == 1 else torch.cat(keys, dim=1)
        key = key.to(self.dtype)  # a narrower pool's keys, exactly (no-op: a pool of the model's dtype)
        columns = kv_len
        if kv_len < MIN_COLUMNS:  # a session's first positions: padded keys, so the same kernels run
            key = torch.constant_pad_nd(key, (0, 0, 0, MIN_COLUMNS - kv_len))
            columns = MIN_COLUMNS
        # Scores [kv_heads, products, width]: one dot product of `dim` values each, -inf past the keys.
        scores = work.scores
        torch.matmul(work.queries, key.transpose(1, 2), out=scores.narrow(2, 0, columns))
        if columns > kv_len or tail:
            scores.narrow(2, kv_len, width - kv_len).fill_(float("-inf"))
        scores.mul_(1.0 / math.sqrt(dim))
        if block.hidden is not None:
            scores.narrow(1, 0, rows).narrow(2, 0, kv_len).add_(block.hidden)  # x + 0 == x
        # The softmax's terms, tile-major for the product below: a masked or absent key's is exactly 0.
        # exp writes straight into the tile-major buffer, one contiguous run of one tile's 64 terms
        # at a time. Not in place over the whole scores: that is one run of any length (torch's
        # vectorised exp, likely MKL's vector math, may split it between threads), and it made a
        # row's terms differ on 2 threads (test_chunking_invariance), though it is twice as fast.
        scores.sub_(scores.amax(dim=-1, keepdim=True))
        by_query = work.terms.permute(0, 2, 1, 3)  # [kv_heads, products, tiles, KV_TILE]
        torch.exp(scores.view(kv_heads, products, tiles, KV_TILE), out=by_query)
        total = by_query.sum(dim=-1).cumsum(dim=-1).narrow(-1, tiles - 1, 1)  # [kv_heads, products, 1]

        # Every tile's weighted values in one batched product of one shape per tile, against the
        # values padded with zeros to whole tiles: [kv_heads, tiles, products, dim]. Then the tiles
        # are summed by folding the tiles at and above the largest power of two below their count
        # onto those below, in place, until one is left. A query's tiles come first and every tile
        # after them is all zeros (masked or absent), so a longer history's first folds add exactly
        # 0 to them and its later folds are the ones a shorter history makes: the sum is the same
        # whichever way the history was chunked.
        start = 0
        for run in values:
            length = run.shape[1]
            work.values.narrow(1, start, length).copy_(run)
            start += length
        if tail:
            work.values.narrow(1, kv_len, width - kv_len).zero_()
        torch.bmm(
            work.terms.view(kv_heads * tiles, products, KV_TILE),
            work.values.view(kv_heads * tiles, KV_TILE, dim),
            out=work.weighted,
        )
        for into, addend in work.folds:
            into.add_(addend)
        first = work.weighted.view(kv_heads, tiles, products, dim).select(1, 0)
        torch.div(
            first.narrow(1, 0, rows).view(kv_heads, group, q_len, dim).permute(2, 0, 1, 3),
            total.narrow(1, 0, rows).view(kv_heads, group, q_len, 1).permute(2, 0, 1, 3),
            out=out.view(q_len, kv_heads, group, dim),
        )


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
