"""A position's logits are the same bits however its session's tokens were split into steps, whatever
rows share the step, on whatever pages its KV sits, and on 1 or 2 threads: the engine's promise
(streamed in micro-turns = sent whole, alone = batched) held at the step, for every weight form."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import gguf
import pytest
import torch

from tests.worker.cpu_kernel import needs_cpu_kernel
from worker.attention import TorchAttention
from worker.attention.base import paged_metadata
from worker.attention.cpu_backend import KERNEL, CpuAttention
from worker.attention.kv_pool import KVPool
from worker.engine import Engine
from worker.model.llama import LlamaModel
from worker.model.loader import load_model
from worker.model.presets import smollm2_gguf_path
from worker.numerics import blas_is_row_invariant

CPU = torch.device("cpu")
PAGE = 16
POOL_PAGES = 64
# Crosses the torch backend's query blocks and KV tiles (64 each) and a page boundary mid-chunk.
LENGTH = 150
# The same tokens as micro-turns, decode steps and a long append, each step beside another session.
PIECES = (1, 5, 64, 13, 1, 1, 65)


@pytest.fixture
def threads() -> Iterator[int]:
    """2 where the machine has them (the test process runs torch on 1 by default, tests/conftest.py)."""
    before = torch.get_num_threads()
    yield min(2, os.cpu_count() or 1)
    torch.set_num_threads(before)


def logits_by_steps(
    model: LlamaModel,
    tokens: torch.Tensor,
    pieces: Sequence[int],
    pages: list[int],
    *,
    neighbour: bool,
    kv_dtype: torch.dtype = torch.float32,
    int8_keys: bool = False,
    int8_values: bool = False,
) -> torch.Tensor:
    """Every position's logits, the session fed in `pieces`; with `neighbour`, each step also feeds
    3 tokens of another session on scattered pages. The torch reference attends, or the cpu kernel
    on `int8_keys` (and `int8_values`: the int8 forms are its alone)."""
    config = model.config
    backend = CpuAttention if int8_keys else TorchAttention
    pool = KVPool(
        num_layers=config.num_layers,
        num_pages=POOL_PAGES,
        page_size=PAGE,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=torch.float16 if int8_keys else kv_dtype,
        device=CPU,
        layout=backend.kv_layout,
        int8_keys=int8_keys,
        int8_values=int8_values,
    )
    attention = backend(
        pool,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=torch.float32,
    )
    other_pages = list(range(POOL_PAGES - 1, POOL_PAGES - 1 - 3 * len(pieces), -3))
    logits, start = [], 0
    for step, n in enumerate(pieces):
        starts, q_lens, tables = [start], [n], [pages]
        ids, positions = [tokens[start : start + n]], [torch.arange(start, start + n)]
        if neighbour:
            starts.append(3 * step)
            q_lens.append(3)
            tables.append(other_pages)
            ids.append(tokens[:3].flip(0))
            positions.append(torch.arange(3 * step, 3 * step + 3))
        attention.plan(paged_metadata(starts, q_lens, tables, PAGE))
        hidden = model.forward(torch.cat(ids), torch.cat(positions), attention)
        logits.append(model.logits(hidden[:n]))
        start += n
    return torch.cat(logits)


@pytest.mark.parametrize(
    ("form", "kv_dtype"),
    [
        ("float", torch.float32),
        ("int4", torch.float32),
        ("int8", torch.float32),
        # `--kv-dtype auto`'s pool for the quantised forms (worker/attention/kv_dtype.py)
        ("int4", torch.float16),
        ("int8", torch.float16),
    ],
)
def test_a_positions_logits_do_not_depend_on_how_its_history_was_chunked(
    form: str, kv_dtype: torch.dtype, threads: int
) -> None:
    assert blas_is_row_invariant(), "MKL sums a row by the product's shape (worker/numerics.py)"
    loaded = load_model("tiny", device=CPU, dtype=torch.float32, weights=form)
    model = LlamaModel(loaded.config, loaded.weights, device=CPU, dtype=torch.float32)
    tokens = torch.randint(0, loaded.config.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(0))
    contiguous = list(range(POOL_PAGES // 2))
    scattered = [3 * i + 1 for i in range(POOL_PAGES // 3)]
    torch.set_num_threads(threads)
    whole = logits_by_steps(model, tokens, (LENGTH,), contiguous, neighbour=False, kv_dtype=kv_dtype)
    torch.set_num_threads(1)
    streamed = logits_by_steps(model, tokens, PIECES, scattered, neighbour=True, kv_dtype=kv_dtype)
    assert torch.equal(whole, streamed)


@needs_cpu_kernel
@pytest.mark.parametrize("int8_values", [False, True], ids=["int8-keys", "int8"])
@pytest.mark.parametrize("form", ["int4", "int8"])
def test_the_int8_forms_keep_a_positions_logits_independent_of_its_chunking(
    form: str, int8_values: bool, threads: int
) -> None:
    """`--kv-dtype int8-keys` and `int8` (`auto`'s pool for the quantised forms where the cpu kernel
    runs): the keys (and values) rounded to int8 row by row, the queries to int16, the scores (and the
    weighted values, a block at a time) integers, so the promise holds as on the float pools."""
    loaded = load_model("tiny", device=CPU, dtype=torch.float32, weights=form)
    model = LlamaModel(loaded.config, loaded.weights, device=CPU, dtype=torch.float32)
    tokens = torch.randint(0, loaded.config.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(0))
    contiguous = list(range(POOL_PAGES // 2))
    scattered = [3 * i + 1 for i in range(POOL_PAGES // 3)]
    torch.set_num_threads(threads)
    int8 = {"int8_keys": True, "int8_values": int8_values}
    whole = logits_by_steps(model, tokens, (LENGTH,), contiguous, neighbour=False, **int8)
    torch.set_num_threads(1)
    streamed = logits_by_steps(model, tokens, PIECES, scattered, neighbour=True, **int8)
    assert torch.equal(whole, streamed)
    float16 = logits_by_steps(model, tokens, (LENGTH,), contiguous, neighbour=False, kv_dtype=torch.float16)
    assert not torch.equal(whole, float16)  # the rows were rounded to int8: not float16's numbers
    assert (whole.argmax(-1) == float16.argmax(-1)).float().mean() > 0.9  # but close to them


def test_one_token_rows_sharing_a_steps_buffers_are_the_same_as_alone() -> None:
    """Decode rows of as many KV tiles share the step's attention buffers (worker/attention/
    torch_backend.py): a longer row's keys and values past a shorter one's end must not leak."""
    loaded = load_model("tiny", device=CPU, dtype=torch.float32, weights="float")
    model = LlamaModel(loaded.config, loaded.weights, device=CPU, dtype=torch.float32)
    config = loaded.config
    pool = KVPool(
        num_layers=config.num_layers,
        num_pages=POOL_PAGES,
        page_size=PAGE,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=torch.float32,
        device=CPU,
        layout=TorchAttention.kv_layout,
    )
    attention = TorchAttention(
        pool, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim
    )
    # Lengths before the decode token: two tiles (three rows, the longest in the middle), one tile, three.
    lengths = [70, 127, 65, 30, 150]
    tables = [list(range(12 * i, 12 * i + 12)) for i in range(len(lengths))]
    generator = torch.Generator().manual_seed(1)
    histories = [torch.randint(0, config.vocab_size, (n + 1,), generator=generator) for n in lengths]
    for table, tokens, n in zip(tables, histories, lengths, strict=True):
        attention.plan(paged_metadata([0], [n], [table], PAGE))
        model.forward(tokens[:n], torch.arange(n), attention)

    def decode(rows: list[int]) -> torch.Tensor:
        starts = [lengths[i] for i in rows]
        attention.plan(paged_metadata(starts, [1] * len(rows), [tables[i] for i in rows], PAGE))
        ids = torch.stack([histories[i][-1] for i in rows])
        return model.logits(model.forward(ids, torch.tensor(starts), attention))

    together = decode(list(range(len(lengths))))
    for i in range(len(lengths)):
        assert torch.equal(decode([i])[0], together[i])


@pytest.mark.slow
def test_smollm2_under_auto_is_int4_and_streams_as_it_answers_whole() -> None:
    """The reason `auto` may pick int4 (docs/benchmarks.md, "Weight forms"), on the real file."""
    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    with Engine.load("smollm2-135m", kv_tokens=1024, host_kv_tokens=0) as engine:
        # Served quantised (int4 reads ~91 MiB a step, float ~513 MiB), its keys and values in int8 where
        # the cpu attention kernel runs (else float16).
        assert engine.weight_bytes_per_step < 2 * sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
        assert engine.kv_format.dtype == ("int8" if KERNEL is not None else "float16")
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        prompt = tokenizer.encode(tokenizer.chat_prompt("Name three rivers in Europe."))
        streamed = engine.open_session(stop_token_ids=())
        history: list[int] = []
        for start in range(0, len(prompt), 8):
            chunk = prompt[start : start + 8]
            tokens = engine.run_turn(streamed, tokens=chunk, max_output_tokens=4, timeout=300).tokens
            whole = engine.open_session(stop_token_ids=(), history=history)
            assert engine.run_turn(whole, tokens=chunk, max_output_tokens=4, timeout=300).tokens == tokens
            engine.close_session(whole)
            history += [*chunk, *tokens]
