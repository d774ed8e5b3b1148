"""The CPU attention kernel (worker/attention/cpu_kernel.c): dense attention's numbers on ragged,
paged batches, the same bits however a history was chunked or batched, and refusals that touch
nothing."""

from __future__ import annotations

import math
import platform
from pathlib import Path

import pytest
import torch

from tests.worker.cpu_kernel import needs_cpu_kernel
from worker.attention import AttentionShape, TorchAttention
from worker.attention.base import paged_metadata
from worker.attention.cpu_backend import KERNEL, UNAVAILABLE_REASON, CpuAttention
from worker.attention.int8_kv import QUERY_LEVELS, read_page, read_value_page, round_rows, through_rounding
from worker.attention.kv_pool import KVPool

CPU = torch.device("cpu")


def make(
    backend: type[CpuAttention] | type[TorchAttention],
    *,
    heads: int,
    kv_heads: int,
    dim: int,
    page: int,
    pages: int = 64,
    kv_dtype: torch.dtype = torch.float32,
    int8_keys: bool = False,
    int8_values: bool = False,
) -> CpuAttention | TorchAttention:
    pool = KVPool(
        num_layers=1,
        num_pages=pages,
        page_size=page,
        num_kv_heads=kv_heads,
        head_dim=dim,
        dtype=torch.float16 if int8_keys else kv_dtype,
        device=CPU,
        layout=backend.kv_layout,
        int8_keys=int8_keys,
        int8_values=int8_values,
    )
    return backend(pool, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32)


def feed(
    attention: CpuAttention | TorchAttention,
    tables: list[list[int]],
    steps: list[list[tuple[int, int]]],
    history: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """Run steps of (row, tokens) pairs over per-row histories (q, k, v); each row's outputs in order."""
    q, k, v = history
    fed = [0] * len(tables)
    outputs: list[list[torch.Tensor]] = [[] for _ in tables]
    for step in steps:
        rows = [row for row, _ in step]
        meta = paged_metadata(
            [fed[row] for row in rows],
            [n for _, n in step],
            [tables[row] for row in rows],
            attention.kv_pool.page_size,
        )
        attention.plan(meta)
        pick = [(row, slice(fed[row], fed[row] + n)) for row, n in step]
        out = attention.forward(
            0,
            torch.cat([q[row][s] for row, s in pick]),
            torch.cat([k[row][s] for row, s in pick]),
            torch.cat([v[row][s] for row, s in pick]),
        )
        for (row, n), part in zip(step, out.split([n for _, n in step]), strict=True):
            outputs[row].append(part)
            fed[row] += n
    return [torch.cat(parts) if parts else torch.empty(0) for parts in outputs]


def first_row(
    steps: list[list[tuple[int, int]]],
    threads: int,
    tables: list[list[int]],
    history: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    *,
    heads: int,
    kv_heads: int,
    page: int,
    kv_dtype: torch.dtype = torch.float32,
    int8_keys: bool = False,
    int8_values: bool = False,
    backend: type[CpuAttention] | None = None,
) -> torch.Tensor:
    """Row 0's outputs over `steps` on a fresh CPU kernel pool, on `threads` intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dim = history[0][0].shape[2]
        attention = make(
            backend or CpuAttention,
            heads=heads,
            kv_heads=kv_heads,
            dim=dim,
            page=page,
            kv_dtype=kv_dtype,
            int8_keys=int8_keys,
            int8_values=int8_values,
        )
        return feed(attention, tables, steps, history)[0]
    finally:
        torch.set_num_threads(before)


def histories(
    lengths: list[int], heads: int, kv_heads: int, dim: int, seed: int = 0
) -> tuple[list[torch.Tensor], ...]:
    generator = torch.Generator().manual_seed(seed)
    q = [torch.randn(n, heads, dim, generator=generator) for n in lengths]
    k = [torch.randn(n, kv_heads, dim, generator=generator) for n in lengths]
    v = [torch.randn(n, kv_heads, dim, generator=generator) for n in lengths]
    return q, k, v


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over one row's whole history, in float64."""
    group = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1)
    values = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) / math.sqrt(q.shape[2])
    hidden = torch.ones(len(q), len(k), dtype=torch.bool).triu(1)
    weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def scattered_tables(rows: int, pages_each: int, pool_pages: int) -> list[list[int]]:
    """Out of order and interleaved with the other rows' pages."""
    return [[pool_pages - 1 - rows * j - i for j in range(pages_each)] for i in range(rows)]


@needs_cpu_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"), [(9, 3, 64, 16), (4, 2, 32, 3), (8, 8, 128, 5)]
)
def test_ragged_paged_steps_match_dense_attention(heads: int, kv_heads: int, dim: int, page: int) -> None:
    lengths = [40, 7, 90]
    q, k, v = histories(lengths, heads, kv_heads, dim)
    pool_pages = 3 * 40
    attention = make(CpuAttention, heads=heads, kv_heads=kv_heads, dim=dim, page=page, pages=pool_pages)
    # A prefill beside a decode row, then appends of odd sizes crossing pages, rows in another order.
    steps = [[(0, 30), (1, 1), (2, 64)], [(2, 1), (0, 1), (1, 6)], [(0, 9), (2, 25)]]
    got = feed(attention, scattered_tables(3, 40, pool_pages), steps, (q, k, v))
    for row in range(3):
        assert torch.allclose(got[row].double(), dense(q[row], k[row], v[row]), atol=2e-6), row


@needs_cpu_kernel
@pytest.mark.parametrize(
    ("kv_dtype", "int8_keys"), [(torch.float32, False), (torch.float16, False), (torch.float16, True)]
)
def test_a_rows_outputs_are_the_same_bits_however_its_history_was_chunked_batched_or_threaded(
    kv_dtype: torch.dtype, int8_keys: bool
) -> None:
    heads, kv_heads, dim, page = 9, 3, 64, 16
    q, k, v = histories([75, 75, 20], heads, kv_heads, dim, seed=1)
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 20))]

    def row_zero(steps: list[list[tuple[int, int]]], threads: int) -> torch.Tensor:
        return first_row(
            steps,
            threads,
            tables,
            (q, k, v),
            heads=heads,
            kv_heads=kv_heads,
            page=page,
            kv_dtype=kv_dtype,
            int8_keys=int8_keys,
        )

    whole = row_zero([[(0, 75)]], 1)
    # Micro-turns of 1, 7 and 33 tokens; beside other rows (a long prefill, decodes); on 2 threads.
    chunked = row_zero([[(0, 1)], [(0, 7)], [(0, 33)], [(0, 1)]] + [[(0, 1)]] * 33, 1)
    batched = row_zero([[(1, 60), (0, 40), (2, 20)], [(1, 15), (0, 35)]], 2)
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, batched)


@needs_cpu_kernel
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 2), (5, 5)])
def test_long_rows_read_in_blocks_keep_the_same_bits_and_dense_attentions_numbers(
    heads: int, kv_heads: int
) -> None:
    """Past a block of keys (64 positions) and a job's run of queries (96 query heads, or 32 where a
    lone append's jobs would not split evenly on 2 threads), a query's output is still its own: the
    same bits as one token at a time, and dense attention's numbers."""
    dim, page = 64, 16
    q, k, v = histories([300, 300], heads, kv_heads, dim, seed=2)
    tables = [list(range(0, 19)), list(range(19, 38))[::-1]]

    def row_zero(steps: list[list[tuple[int, int]]], threads: int) -> torch.Tensor:
        return first_row(steps, threads, tables, (q, k, v), heads=heads, kv_heads=kv_heads, page=page)

    whole = row_zero([[(0, 300)]], 1)
    one_by_one = row_zero([[(0, 1)]] * 300, 1)
    chunked_beside_another = row_zero([[(1, 140), (0, 129)], [(0, 2), (1, 160)], [(0, 169)]], 2)
    lone_append = row_zero([[(0, 284)], [(0, 16)]], 2)
    assert torch.equal(whole, one_by_one)
    assert torch.equal(whole, chunked_beside_another)
    assert torch.equal(whole, lone_append)
    assert torch.allclose(whole.double(), dense(q[0], k[0], v[0]), atol=2e-6)


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(CpuAttention, marks=needs_cpu_kernel, id="cpu"),
        pytest.param(TorchAttention, id="torch"),
    ],
)
def test_a_float16_pool_holds_the_rounded_keys_and_values_and_gives_the_float_pools_bits_on_them(
    backend: type[CpuAttention] | type[TorchAttention],
) -> None:
    """`--kv-dtype float16` (worker/attention/kv_dtype.py): a key or value is rounded once, as it is
    written, and read back exactly, so every output is what the float32 pool gives the rounded
    history, bit for bit, past a key block and across pages out of order."""
    heads, kv_heads, dim = 9, 3, 64
    q, k, v = histories([70, 150, 3], heads, kv_heads, dim, seed=4)
    k[1][7, 1, 3] = 1e-6  # a float16 subnormal
    tables = scattered_tables(3, 12, 40)
    steps = [[(0, 17), (1, 100), (2, 1)], [(0, 1), (1, 50), (2, 2)], [(0, 52)]]
    half = make(backend, heads=heads, kv_heads=kv_heads, dim=dim, page=16, pages=40, kv_dtype=torch.float16)
    full = make(backend, heads=heads, kv_heads=kv_heads, dim=dim, page=16, pages=40)
    rounded = ([t.half().float() for t in k], [t.half().float() for t in v])
    assert not torch.equal(torch.cat(k), torch.cat(rounded[0]))  # the rounding changes the history
    outputs = zip(feed(half, tables, steps, (q, k, v)), feed(full, tables, steps, (q, *rounded)), strict=True)
    for ours, theirs in outputs:
        assert torch.equal(ours, theirs)
    assert torch.equal(half.kv_pool.buffer, full.kv_pool.buffer.half())


@needs_cpu_kernel
def test_the_kernel_and_the_torch_reference_write_the_same_float16_bytes() -> None:
    """A KV copy or a host-tier page means the same bytes under either CPU backend."""
    heads, kv_heads, dim = 4, 2, 32
    q, k, v = histories([40, 9], heads, kv_heads, dim, seed=5)
    k[0][3, 0, 0] = 70000.0  # past float16's range: inf in both
    v[1][2, 1, 4] = -3e-8  # below its smallest subnormal: -0 in both
    tables = scattered_tables(2, 4, 10)
    steps = [[(0, 33), (1, 9)], [(0, 7)]]
    pools = []
    for backend in (CpuAttention, TorchAttention):
        attention = make(
            backend, heads=heads, kv_heads=kv_heads, dim=dim, page=16, pages=10, kv_dtype=torch.float16
        )
        feed(attention, tables, steps, (q, k, v))
        pools.append(attention.kv_pool.buffer.view(torch.int16))
    assert torch.equal(pools[0], pools[1])


class Avx2Attention(CpuAttention):
    """The kernel held to its AVX2 path where the CPU has AVX-512."""

    WIDE = False


@pytest.mark.skipif(KERNEL is None or not KERNEL.wide(), reason="this CPU has no AVX-512 (or no kernel)")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 32), (4, 1, 96), (16, 1, 64), (6, 2, 128)]
)
def test_the_avx512_path_gives_the_avx2_paths_bits(heads: int, kv_heads: int, dim: int) -> None:
    """A session's tokens must not depend on its worker's CPU: one copied between a worker with AVX-512
    and one without continues as it would have on either. Rows past a key block (64), odd groups (score_one)
    and dims that are not a multiple of 64 (the wide values' 32-dim pass)."""
    q, k, v = histories([70, 300, 5], heads, kv_heads, dim, seed=heads)
    tables = scattered_tables(3, 20, 64)
    steps = [[(0, 17), (1, 100), (2, 1)], [(0, 1), (1, 150), (2, 3)], [(0, 52), (1, 50), (2, 1)]]
    forms = (
        (1, torch.float32, False),
        (2, torch.float32, False),
        (2, torch.float16, False),
        (2, torch.float16, True),
    )
    for threads, kv_dtype, int8_keys in forms:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outputs = [
                feed(
                    make(
                        backend,
                        heads=heads,
                        kv_heads=kv_heads,
                        dim=dim,
                        page=16,
                        kv_dtype=kv_dtype,
                        int8_keys=int8_keys,
                    ),
                    tables,
                    steps,
                    (q, k, v),
                )
                for backend in (Avx2Attention, CpuAttention)
            ]
        finally:
            torch.set_num_threads(before)
        for row, (narrow, wide) in enumerate(zip(*outputs, strict=True)):
            assert torch.equal(narrow, wide), (row, threads, kv_dtype, int8_keys)


@needs_cpu_kernel
def test_a_nan_key_costs_no_query_its_independence_from_its_chunking() -> None:
    """A key with a NaN (a broken checkpoint) scores NaN for every query; the softmax's max skips it
    (it must not replace a lane's running max, whose earlier scores would then be lost differently as
    queries pair up differently: a decode scores alone, a chunk's queries in pairs)."""
    heads, kv_heads, dim, page = 9, 3, 64, 16
    q, k, v = histories([40], heads, kv_heads, dim, seed=3)
    q[0][:] = 3 * k[0][0, 0]  # key 0 is every query's largest score, by far
    k[0][4, :, 5] = float("nan")
    tables = [list(range(0, 3))]

    def row_zero(steps: list[list[tuple[int, int]]]) -> torch.Tensor:
        return first_row(steps, 1, tables, (q, k, v), heads=heads, kv_heads=kv_heads, page=page)

    whole = row_zero([[(0, 40)]])
    assert torch.isfinite(whole).all()
    assert torch.equal(whole, row_zero([[(0, 1)]] * 40))


@needs_cpu_kernel
def test_the_kernel_agrees_with_the_torch_reference_as_the_start_up_check_asks() -> None:
    from worker.attention.self_check import compare_with_torch

    for shape in ((9, 3, 64, 16), (4, 2, 32, 4), (8, 8, 128, 16)):
        for kv_dtype in (torch.float32, torch.float16):
            checked = AttentionShape(CPU, torch.float32, *shape, kv_dtype=kv_dtype)
            assert compare_with_torch(CpuAttention, checked) is None
    for shape in ((9, 3, 64, 16), (4, 2, 32, 32), (8, 1, 128, 16)):
        int8_keys = AttentionShape(CPU, torch.float32, *shape, kv_dtype=torch.float16, int8_keys=True)
        assert compare_with_torch(CpuAttention, int8_keys) is None
        assert compare_with_torch(Avx2Attention, int8_keys) is None


@needs_cpu_kernel
def test_a_page_outside_the_pool_is_refused_before_anything_is_written() -> None:
    attention = make(CpuAttention, heads=4, kv_heads=2, dim=32, page=4, pages=8)
    before = attention.kv_pool.buffer.clone()
    attention.plan(paged_metadata([0], [6], [[3, 8]], 4))  # page 8 of a pool of 8
    with pytest.raises(ValueError, match="page 8 is outside the pool of 8"):
        attention.forward(0, torch.randn(6, 4, 32), torch.randn(6, 2, 32), torch.randn(6, 2, 32))
    assert torch.equal(attention.kv_pool.buffer, before)


def test_the_kernel_says_why_it_cannot_serve_a_shape() -> None:
    bf16 = AttentionShape(CPU, torch.bfloat16, 9, 3, 64, 16)
    assert CpuAttention.unavailable(bf16) is not None
    odd_head = AttentionShape(CPU, torch.float32, 9, 3, 60, 16)
    assert CpuAttention.unavailable(odd_head) is not None
    bf16_pool = AttentionShape(CPU, torch.float32, 9, 3, 64, 16, kv_dtype=torch.bfloat16)
    assert "float32 or float16" in (CpuAttention.unavailable(bf16_pool) or "")
    int8_keys_in_pages_of_8 = AttentionShape(CPU, torch.float32, 9, 3, 64, 8, torch.float16, int8_keys=True)
    assert "multiple of 16" in (CpuAttention.unavailable(int8_keys_in_pages_of_8) or "")


def test_the_extension_is_built_on_an_avx2_machine() -> None:
    """An optional build that failed must not silently serve the torch reference's slower attention:
    on an AVX2 x86 machine the kernel must be there."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= set(flags):
        pytest.skip("not an x86 CPU with AVX2 and FMA")
    assert KERNEL is not None, UNAVAILABLE_REASON
    assert CpuAttention.unavailable(AttentionShape(CPU, torch.float32, 9, 3, 64, 16)) is None


@needs_cpu_kernel
def test_int8_keys_are_stored_as_the_reference_rounds_them_and_attend_as_dense_attention_on_them() -> None:
    """`--kv-dtype int8-keys` (worker/attention/int8_kv.py): each key row written once as int8 and a
    scale, in the documented page layout, the same bytes as `round_rows`; every output dense
    attention's numbers on the keys' int8 rows and the queries' int16 ones (the values float16), past a key
    block, across pages out of order, a zero key row and one past float16's range among them."""
    heads, kv_heads, dim, page = 9, 3, 64, 16
    q, k, v = histories([150, 40], heads, kv_heads, dim, seed=6)
    k[0][5, 1] = 0.0  # a zero row: scale 0, every value 0
    k[0][9, 2, 7] = 1e6  # its row's other values round to 0
    tables = scattered_tables(2, 10, 40)
    steps = [[(0, 70), (1, 1)], [(0, 1), (1, 39)], [(0, 79)]]
    attention = make(
        CpuAttention, heads=heads, kv_heads=kv_heads, dim=dim, page=page, pages=40, int8_keys=True
    )
    got = feed(attention, tables, steps, (q, k, v))
    keys = attention.kv_pool.keys(0)  # [kv_heads, slots, dim] float16
    for row, table in enumerate(tables):
        length = len(k[row])
        for index, pool_page in enumerate(table[: -(-length // page)]):
            for head in range(kv_heads):
                stored, scales = read_page(keys[head, pool_page * page : (pool_page + 1) * page], page, dim)
                rows = k[row][index * page : (index + 1) * page, head]
                want, want_scales = round_rows(rows)
                assert torch.equal(stored[: len(rows)].int(), want), (row, index, head)
                assert torch.equal(scales[: len(rows)], want_scales), (row, index, head)
    for row in range(2):
        expected = dense(
            through_rounding(q[row], QUERY_LEVELS), through_rounding(k[row]), v[row].half().float()
        )
        assert torch.allclose(got[row].double(), expected, atol=2e-6), row


@needs_cpu_kernel
def test_an_int8_pool_refuses_what_the_kernel_cannot_read() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        make(CpuAttention, heads=4, kv_heads=2, dim=32, page=8, int8_keys=True)
    refused = [
        (torch.float32, {"int8_keys": True}, "head-major float16"),
        (torch.float16, {"int8_values": True}, "int8 values come with int8 keys"),
    ]
    for dtype, form, reason in refused:
        with pytest.raises(ValueError, match=reason):
            KVPool(
                num_layers=1,
                num_pages=4,
                page_size=16,
                num_kv_heads=2,
                head_dim=32,
                dtype=dtype,
                device=CPU,
                layout="head_major",
                **form,
            )
    assert CpuAttention.unavailable(
        AttentionShape(CPU, torch.float32, 9, 3, 64, 16, torch.float16, False, True)
    )


@needs_cpu_kernel
def test_int8_values_are_stored_as_the_reference_rounds_them_and_attend_as_dense_attention_on_them() -> None:
    """`--kv-dtype int8`: each value row written once as int8 and a scale, in the documented page layout
    (two positions' rows interleaved), the same bytes as `round_rows`; every output dense attention's
    numbers on the rounded queries, keys and values, within the weights' rounding (a head's weights
    over a block at 16 bits), past a key block, across pages out of order, a zero value row and one
    past float16's range among them."""
    heads, kv_heads, dim, page = 9, 3, 64, 16
    q, k, v = histories([150, 41], heads, kv_heads, dim, seed=8)
    v[0][5, 1] = 0.0
    v[0][9, 2, 7] = 1e6
    tables = scattered_tables(2, 10, 40)
    steps = [[(0, 70), (1, 1)], [(0, 1), (1, 40)], [(0, 79)]]
    attention = make(
        CpuAttention,
        heads=heads,
        kv_heads=kv_heads,
        dim=dim,
        page=page,
        pages=40,
        int8_keys=True,
        int8_values=True,
    )
    got = feed(attention, tables, steps, (q, k, v))
    values = attention.kv_pool.values(0)
    for row, table in enumerate(tables):
        length = len(v[row])
        for index, pool_page in enumerate(table[: -(-length // page)]):
            for head in range(kv_heads):
                stored, scales = read_value_page(
                    values[head, pool_page * page : (pool_page + 1) * page], page, dim
                )
                rows = v[row][index * page : (index + 1) * page, head]
                want, want_scales = round_rows(rows)
                assert torch.equal(stored[: len(rows)].int(), want), (row, index, head)
                assert torch.equal(scales[: len(rows)], want_scales), (row, index, head)
    for row in range(2):
        rounded_v = through_rounding(v[row])
        expected = dense(through_rounding(q[row], QUERY_LEVELS), through_rounding(k[row]), rounded_v)
        # A weight's level is within half a level of the head's largest weight in its block, so a query
        # head's outputs move by a few levels' worth of its largest (at least 1): within 2e-4 of it here.
        magnitude = expected.abs().amax(-1, keepdim=True).clamp(min=1.0)
        error = ((got[row].double() - expected).abs() / magnitude).max().item()
        assert error < 2e-4, (row, error)
        assert error > 0  # the weights are rounded: not dense attention's float numbers
        unrounded = dense(through_rounding(q[row], QUERY_LEVELS), through_rounding(k[row]), v[row])
        assert (got[row].double() - unrounded).abs().max().item() > 1e-3  # the values are int8, not floats


@needs_cpu_kernel
@pytest.mark.parametrize("int8_values", [False, True], ids=["int8-keys", "int8"])
def test_the_int8_forms_long_rows_keep_their_bits_whatever_the_steps_and_the_kernels_path(
    int8_values: bool,
) -> None:
    """Past many pages, key blocks and a job's run of queries, odd rows seen in a block, and on the
    AVX2 path (the integers from vpmaddwd, not vpdpwssd): one token at a time, beside another row on 2
    threads, in chunks across block boundaries, the same bits as the history whole."""
    heads, kv_heads, dim, page = 12, 2, 64, 32
    q, k, v = histories([301, 300], heads, kv_heads, dim, seed=9)
    tables = [list(range(0, 10)), list(range(10, 20))[::-1]]

    def row_zero(
        steps: list[list[tuple[int, int]]], threads: int, backend: type[CpuAttention]
    ) -> torch.Tensor:
        return first_row(
            steps,
            threads,
            tables,
            (q, k, v),
            heads=heads,
            kv_heads=kv_heads,
            page=page,
            int8_keys=True,
            int8_values=int8_values,
            backend=backend,
        )

    whole = row_zero([[(0, 301)]], 1, CpuAttention)
    assert torch.equal(whole, row_zero([[(0, 1)]] * 301, 1, CpuAttention))
    assert torch.equal(
        whole, row_zero([[(1, 140), (0, 129)], [(0, 3), (1, 160)], [(0, 169)]], 2, Avx2Attention)
    )
    assert torch.equal(whole, row_zero([[(0, 77)], [(0, 64)], [(0, 160)]], 2, CpuAttention))
