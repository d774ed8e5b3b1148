"""The CUDA weight-only kernel (worker/model/weight_only_kernel.py), run on the CPU under Triton's
interpreter against the dequantised reference: GGUF's own Q4_0/Q4_1/Q8_0 blocks, SmolLM2's shapes,
the load-time quantisers, the row invariance the engine's promise needs, and how `--weights` holds
each matrix on CUDA. The same tests run compiled on a GPU in test_weight_forms_cuda.py.

The interpreter runs every program instance in Python, so the shapes are small (seconds in all).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import gguf
import numpy as np
import pytest
import torch

from worker.model.stored import StoredTensor
from worker.model.weight_form import resolve_weight_form

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (the CUDA kernels' compiler)"
)

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
KINDS = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def _stored(kind: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int) -> StoredTensor:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return StoredTensor(kind, gguf.quants.quantize(values, kind), cols)


def _within_float32_sums(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """|got - x @ W.T| within float32's bound for a K-term sum (K * 2^-24 * |x| @ |W|.T), against
    float64: a misplaced nibble or scale is off by a quantisation step, orders of magnitude more."""
    want = x.double() @ weight.double().T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)
    assert bool(((got.double() - want).abs() <= bound).all()), (got.double() - want).abs().max()


def _within_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """A bf16/fp16 result is the float32 sum rounded once: within half a unit in its last place."""
    want = x.double() @ weight.double().T
    unit = torch.finfo(got.dtype).eps
    bound = unit * want.abs() + x.shape[1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)
    assert bool(((got.double() - want).abs() <= bound).all()), (got.double() - want).abs().max()


def _method(name: str) -> object:
    from worker.model.weight_only_kernel import Method

    return Method[name]


@pytest.mark.parametrize("kind", KINDS)
def test_stored_blocks_multiply_as_their_dequantised_values(kind: gguf.GGMLQuantizationType) -> None:
    from worker.model.linear_blocks import BlockLinear
    from worker.model.weight_only_kernel import Method

    stored = _stored(kind, 32, 128, seed=kind.value)
    reference = stored.dequantize()
    linear = BlockLinear.from_stored(stored, None, CPU)
    assert linear.num_bytes == stored.num_bytes  # the stored bytes, split into aligned arrays
    # One-hot rows read each column back: the kernel's dequantised weights are gguf's, bit for bit
    # (through DOT's larger tiles: the interpreter's time grows with the tiles; both methods share
    # the dequantisation).
    assert torch.equal(dataclasses.replace(linear, method=Method.DOT)(torch.eye(128)), reference.T)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    for method in Method:
        held = dataclasses.replace(linear, method=method)
        _within_float32_sums(held(x), x, reference)
        for dtype in (torch.bfloat16, torch.float16):
            _within_rounding(held(x.to(dtype)), x.to(dtype), reference)


def test_smollm2_shaped_matrices_with_a_bias() -> None:
    from worker.model.linear_blocks import BlockLinear

    # SmolLM2-135M's k projection (3 heads of 64 over 576) and 96 of its down projection's 576 rows
    # over 1536 (the interpreter's time grows with the rows; the sums over K are what is checked).
    for kind, rows, cols in ((Q.Q4_1, 192, 576), (Q.Q4_0, 96, 1536)):
        stored = _stored(kind, rows, cols, seed=rows)
        bias = torch.randn(rows, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        x = torch.randn(2, cols, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        got = BlockLinear.from_stored(stored, bias, CPU)(x)
        want = x.double() @ stored.dequantize().double().T + bias.double()
        assert got.dtype == torch.bfloat16
        assert bool(((got.double() - want).abs() <= 2.0**-8 * want.abs() + 1e-3).all())


@pytest.mark.parametrize("method", ["ROWSUM", "DOT"])
def test_a_row_gets_the_same_bits_alone_or_in_a_batch(method: str) -> None:
    """The engine's promise (streamed in micro-turns = sent whole) needs a row's result to be
    independent of its step's row count: one tile shape and one order over K for every M."""
    from worker.model.linear_blocks import BlockLinear

    linear = dataclasses.replace(
        BlockLinear.from_stored(_stored(Q.Q4_1, 64, 192, seed=4), None, CPU), method=_method(method)
    )
    x = torch.randn(19, 192, generator=torch.Generator().manual_seed(5))
    x = (x * torch.linspace(0.1, 30, 19)[:, None]).to(torch.bfloat16)  # rows of very different ranges
    batched = linear(x)
    assert torch.equal(linear(x[3:4]), batched[3:4])
    assert torch.equal(linear(x[:7]), batched[:7])  # a batch of 7, and 19 across two row tiles
    assert torch.equal(torch.cat([linear(x[:5]), linear(x[5:])]), batched)


def test_float_matrices_are_quantised_into_gguf_groups_at_load() -> None:
    from worker.model.linear_blocks import BlockLinear
    from worker.model.weight_only_kernel import BlockKind

    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(6))
    eye = torch.eye(64)
    # Read back through DOT's larger tiles: fewer programs for the interpreter to run.
    q41 = dataclasses.replace(BlockLinear.q4_1_from_float(weight, None), method=_method("DOT"))
    q80 = dataclasses.replace(BlockLinear.q8_0_from_float(weight, None), method=_method("DOT"))
    assert (q41.kind, q80.kind) == (BlockKind.Q4_1, BlockKind.Q8_0)
    groups = weight.reshape(32, 2, 32)
    spread = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(32, dim=1)
    # Every value within half a step of its group (plus the float16 rounding of scale and minimum):
    # a nibble out of GGUF's order would be off by several steps.
    assert bool(((q41(eye).T - weight).abs() <= spread / 15 * 0.5 + 2e-3).all())
    amax = groups.abs().amax(-1).repeat_interleave(32, dim=1)
    assert bool(((q80(eye).T - weight).abs() <= amax / 127 * 0.5 + 2e-3).all())
    # As close as llama.cpp's own quantisers of the same matrix.
    for mine, kind in ((q41, Q.Q4_1), (q80, Q.Q8_0)):
        theirs = StoredTensor(kind, gguf.quants.quantize(weight.numpy(), kind), 64).dequantize()
        assert (mine(eye).T - weight).norm() <= 1.05 * (theirs - weight).norm()
    zero = dataclasses.replace(BlockLinear.q4_1_from_float(torch.zeros(32, 64), None), method=_method("DOT"))
    assert torch.equal(zero(eye), torch.zeros(64, 32))


def test_the_cuda_forms_hold_each_matrix_as_the_policy_says() -> None:
    from worker.model.weight_form_cuda import block_linear
    from worker.model.weight_only_kernel import BlockKind

    q41, q40, q80 = (_stored(kind, 32, 64, seed=7) for kind in (Q.Q4_1, Q.Q4_0, Q.Q8_0))
    dense = torch.randn(32, 64, generator=torch.Generator().manual_seed(8))
    cases = [
        ("int4", [q41, q41], BlockKind.Q4_1),  # a fused projection, as stored
        ("int4", [q40], BlockKind.Q4_0),
        ("int4", [q80], BlockKind.Q8_0),  # 8-bit blocks stay 8-bit, as stored
        ("int4", [q41, q80], BlockKind.Q8_0),  # mixed types: held together at 8 bits
        ("int4", [dense], BlockKind.Q4_1),  # a float checkpoint: quantised at load
        ("int8", [q41], BlockKind.Q8_0),
        ("int8", [q80], BlockKind.Q8_0),
        ("int8", [dense], BlockKind.Q8_0),
    ]
    for form, parts, want in cases:
        held = block_linear(form, parts, None, CPU)
        assert held.kind == want, (form, [getattr(p, "kind", "dense") for p in parts])
        assert held.out_features == 32 * len(parts)
    as_stored = block_linear("int8", [q80], None, CPU)
    assert torch.equal(as_stored(torch.eye(64)), q80.dequantize().T)


def test_cuda_resolves_the_quantised_forms_for_half_precision_and_keeps_the_refusals() -> None:
    cuda = torch.device("cuda")
    for name in ("int4", "int8"):
        form = resolve_weight_form(name, device=cuda, dtype=torch.bfloat16, stored_types=frozenset({Q.Q4_1}))
        assert (form.name, form.dtype) == (name, torch.bfloat16)
    with pytest.raises(ValueError, match="Q6_K, which no int4 kernel"):
        resolve_weight_form("int4", device=cuda, dtype=torch.bfloat16, stored_types=frozenset({Q.Q6_K}))
    with pytest.raises(ValueError, match="float32 activations"):  # the CPU's rule stays the CPU's
        resolve_weight_form("int4", device=CPU, dtype=torch.bfloat16, stored_types=frozenset({Q.Q4_1}))
    auto = resolve_weight_form("auto", device=cuda, dtype=torch.bfloat16, stored_types=frozenset({Q.Q4_1}))
    assert auto.name == "float"


def test_both_methods_compile_for_hopper_without_tensor_cores() -> None:
    """Triton's own compiler, here on the CPU, builds the kernel for an H100/H200 (sm_90) down to
    PTX and a cubin: what the GPU run compiles, minus the launch. The PTX multiplies on CUDA cores
    (FMA, no `mma`), which is what keeps the weights' float32 values unrounded."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from worker.model import weight_only_kernel as kernel

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    signature = {
        **dict.fromkeys(("x_ptr", "y_ptr", "bias_ptr"), "*bf16"),
        **dict.fromkeys(("d_ptr", "m_ptr"), "*fp16"),
        "q_ptr": "*u8",
        **dict.fromkeys(("rows_in", "cols_out", "width", "stride_xm", "stride_ym"), "i32"),
        **dict.fromkeys(("kind", "has_bias", "use_dot", "block_m", "block_n", "block_k"), "constexpr"),
    }
    for method in kernel.Method:
        tile = kernel.TILES[method]
        constants = {"kind": int(kernel.BlockKind.Q4_1), "has_bias": True, "use_dot": int(method)}
        constants |= {"block_m": tile.block_m, "block_n": tile.block_n, "block_k": tile.block_k}
        source = ASTSource(kernel._compiled, signature, constants)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        except RuntimeError as error:  # no ptxas in this wheel: nothing to learn here
            if "ptxas" not in str(error):
                raise
            pytest.skip(str(error))
        ptx = compiled.asm["ptx"]
        assert "fma.rn.f32" in ptx and "mma" not in ptx, method
        assert "ld.local" not in ptx, method  # no register spills
