"""The decoder forward by address (worker/model/native_forward.py): where every piece of a layer runs
natively it serves, and it gives the op-by-op forward's bits, hidden states and KV pool alike."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests.worker.cpu_kernel import needs_cpu_kernel
from worker.attention import TorchAttention
from worker.attention.base import AttentionBackend, paged_metadata
from worker.attention.cpu_backend import CpuAttention
from worker.attention.kv_pool import KVPool
from worker.model.block_dot import UNAVAILABLE_REASON as BLOCK_DOT_REASON
from worker.model.block_dot import block_dot_available
from worker.model.llama import LlamaModel
from worker.model.loader import load_model
from worker.model.presets import smollm2_gguf_path
from worker.model.row_ops_native import UNAVAILABLE_REASON as ROW_OPS_REASON
from worker.model.row_ops_native import native_row_ops_available

CPU = torch.device("cpu")
PAGE = 16
POOL_PAGES = 48

needs_native_kernels = pytest.mark.skipif(
    not (block_dot_available() and native_row_ops_available()),
    reason=f"the block kernels ({BLOCK_DOT_REASON or 'built'}) and the row ops ({ROW_OPS_REASON or 'built'})",
)


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


def model_named(name: str, weights: str) -> LlamaModel:
    if name == "smollm2-135m":
        try:
            smollm2_gguf_path()
        except FileNotFoundError as error:
            pytest.skip(str(error))
    loaded = load_model(name, device=CPU, dtype=torch.float32, weights=weights)
    return LlamaModel(loaded.config, loaded.weights, device=CPU, dtype=torch.float32)


def attention_for(model: LlamaModel, backend: type[AttentionBackend], *, int8: bool) -> AttentionBackend:
    c = model.config
    pool = KVPool(
        num_layers=c.num_layers,
        num_pages=POOL_PAGES,
        page_size=PAGE,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=torch.float16 if int8 else torch.float32,
        device=CPU,
        layout=backend.kv_layout,
        int8_keys=int8,
        int8_values=int8,
    )
    return backend(
        pool, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=torch.float32
    )


# (row, tokens) per step: two prefills, then a decode beside a 16-token append, then two decodes.
STEPS = ((0, 40), (1, 7)), ((0, 1), (1, 16)), ((1, 1), (0, 1))


def feed(model: LlamaModel, attention: AttentionBackend, *, op_by_op: bool) -> list[torch.Tensor]:
    """Each step's hidden states, the two rows on scattered pages."""
    forward = model.forward_op_by_op if op_by_op else model.forward
    tables = [list(range(POOL_PAGES - 1, 0, -2)), list(range(0, POOL_PAGES, 2))]
    vocab = min(1000, model.config.vocab_size)
    tokens = torch.randint(1, vocab, (2, 64), generator=torch.Generator().manual_seed(3))
    done, hidden = [0, 0], []
    for step in STEPS:
        starts = [done[row] for row, _ in step]
        attention.plan(paged_metadata(starts, [n for _, n in step], [tables[row] for row, _ in step], PAGE))
        ids = torch.cat([tokens[row, done[row] : done[row] + n] for row, n in step])
        positions = torch.cat([torch.arange(done[row], done[row] + n) for row, n in step])
        hidden.append(forward(ids, positions, attention).clone())
        for row, n in step:
            done[row] += n
    return hidden


@needs_cpu_kernel
@needs_native_kernels
@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize(
    ("name", "weights", "int8"),
    [("tiny", "int4", True), ("tiny", "int8", False), ("smollm2-135m", "int4", True)],
)
def test_the_native_forward_gives_the_op_by_op_forwards_bits(name: str, weights: str, int8: bool) -> None:
    model = model_named(name, weights)
    assert model.native is not None, "every piece of its layers runs natively here"
    native_attention = attention_for(model, CpuAttention, int8=int8)
    op_attention = attention_for(model, CpuAttention, int8=int8)
    native = feed(model, native_attention, op_by_op=False)
    op_by_op = feed(model, op_attention, op_by_op=True)
    for got, want in zip(native, op_by_op, strict=True):
        assert torch.equal(got, want)
    # the KV written, byte for byte (an int8 pool's bytes are not float16 numbers: compared as bytes)
    assert torch.equal(
        native_attention.kv_pool.buffer.view(torch.uint8), op_attention.kv_pool.buffer.view(torch.uint8)
    )


def test_the_float_form_keeps_the_op_by_op_forward() -> None:
    """`float` keeps torch's row ops and matrices (its parity with transformers rests on their bits)."""
    assert model_named("tiny", "float").native is None


@needs_native_kernels
def test_another_attention_backend_takes_the_op_by_op_forward() -> None:
    model = model_named("tiny", "int4")
    assert model.native is not None
    reference = attention_for(model, TorchAttention, int8=False)
    again = attention_for(model, TorchAttention, int8=False)
    for got, want in zip(
        feed(model, reference, op_by_op=False), feed(model, again, op_by_op=True), strict=True
    ):
        assert torch.equal(got, want)
