"""The block dot-product kernels (worker/model/block_dot.c): GGUF's Q4_0/Q4_1 (q4 x q8) and Q8_0
(q8 x q8) blocks as stored against activations quantised per row and group of 32, held to a
reference that quantises the activations the same way and multiplies in float64; rows independent
of their batch and of the thread count."""

from __future__ import annotations

import platform
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from worker.model.block_dot import (
    GROUP,
    KERNELS,
    TILE,
    UNAVAILABLE_REASON,
    block_dot_available,
    block_dot_vnni,
)
from worker.model.linear_q4q8 import Q4Q8Linear
from worker.model.linear_q8q8 import Q8Q8Linear
from worker.model.presets import smollm2_gguf_path
from worker.model.stored import StoredTensor

Q = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(not block_dot_available(), reason=f"no block kernels: {UNAVAILABLE_REASON}")


def _stored(kind: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int) -> StoredTensor:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return StoredTensor(kind, gguf.quants.quantize(values, kind), cols)


def _one_level(x: torch.Tensor) -> torch.Tensor:
    """Per row and group of 32: d = max |x| / 127, q = round(x / d); returns d q."""
    groups = x.reshape(x.shape[0], -1, GROUP)
    d = groups.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse[..., None])  # round half to even, as the kernel's nearbyintf
    return (q * d[..., None]).reshape(x.shape)


# block_dot.c's OUTLIER_RATIO: a group whose largest |value| exceeds 8 times its mean gets a second level.
_OUTLIER_RATIO = 8


def _quantised_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: one int8 level per group of 32, and in a group with an outlier a
    second level quantising what the first left."""
    x = x.float()
    high = _one_level(x)
    groups = x.abs().reshape(x.shape[0], -1, GROUP)
    outlier = groups.amax(-1) * GROUP > _OUTLIER_RATIO * groups.sum(-1)
    low = _one_level(x - high).reshape(groups.shape) * outlier[..., None]
    return high.double() + low.reshape(x.shape).double()


def _with_outliers(x: torch.Tensor) -> torch.Tensor:
    """x with one value in every third group 200 times the rest: those groups take the second level."""
    x = x.clone()
    x[:, ::96] *= 200
    return x


def _held_to_reference(linear: Q4Q8Linear | Q8Q8Linear, weight: torch.Tensor, x: torch.Tensor) -> None:
    want = _quantised_activations(x) @ weight.double().T
    got = linear(x)
    # Only the float32 sums' order differs from the float64 reference: a misplaced nibble or scale
    # would be off by a quantisation step (~1/15 of a group's range).
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_kernel
@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("rows", [96, 100])  # 100: the last tile of 8 padded with zero rows
def test_stored_q4_blocks_multiply_as_their_dequantised_values(
    kind: gguf.GGMLQuantizationType, rows: int
) -> None:
    stored = _stored(kind, rows, 256, seed=rows + kind.value)
    linear = Q4Q8Linear.from_stored(stored, None)
    x = _with_outliers(torch.randn(13, 256, generator=torch.Generator().manual_seed(1)))
    _held_to_reference(linear, stored.dequantize(), x)
    assert linear.out_features == rows
    # Q4_1's 20 bytes a group as stored; Q4_0's 18 plus its m (2); up to 7 zero rows of padding.
    assert linear.num_bytes <= stored.num_bytes * 1.2


@needs_kernel
@pytest.mark.parametrize("rows", [96, 100])
def test_stored_q8_0_blocks_multiply_as_their_dequantised_values(rows: int) -> None:
    stored = _stored(Q.Q8_0, rows, 256, seed=rows)
    linear = Q8Q8Linear.from_stored(stored, None)
    x = _with_outliers(torch.randn(13, 256, generator=torch.Generator().manual_seed(1)))
    _held_to_reference(linear, stored.dequantize(), x)
    assert linear.out_features == rows
    assert linear.num_bytes <= stored.num_bytes * 1.1  # Q8_0's 34 bytes a group; padding rows


@needs_kernel
def test_a_float_matrix_is_quantised_into_q4_1_groups_with_float16_scales() -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(64, generator=torch.Generator().manual_seed(3))
    linear = Q4Q8Linear.from_float(weight, bias)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(4))
    q41 = StoredTensor(Q.Q4_1, gguf.quants.quantize(weight.numpy(), Q.Q4_1), 128).dequantize()
    exact = x @ weight.T + bias
    # As close to the float matrix as llama.cpp's own Q4_1 of it, plus the activations' 8 bits.
    error = float((linear(x) - exact).norm() / exact.norm())
    assert error < 1.5 * float((x @ q41.T + bias - exact).norm() / exact.norm()) + 2e-2


@needs_kernel
@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0])
def test_a_row_is_the_same_alone_batched_and_on_any_thread_count(kind: gguf.GGMLQuantizationType) -> None:
    """The engine's promise (streamed = sent whole, alone = batched) needs row-independent products."""
    stored = _stored(kind, 168, 576, seed=5)
    linear = Q4Q8Linear.from_stored(stored, None) if kind == Q.Q4_1 else Q8Q8Linear.from_stored(stored, None)
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(6))
    x = _with_outliers(x * torch.linspace(0.1, 30, 37)[:, None])  # rows of very different ranges
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batched = linear(x)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(37)])
        pieces = torch.cat([linear(x[:3]), linear(x[3:7]), linear(x[7:])])
        torch.set_num_threads(2)
        two_threads = linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, alone) and torch.equal(batched, pieces) and torch.equal(batched, two_threads)


@pytest.mark.skipif(not block_dot_vnni(), reason="this CPU has no AVX-512 VNNI (or no block kernels)")
@pytest.mark.parametrize("out", [16, 24, 200])  # pairs of tiles, and a last odd tile on the AVX2 path
def test_the_vnni_path_gives_the_avx2_paths_bits(out: int) -> None:
    """A worker's tokens must not depend on its CPU's instruction set: a session copied between two
    workers, one with AVX-512 VNNI, continues as it would have on either."""
    assert KERNELS is not None
    linear = Q4Q8Linear.from_stored(_stored(Q.Q4_1, out, 576, seed=out), None)
    padded = linear.packed.shape[0] * TILE
    for rows in (3, 4, 8, 9, 17):
        x = _with_outliers(torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)))
        for threads in (1, 2):
            y = {vnni: torch.empty(rows, padded) for vnni in (False, True)}
            for vnni, into in y.items():
                args = (linear.packed.data_ptr(), linear.scales.data_ptr(), padded, into.data_ptr(), threads)
                KERNELS.q4_linear(x.data_ptr(), rows, 576, *args, vnni)
            assert torch.equal(y[False], y[True]), (rows, threads)


@needs_kernel
@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0])
def test_a_nan_activation_is_read_as_zero(kind: gguf.GGMLQuantizationType) -> None:
    # A broken checkpoint's NaN is quantised as a 0 (not as the packs' saturated -128, nor as a sum of
    # |v| that loses its group's outlier level): the output, every row, is the one with a 0 there.
    stored = _stored(kind, 24, 128, seed=5)
    linear = Q4Q8Linear.from_stored(stored, None) if kind == Q.Q4_1 else Q8Q8Linear.from_stored(stored, None)
    x = _with_outliers(torch.randn(3, 128, generator=torch.Generator().manual_seed(5)))
    zeroed, broken = x.clone(), x.clone()
    zeroed[1, 5] = 0.0
    broken[1, 5] = float("nan")
    assert torch.equal(linear(broken), linear(zeroed))


@needs_kernel
def test_zero_rows_and_no_rows() -> None:
    linear = Q4Q8Linear.from_stored(_stored(Q.Q4_0, 16, 64, seed=7), None)
    assert torch.equal(linear(torch.zeros(2, 64)), torch.zeros(2, 16))  # a zero group's scale is 0, not 0/0
    assert linear(torch.zeros(0, 64)).shape == (0, 16)


def test_blocks_no_kernel_takes_are_refused() -> None:
    with pytest.raises(ValueError, match="no q4 x q8 kernel takes Q8_0"):
        Q4Q8Linear.from_stored(_stored(Q.Q8_0, 8, 64, seed=8), None)
    with pytest.raises(ValueError, match="no q8 x q8 kernel takes Q4_1"):
        Q8Q8Linear.from_stored(_stored(Q.Q4_1, 8, 64, seed=8), None)


@needs_kernel
def test_a_float_matrix_is_quantised_into_q8_0_groups_with_float16_scales() -> None:
    weight = torch.randn(40, 128, generator=torch.Generator().manual_seed(10))
    q80 = StoredTensor(Q.Q8_0, gguf.quants.quantize(weight.numpy(), Q.Q8_0), 128)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(11))
    # Q8_0's rule exactly: the same values as llama.cpp's quantiser gives the matrix.
    _held_to_reference(Q8Q8Linear.from_float(weight, None), q80.dequantize(), x)


def test_the_kernel_is_built_where_the_cpu_runs_it() -> None:
    """`pip install` builds the extension (pyproject's ext-modules); optional, so a failed build would
    silently serve int4 through torch's slower kernel: on an AVX2 x86 machine it must be there."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= set(flags):
        pytest.skip("not an x86 CPU with AVX2, FMA and F16C")
    assert block_dot_available(), UNAVAILABLE_REASON


@needs_kernel
def test_smollm2_q4_1_and_q8_0_matrices_multiply_as_their_dequantised_values() -> None:
    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    x = _with_outliers(torch.randn(5, 1536, generator=torch.Generator().manual_seed(9)))
    for name in ("blk.0.ffn_down.weight", "blk.29.ffn_down.weight"):
        tensor = tensors[name]
        assert tensor.tensor_type == Q.Q4_1
        stored = StoredTensor(tensor.tensor_type, tensor.data, int(tensor.shape[0]))
        _held_to_reference(Q4Q8Linear.from_stored(stored, None), stored.dequantize(), x)
    embed = tensors["token_embd.weight"]  # the tied output projection, Q8_0
    assert embed.tensor_type == Q.Q8_0
    stored = StoredTensor(embed.tensor_type, embed.data, int(embed.shape[0]))
    _held_to_reference(Q8Q8Linear.from_stored(stored, None), stored.dequantize(), x[:, :576])
