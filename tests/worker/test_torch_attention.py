"""The torch backend on contiguous and on scattered page tables, against dense attention."""

from __future__ import annotations

import math

import pytest
import torch

from worker.attention import AttentionMetadata, TorchAttention, torch_backend
from worker.attention.kv_pool import KVPool

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 16, 4
# (tokens already in the session, tokens fed this step): decode rows, short appends (the folded
# path) and long ones (SDPA; a fresh prefill and an append onto history), crossing pages.
ROWS = [(9, 1), (0, 7), (13, 5), (3, 1), (6, 6), (0, 70), (5, 70)]
PAGES_PER_ROW = 20
POOL_PAGES = 2 * len(ROWS) * PAGES_PER_ROW  # room for contiguous and scattered tables apart


def metadata(tables: list[list[int]], rows: list[tuple[int, int]]) -> AttentionMetadata:
    q_lens = tuple(n for _, n in rows)
    kv_lens = tuple(start + n for start, n in rows)
    used = [table[: -(-kv // PAGE)] for table, kv in zip(tables, kv_lens, strict=True)]
    indptr = [0]
    for pages in used:
        indptr.append(indptr[-1] + len(pages))
    return AttentionMetadata(
        qo_indptr=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        kv_page_indptr=torch.tensor(indptr, dtype=torch.int32),
        kv_page_indices=torch.tensor([p for pages in used for p in pages], dtype=torch.int32),
        kv_last_page_len=torch.tensor(
            [kv - (len(p) - 1) * PAGE for kv, p in zip(kv_lens, used, strict=True)]
        ),
        positions=torch.tensor([p for start, n in rows for p in range(start, start + n)]),
        q_lens=q_lens,
        kv_lens=kv_lens,
    )


def make_attention(device: torch.device, dtype: torch.dtype) -> TorchAttention:
    pool = KVPool(
        num_layers=1,
        num_pages=POOL_PAGES,
        page_size=PAGE,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        dtype=dtype,
        device=device,
        layout=TorchAttention.kv_layout,
    )
    return TorchAttention(pool, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)


def run(tables: list[list[int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    attention = make_attention(torch.device("cpu"), torch.float64)
    history = [(0, start) for start, _ in ROWS]
    hist_rows = [r for r in history if r[1] > 0]
    hist_tables = [t for t, r in zip(tables, history, strict=True) if r[1] > 0]
    hist_k = torch.cat([k[i][:start] for i, (start, _) in enumerate(ROWS) if start > 0])
    hist_v = torch.cat([v[i][:start] for i, (start, _) in enumerate(ROWS) if start > 0])
    attention.plan(metadata(hist_tables, hist_rows))
    attention.forward(0, torch.zeros(len(hist_k), HEADS, DIM, dtype=torch.float64), hist_k, hist_v)
    attention.plan(metadata(tables, ROWS))
    new_k = torch.cat([k[i][start : start + n] for i, (start, n) in enumerate(ROWS)])
    new_v = torch.cat([v[i][start : start + n] for i, (start, n) in enumerate(ROWS)])
    return attention.forward(0, q, new_k, new_v)


def dense(q: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
    outputs, token = [], 0
    for i, (start, n) in enumerate(ROWS):
        keys = k[i][: start + n].repeat_interleave(HEADS // KV_HEADS, dim=1)
        values = v[i][: start + n].repeat_interleave(HEADS // KV_HEADS, dim=1)
        for j in range(n):
            query = q[token + j]
            scores = torch.einsum("hd,khd->hk", query, keys[: start + j + 1]) / math.sqrt(DIM)
            outputs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values[: start + j + 1]))
        token += n
    return torch.stack(outputs)


def page_tables(layout: str) -> list[list[int]]:
    """Every row's page table: consecutive pages, scattered ones, a mix of both, or two runs."""
    n = len(ROWS)
    contiguous = [list(range(PAGES_PER_ROW * i, PAGES_PER_ROW * (i + 1))) for i in range(n)]
    # Out of order and interleaved with the other rows' pages.
    scattered = [[POOL_PAGES - 1 - n * j - i for j in range(PAGES_PER_ROW)] for i in range(n)]
    if layout == "contiguous":
        return contiguous
    if layout == "scattered":
        return scattered
    if layout == "runs":
        # A shared prefix's pages, then the session's own elsewhere: two runs, each read as a view.
        return [pages[:3] + pages[4:] for pages in contiguous]
    mixed = [contiguous[i] if i % 2 == 0 else scattered[i] for i in range(n)]
    # Consecutive but for one page in the middle of the pages row 2 reads: gathered, not sliced.
    mixed[2][2] = scattered[2][2]
    return mixed


@pytest.fixture(autouse=True)
def views_for_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """These rows are short: read runs of pages as views at any length, as long rows do."""
    monkeypatch.setattr(torch_backend, "VIEW_RUNS_MIN_KV", 0)


@pytest.mark.parametrize("layout", ["contiguous", "scattered", "mixed", "runs"])
def test_ragged_step_matches_dense_attention(layout: str) -> None:
    generator = torch.Generator().manual_seed(0)
    k = [torch.randn(start + n, KV_HEADS, DIM, generator=generator, dtype=torch.float64) for start, n in ROWS]
    v = [torch.randn(start + n, KV_HEADS, DIM, generator=generator, dtype=torch.float64) for start, n in ROWS]
    q = torch.randn(sum(n for _, n in ROWS), HEADS, DIM, generator=generator, dtype=torch.float64)
    assert torch.allclose(run(page_tables(layout), q, k, v), dense(q, k, v), atol=1e-10)


@pytest.mark.parametrize("layout", ["contiguous", "mixed", "runs"])
def test_a_step_reads_nothing_back_from_the_device(layout: str) -> None:
    """Plan and forward on the `meta` device, whose tensors hold no data: any read of a device
    tensor to decide something on the host (a sync on CUDA) raises there."""
    meta_device = torch.device("meta")
    attention = make_attention(meta_device, torch.float32)
    step = metadata(page_tables(layout), ROWS)  # on the host, as the model runner builds it
    tokens = sum(n for _, n in ROWS)
    attention.plan(step)
    out = attention.forward(
        0,
        torch.empty(tokens, HEADS, DIM, device=meta_device),
        torch.empty(tokens, KV_HEADS, DIM, device=meta_device),
        torch.empty(tokens, KV_HEADS, DIM, device=meta_device),
    )
    assert out.shape == (tokens, HEADS, DIM)
    assert out.device == meta_device
