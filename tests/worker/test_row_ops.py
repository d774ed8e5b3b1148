"""The decoder's row-wise ops (worker/model/row_ops.py, row_ops_native.py, row_ops.c): the native ops
give torch's bits where they share torch's operations (the residual add, the rotation), torch's
values within float32's rounding elsewhere (the norm), every row the same alone or in a batch; the
model takes them for the quantised forms only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from worker.model.llama import choose_row_ops
from worker.model.presets import TINY
from worker.model.rope import RotaryEmbedding
from worker.model.row_ops import TorchRowOps
from worker.model.row_ops_native import OPS, UNAVAILABLE_REASON, NativeRowOps, native_row_ops_available

needs_ops = pytest.mark.skipif(
    not native_row_ops_available(), reason=f"no native row ops: {UNAVAILABLE_REASON}"
)

# SmolLM2-135M's widths (9 query heads, 3 key/value heads of 64).
CONFIG = replace(TINY, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
CPU = torch.device("cpu")


def _random(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@needs_ops
@pytest.mark.parametrize("rows", [1, 3, 16, 65])
def test_the_residual_add_and_the_rotation_give_torchs_bits(rows: int) -> None:
    native, reference = NativeRowOps(CONFIG), TorchRowOps(CONFIG)
    x, y, weight = _random(rows, 576, seed=1), _random(rows, 576, seed=2), _random(576, seed=3)
    assert torch.equal(native.add_norm(x.clone(), y, weight)[0], x + y)

    qkv = _random(rows, 960, seed=4, scale=3.0)
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(5))
    cos, sin = RotaryEmbedding(CONFIG, dtype=torch.float32, device=CPU).tables(positions)
    rotated = native.rotate(qkv.clone(), cos, sin)
    for mine, theirs in zip(rotated, reference.rotate(qkv, cos, sin), strict=True):
        assert mine.shape == theirs.shape
        assert torch.equal(mine, theirs)


@needs_ops
@pytest.mark.parametrize("rows", [1, 16])
def test_the_norm_is_torchs_value_within_rounding(rows: int) -> None:
    native = NativeRowOps(CONFIG)
    x, y, weight = _random(rows, 576, seed=6), _random(rows, 576, seed=7), _random(576, seed=8)
    expected = F.rms_norm((x + y).double(), (576,), weight.double(), CONFIG.rms_norm_eps)
    _, normed = native.add_norm(x.clone(), y, weight)
    torch.testing.assert_close(normed.double(), expected, rtol=1e-6, atol=1e-6)
    expected = F.rms_norm(x.double(), (576,), weight.double(), CONFIG.rms_norm_eps)
    torch.testing.assert_close(native.norm(x, weight).double(), expected, rtol=1e-6, atol=1e-6)


@needs_ops
def test_a_row_gets_the_same_bits_alone_or_in_a_batch() -> None:
    """The engine's promise: a session's tokens do not depend on the rows computed with its own."""
    native = NativeRowOps(CONFIG)
    x, y, weight = _random(16, 576, seed=10), _random(16, 576, seed=11), _random(576, seed=12)
    _, batch_norm = native.add_norm(x.clone(), y, weight)
    for row in (0, 7, 15):
        _, alone = native.add_norm(x[row : row + 1].clone(), y[row : row + 1], weight)
        assert torch.equal(alone[0], batch_norm[row])


@needs_ops
def test_a_nan_stays_nan() -> None:
    """A broken activation shows as NaN downstream, as with torch's ops, never as a finite value."""
    native = NativeRowOps(CONFIG)
    x = torch.ones(1, 576)
    x[0, 0] = float("nan")
    assert torch.isnan(native.norm(x, torch.ones(576))).all()


@needs_ops
def test_the_extension_refuses_shapes_it_does_not_take() -> None:
    assert OPS is not None
    with pytest.raises(ValueError, match="add_rms_norm: bad shape"):
        OPS.add_rms_norm(0, 0, 0, 1e-5, 0, 1, 575)  # not whole lanes of 8
    with pytest.raises(ValueError, match="rotate: bad shape"):
        OPS.rotate(0, 1, 64, 2, 64, 0, 0)  # two heads of 64 do not fit a row of 64


def test_the_float_form_keeps_torchs_ops_and_the_quantised_forms_take_the_native_ones() -> None:
    """`float`'s parity with transformers rests on torch's bits; the quantised forms are not held to them."""
    assert isinstance(choose_row_ops(CONFIG, "float", device=CPU, dtype=torch.float32), TorchRowOps)
    assert isinstance(choose_row_ops(CONFIG, "int4", device=CPU, dtype=torch.bfloat16), TorchRowOps)
    quantised = choose_row_ops(CONFIG, "int4", device=CPU, dtype=torch.float32)
    assert isinstance(quantised, NativeRowOps if native_row_ops_available() else TorchRowOps)
