"""Weight forms (`--weights`): each quantised linear against the dequantised reference, the embedding
kept exact, the flag's refusals, and SmolLM2 served as int4 within twice its file's tensor bytes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from loadtest.weight_quality import FormModel
from shared.settings import EXIT_REFUSED, EngineSettings, parse_settings
from tests.processes import run_to_exit
from worker.engine import Engine
from worker.engine.config import EngineConfig
from worker.model.block_dot import block_dot_available
from worker.model.embedding import StoredEmbedding
from worker.model.linear import FloatLinear
from worker.model.linear_int4 import INT4_STORED_TYPES, Int4Linear
from worker.model.linear_int8 import Int8Linear, Int8WeightOnlyLinear
from worker.model.linear_q8q8 import Q8Q8Linear
from worker.model.loader import load_model
from worker.model.loader_gguf import unpermute_qk
from worker.model.presets import smollm2_gguf_path
from worker.model.stored import StoredTensor
from worker.model.weight_form import int4_kernel, resolve_weight_form

CPU = torch.device("cpu")
Q = gguf.GGMLQuantizationType
# bfloat16 keeps 8 bits of mantissa: activations, scales and the product are each rounded once.
BF16_RELATIVE = 2.0**-6


def _stored(kind: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int) -> StoredTensor:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return StoredTensor(kind, gguf.quants.quantize(values, kind), cols)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("kind", sorted(INT4_STORED_TYPES))
def test_int4_serves_stored_q4_blocks_as_their_dequantised_values(kind: gguf.GGMLQuantizationType) -> None:
    stored = _stored(kind, 96, 256, seed=kind.value)
    reference = stored.dequantize()
    linear = Int4Linear.from_stored(stored, None)
    # One-hot rows read single columns back: every nibble, scale and zero lands where it belongs
    # (a misplaced nibble is off by a quantisation step, ~1/8 of the range; bfloat16 by ~1/128).
    columns = linear(torch.eye(256))
    assert (columns - reference.T).abs().max() <= BF16_RELATIVE / 2 * reference.abs().max()
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(1))
    assert _relative_error(linear(x), x @ reference.T) < 1e-2
    assert linear.num_bytes < stored.num_bytes * 1.5  # nibbles + a bf16 scale and zero per 32


def test_int4_from_a_float_matrix_quantises_groups_of_32() -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    q41 = StoredTensor(Q.Q4_1, gguf.quants.quantize(weight.numpy(), Q.Q4_1), 128).dequantize()
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(3))
    error = _relative_error(Int4Linear.from_float(weight, None)(x), x @ weight.T)
    # As close as llama.cpp's own Q4_1 of the same matrix, up to bfloat16.
    assert error < 1.5 * _relative_error(x @ q41.T, x @ weight.T) + BF16_RELATIVE


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_1, Q.Q5_0])
def test_int8_serves_any_stored_type_close_to_its_dequantised_values(kind: gguf.GGMLQuantizationType) -> None:
    stored = _stored(kind, 64, 256, seed=5)
    reference = stored.dequantize()
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(4))
    assert _relative_error(Int8Linear.from_float(reference, None)(x), x @ reference.T) < 2e-2
    # Weights only (the output projection under int4): bfloat16 activations and output.
    assert _relative_error(Int8WeightOnlyLinear.from_float(reference, None)(x), x @ reference.T) < 1e-2


@pytest.mark.parametrize(
    "make", [Int8Linear.from_float, Int8WeightOnlyLinear.from_float, Int4Linear.from_float]
)
def test_a_row_gets_the_same_result_alone_or_in_a_batch(make: object) -> None:
    """The engine's promise (streamed = sent whole, alone = batched) needs row-independent products."""
    assert callable(make)
    weight = torch.randn(160, 576, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(160, generator=torch.Generator().manual_seed(7))
    linear = make(weight, bias)
    x = torch.randn(48, 576, generator=torch.Generator().manual_seed(8))
    x = x * torch.linspace(0.1, 30, 48)[:, None]  # rows of very different ranges
    batched = linear(x)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(48)])
    pieces = torch.cat([linear(x[:5]), linear(x[5:37]), linear(x[37:])])
    assert torch.equal(batched, alone) and torch.equal(batched, pieces)


def test_stored_rows_permute_and_stack_as_their_values_do() -> None:
    a, b = _stored(Q.Q4_1, 64, 128, seed=9), _stored(Q.Q4_1, 32, 128, seed=10)
    order = unpermute_qk(np.arange(64), 4)
    assert torch.equal(a.permute_rows(order).dequantize(), a.dequantize()[torch.from_numpy(order)])
    assert torch.equal(StoredTensor.cat([a, b]).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="cannot stack"):
        StoredTensor.cat([a, _stored(Q.Q8_0, 32, 128, seed=11)])


def test_stored_embedding_looks_rows_up_exactly() -> None:
    stored = _stored(Q.Q8_0, 300, 64, seed=12)
    ids = torch.tensor([5, 0, 299, 5, 17])
    looked_up = StoredEmbedding(stored, torch.float32)(ids)
    assert torch.equal(looked_up, stored.dequantize()[ids])


def test_the_flag_refuses_a_bad_value_and_a_type_no_int4_kernel_takes() -> None:
    with pytest.raises(ValueError, match="expected one of auto, float, int8, int4"):
        resolve_weight_form("int3", device=CPU, dtype=torch.float32, stored_types=frozenset())
    with pytest.raises(ValueError, match="Q6_K, which no int4 kernel"):
        resolve_weight_form("int4", device=CPU, dtype=torch.float32, stored_types=frozenset({Q.Q4_1, Q.Q6_K}))
    with pytest.raises(ValueError, match="no mps kernel yet"):
        resolve_weight_form("int8", device=torch.device("mps"), dtype=torch.float32, stored_types=frozenset())
    with pytest.raises(ValueError, match="weights 'int3' is not one of"):
        EngineConfig(model="tiny", weights="int3")
    with pytest.raises(SystemExit):  # argparse: a usage error, before anything loads
        parse_settings(EngineSettings, ["--weights", "int3"], prog="worker")
    assert parse_settings(EngineSettings, ["--weights", "int4"], prog="worker").weights == "int4"


def test_a_worker_given_a_form_it_cannot_serve_exits_2_saying_why_without_a_traceback() -> None:
    done = run_to_exit("worker", "--model", "tiny", "--weights", "int4", "--dtype", "bfloat16")
    assert done.returncode == EXIT_REFUSED, done.stderr[-2000:]
    assert "the worker does not start: --weights int4 computes around float32 activations" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_device_this_torch_cannot_run_is_refused_before_anything_loads() -> None:
    with pytest.raises(ValueError, match="--device 'gpu': Expected one of"):
        Engine.load("tiny", device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"--device cuda: this torch \(.*\) sees no CUDA device"):
            Engine.load("tiny", device="cuda")


def test_auto_serves_q4_files_as_int4_on_the_cpu_and_everything_else_as_float() -> None:
    """docs/benchmarks.md, "Weight forms": int4 keeps streamed = whole bit for bit and agrees with the
    float path at least as often as llama.cpp; nothing else is quantised unasked."""
    cases = [
        ("cpu", {Q.Q4_1, Q.Q8_0, Q.F32}, "int4"),
        ("cpu", {Q.Q4_0}, "int4"),
        ("cpu", set(), "float"),  # a float checkpoint
        ("cpu", {Q.Q8_0, Q.F16}, "float"),  # no 4-bit blocks to serve as stored
        ("cpu", {Q.Q4_1, Q.Q6_K}, "float"),  # a type no int4 kernel takes
        ("cuda", {Q.Q4_1}, "float"),  # until the GPU run measures the CUDA kernels against bf16
    ]
    for device, types, want in cases:
        form = resolve_weight_form(
            "auto", device=torch.device(device), dtype=torch.float32, stored_types=frozenset(types)
        )
        assert form.name == want, (device, types)


def test_float_checkpoints_stay_float_under_auto() -> None:
    float_form = load_model("tiny", device=CPU, dtype=torch.float32, weights="float").weights
    auto = load_model("tiny", device=CPU, dtype=torch.float32, weights="auto").weights
    assert auto.form == "float"
    for got, want in zip(auto.layers, float_form.layers, strict=True):
        assert isinstance(got.qkv, FloatLinear) and isinstance(want.qkv, FloatLinear)
        assert torch.equal(got.qkv.weight, want.qkv.weight)
    int8 = load_model("tiny", device=CPU, dtype=torch.float32, weights="int8").weights
    assert int8.form == "int8"
    assert isinstance(int8.layers[0].qkv, Q8Q8Linear if block_dot_available() else Int8Linear)
    assert int8.num_bytes() < float_form.num_bytes() / 3


# ---- SmolLM2's file -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


def test_smollm2_q4_1_matrices_through_int4_match_their_dequantised_values(gguf_path: Path) -> None:
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(13))
    for name in ("blk.0.ffn_down.weight", "blk.29.ffn_down.weight"):
        tensor = tensors[name]
        assert tensor.tensor_type == Q.Q4_1
        stored = StoredTensor(tensor.tensor_type, tensor.data, int(tensor.shape[0]))
        reference = stored.dequantize()
        assert _relative_error(Int4Linear.from_stored(stored, None)(x), x @ reference.T) < 1e-2
    embed = tensors["token_embd.weight"]
    stored = StoredTensor(embed.tensor_type, embed.data, int(embed.shape[0]))
    ids = torch.tensor([0, 1, 2, 49151, 1000])
    assert torch.equal(StoredEmbedding(stored, torch.float32)(ids), stored.dequantize_rows(ids.numpy()))


@pytest.mark.slow
def test_smollm2_as_int4_holds_at_most_twice_the_files_tensor_bytes(gguf_path: Path) -> None:
    loaded = load_model("smollm2-135m", device=CPU, dtype=torch.float32, weights="int4")
    assert loaded.weights.form == "int4" and isinstance(loaded.weights.layers[0].down, int4_kernel())
    assert isinstance(loaded.weights.embed, StoredEmbedding)  # the lookup reads the stored Q8_0 rows
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(gguf_path).tensors)
    assert loaded.weights.num_bytes() <= 2 * tensor_bytes  # point 6 of #32
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    with Engine.load("smollm2-135m", kv_tokens=1024, weights="int4") as engine:
        sid = engine.open_session()
        prompt = tokenizer.encode(tokenizer.chat_prompt("What is the capital of France?"))
        reply = engine.run_turn(sid, tokens=prompt, max_output_tokens=12, timeout=300).text or ""
        assert "Paris" in reply, reply


@pytest.mark.slow
def test_smollm2_as_int4_gives_the_float_paths_reply_nearly_its_logprobs(gguf_path: Path) -> None:
    """With SmolLM2's own system prompt the float path answers "The capital of France is Paris." by a
    margin of 0.08 logits over "L'Étoile, ..." at the first token, less than the quantised forms'
    noise: rounding differences of 1e-7 (torch's norm or the native one) move int4's margin by as
    much, and its greedy answer with them (docs/benchmarks.md, "The decoder's row ops in C"). So the
    check is the quality measure's (loadtest/weight_quality.py): along the float path's reply, each
    token's logprob under int4 within 0.35 of the float path's (measured 0.05-0.16 at that first
    token across the row ops tried, at most 0.03 after it; a margin of +-0.4 at a two-way tie moves
    a logprob by up to ~0.26)."""
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    reference = FormModel("smollm2-135m", "float", 128)
    tokenizer = reference.tokenizer
    assert tokenizer is not None
    prompt = tokenizer.encode(tokenizer.chat_prompt("What is the capital of France?", system))
    reply = reference.generate(prompt, 10)
    assert "Paris" in tokenizer.decode(reply)
    rows = range(len(prompt) - 1, len(prompt) + len(reply) - 1)

    def logprobs(model: FormModel) -> torch.Tensor:
        model.reset()
        logits = model.feed([*prompt, *reply], every=True)[list(rows)].double()
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(reply).unsqueeze(1)).squeeze(1)

    difference = (logprobs(FormModel("smollm2-135m", "int4", 128)) - logprobs(reference)).abs()
    assert float(difference.max()) <= 0.35, difference
