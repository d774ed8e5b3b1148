"""The CUDA weight-only forms (`--weights int4|int8`, worker/model/weight_only_kernel.py) compiled on a
GPU: against the dequantised reference for each stored type, a row's bits alone and in batches of
7, 64 and 300, an engine on a random model quantised at load streamed in micro-turns against the
same history sent whole, and its greedy tokens against the float path's. Run by
scripts/gpu-check.sh (`-m cuda`); the same kernel is checked on the CPU under Triton's interpreter
in test_weight_only_kernel.py.

SmolLM2's file cannot be carried to the GPU machine, so the engine tests use the `tiny` preset's
random float weights, which `int4` quantises at load into Q4_1 groups (and `int8` into Q8_0).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING

import gguf
import numpy as np
import pytest
import torch

from worker.engine import Engine
from worker.engine.model_runner import ForwardRow, ModelRunner
from worker.model.loader import load_model
from worker.model.stored import StoredTensor

if TYPE_CHECKING:
    from worker.model.linear_blocks import BlockLinear

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="needs triton (the kernels' compiler)"
    ),
]
CUDA = torch.device("cuda")
Q = gguf.GGMLQuantizationType
# Llama-3.2-1B's hidden width; 512 output rows keep the gguf quantiser's CPU time short.
ROWS, WIDTH = 512, 2048


def _stored(kind: gguf.GGMLQuantizationType, seed: int) -> StoredTensor:
    values = np.random.default_rng(seed).standard_normal((ROWS, WIDTH)).astype(np.float32)
    return StoredTensor(kind, gguf.quants.quantize(values, kind), WIDTH)


# worker/model/weight_only_kernel.py's Method names: every type by the engine's method, Q4_1 by
# the other too (each (type, method, dtype) is a Triton compilation: the GPU check has minutes).
CASES = [(Q.Q4_0, "ROWSUM"), (Q.Q4_1, "ROWSUM"), (Q.Q8_0, "ROWSUM"), (Q.Q4_1, "DOT")]


def _held(stored: StoredTensor, bias: torch.Tensor | None, method: str) -> BlockLinear:
    from worker.model.linear_blocks import BlockLinear
    from worker.model.weight_only_kernel import Method

    return dataclasses.replace(BlockLinear.from_stored(stored, bias, CUDA), method=Method[method])


@pytest.mark.parametrize(("kind", "method"), CASES)
def test_stored_blocks_multiply_as_their_dequantised_values_on_the_gpu(
    kind: gguf.GGMLQuantizationType, method: str
) -> None:
    stored = _stored(kind, seed=kind.value)
    reference = stored.dequantize().to(CUDA)
    linear = _held(stored, None, method)
    # One-hot rows read each column back: the dequantised weights are gguf's, bit for bit.
    assert torch.equal(linear(torch.eye(WIDTH, device=CUDA)), reference.T)
    x = torch.randn(37, WIDTH, generator=torch.Generator(CUDA).manual_seed(1), device=CUDA)
    want = x.double() @ reference.double().T
    magnitude = x.double().abs() @ reference.double().abs().T
    got32 = linear(x)
    assert bool(((got32.double() - want).abs() <= WIDTH * 2.0**-24 * magnitude).all())
    for dtype in (torch.bfloat16, torch.float16):
        xh = x.to(dtype)
        want_h = xh.double() @ reference.double().T
        got = linear(xh)
        assert got.dtype == dtype
        bound = torch.finfo(dtype).eps * want_h.abs() + WIDTH * 2.0**-24 * magnitude
        assert bool(((got.double() - want_h).abs() <= bound).all()), (got.double() - want_h).abs().max()


@pytest.mark.parametrize(("kind", "method"), CASES[1:])
def test_a_row_gets_the_same_bits_alone_or_in_a_batch_on_the_gpu(
    kind: gguf.GGMLQuantizationType, method: str
) -> None:
    """The engine's promise (streamed in micro-turns = sent whole) needs a row's result independent
    of its step's row count: the kernel uses one tile shape and one order over K for every M."""
    bias = torch.randn(ROWS, device=CUDA).to(torch.bfloat16)
    linear = _held(_stored(kind, seed=7), bias, method)
    x = torch.randn(300, WIDTH, generator=torch.Generator(CUDA).manual_seed(2), device=CUDA)
    x = (x * torch.linspace(0.1, 30, 300, device=CUDA)[:, None]).to(torch.bfloat16)
    batched = linear(x)
    for rows in (1, 7, 64):
        assert torch.equal(linear(x[:rows]), batched[:rows]), rows
    assert torch.equal(linear(x[150:151]), batched[150:151])
    assert torch.equal(torch.cat([linear(x[:5]), linear(x[5:133]), linear(x[133:])]), batched)


def _streamed_and_whole(engine: Engine, prompt: list[int], chunk: int, outputs: int) -> list[int]:
    """Feed `prompt` in chunks with `outputs` greedy tokens after each, and after each chunk check the
    same history sent whole to a fresh session answers the same; the streamed session's tokens."""
    streamed = engine.open_session(stop_token_ids=())
    history: list[int] = []
    answered: list[int] = []
    for start in range(0, len(prompt), chunk):
        piece = prompt[start : start + chunk]
        tokens = engine.run_turn(streamed, tokens=piece, max_output_tokens=outputs, timeout=120).tokens
        whole = engine.open_session(stop_token_ids=(), history=history)
        assert engine.run_turn(whole, tokens=piece, max_output_tokens=outputs, timeout=120).tokens == tokens
        engine.close_session(whole)
        history += [*piece, *tokens]
        answered += tokens
    engine.close_session(streamed)
    return answered


@pytest.mark.parametrize("form", ["int4", "int8"])
def test_an_engine_on_quantised_weights_streams_as_it_answers_whole(form: str) -> None:
    prompt = torch.randint(1, 500, (96,), generator=torch.Generator().manual_seed(3)).tolist()
    with Engine.load(
        "tiny",
        device="cuda",
        dtype="bfloat16",
        attention="torch",
        weights=form,
        kv_tokens=4096,
        host_kv_tokens=0,
    ) as engine:
        assert len(_streamed_and_whole(engine, prompt, chunk=16, outputs=4)) == 24


def _greedy(form: str, tokens: list[int]) -> tuple[torch.Tensor, int]:
    """The greedy next token at every position of `tokens` fed whole (teacher-forced), and the bytes
    a step reads, for the `tiny` preset in `form` on the GPU."""
    loaded = load_model("tiny", device=CUDA, dtype=torch.bfloat16, weights=form)
    runner = ModelRunner(
        loaded, device=CUDA, dtype=torch.bfloat16, num_pages=8, page_size=16, attention="torch"
    )
    rows = [ForwardRow(tokens, 0, list(range(8)), None, None)]
    meta = runner.metadata(rows)
    runner.attention.plan(meta)
    with torch.inference_mode():
        hidden = runner.model.forward(
            torch.tensor(tokens, device=CUDA), meta.positions.to(CUDA), runner.attention
        )
        greedy = runner.model.logits(hidden).argmax(-1).cpu()
    return greedy, loaded.weights.bytes_read_per_step()


# Bytes read per step against bf16's 2 a weight: Q4_1 0.625 (a nibble, float16 d and m per 32),
# Q8_0 1.0625 (a byte, float16 d per 32), plus the float norms.
BYTES_AGAINST_BF16 = {"int4": 0.33, "int8": 0.55}
# Greedy agreement with the float path, position by position over the same 96 tokens. On the CPU
# (float32, the kernel under the interpreter, `tiny`, 48 positions) Q8_0 agreed at 48 of 48 and
# Q4_1 at 37 of 48; the float path here is itself bf16. These bounds rule out a broken form (a
# random one agrees at ~1 in 512), not a precise figure.
AGREEMENT = {"int4": 0.5, "int8": 0.85}


@pytest.mark.parametrize("form", ["int4", "int8"])
def test_quantised_weights_agree_with_the_float_path_and_read_fewer_bytes(form: str) -> None:
    tokens = torch.randint(1, 500, (96,), generator=torch.Generator().manual_seed(4)).tolist()
    float_greedy, float_bytes = _greedy("float", tokens)
    greedy, num_bytes = _greedy(form, tokens)
    assert num_bytes < BYTES_AGAINST_BF16[form] * float_bytes
    agreed = int((greedy == float_greedy).sum())
    assert agreed >= AGREEMENT[form] * len(tokens), (agreed, len(tokens))


def test_a_stored_embedding_is_a_dense_table_on_the_gpu() -> None:
    """A lookup in stored rows is dequantised on the host, which would make every GPU step wait for
    its token ids: on CUDA the quantised forms keep the embedding as a dense device table."""
    from worker.model.embedding import FloatEmbedding
    from worker.model.weight_form import WeightForm

    stored = _stored(Q.Q8_0, seed=9)
    embedding = WeightForm("int4", torch.bfloat16, CUDA).embedding(stored)
    assert isinstance(embedding, FloatEmbedding)
    ids = torch.tensor([3, 0, 511, 3], device=CUDA)
    assert torch.equal(embedding(ids), stored.dequantize().to(CUDA, torch.bfloat16)[ids])
