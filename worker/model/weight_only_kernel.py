# mypy: disable-error-code="no-untyped-def"
# (A Triton kernel's parameters stay unannotated: Triton reads parameter annotations as
# specialisation hints, so the kernel body alone is untyped; everything callable from Python is typed.)
"""The weight-only product `y = x @ W.T (+ bias)` over GGUF-style blocks of 32, as one Triton kernel.

W is held in groups of 32 input values per output row, as GGUF's legacy types store it:
- Q4_0: `w = d * (q - 8)`, q a nibble, d a float16 scale per group;
- Q4_1: `w = d * q + m`, with a float16 minimum m per group as well;
- Q8_0: `w = d * q`, q an int8.
The nibbles keep GGUF's order: byte j of a group holds value j in its low nibble and value j + 16
in its high one. The kernel dequantises each tile in float32 from the stored float16 scales, which
gives exactly the values gguf's reference dequantiser gives (d * q is exact in float32: an 11-bit
by at most 8-bit product; so is `+ m` rounded once, as numpy rounds it), and multiplies them with
the activations (bfloat16, float16 or float32, widened exactly) in float32 arithmetic, no
tensor-core rounding of the weights to bf16/tf32, accumulating in float32, and writes the
activations' dtype. Two ways to multiply a tile, one per process (`Method`):
- `ROWSUM` (the default): 4 rows a program; each K tile's products summed by `tl.sum` on CUDA
  cores. A decode step of one row does 4 rows of arithmetic, not 16.
- `DOT`: 16 rows a program (tl.dot's least), `tl.dot(..., input_precision="ieee")`, which Triton
  lowers to an FMA chain over K. Its dequantised tile serves 16 rows (prefill); a one-row step pays
  for 16.
`python -m loadtest.weight_kernels` times both; the engine uses `DEFAULT_METHOD`.

Row invariance (the engine's promise: a session streamed in micro-turns gives the same tokens as
its history sent whole, so a row's result must not depend on how many rows share its step): every
launch of a method uses the same tile shape whatever M is, runs over K in one fixed order of tiles
from 0 up, never splits K, and is not specialised on the row count. So an output element is
computed by the same instructions in the same order whether its row is alone or one of 300, and
rows past M are masked loads of zero that touch no other row. (Split-K chosen by M, or a tile
shape picked per M, would change the order of the float32 sums, and with it the bits, by batch.)

The same function runs on CUDA tensors compiled by Triton and on CPU tensors under Triton's
interpreter (`InterpretedFunction`, chosen per call by the tensors' device, so no environment
variable has to be set before import): the CPU tests check it against the dequantised reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

GROUP = 32
NUM_WARPS = 4


class Method(IntEnum):
    """How a tile is multiplied (module docstring); the values are the kernel's `use_dot` constant."""

    ROWSUM = 0
    DOT = 1


@dataclass(frozen=True)
class Tile:
    """One method's tile: the same for every M. `block_k` is a multiple of GROUP."""

    block_m: int
    block_n: int
    block_k: int


TILES = {Method.ROWSUM: Tile(4, 16, 64), Method.DOT: Tile(16, 32, 64)}
DEFAULT_METHOD = Method.ROWSUM


class BlockKind(IntEnum):
    """How a group of 32 is stored; the values are the kernel's `KIND` constant."""

    Q4_0 = 0
    Q4_1 = 1
    Q8_0 = 2


def _weight_only_body(  # noqa: PLR0917 (a Triton kernel takes its arguments by position)
    x_ptr,
    q_ptr,
    d_ptr,
    m_ptr,
    bias_ptr,
    y_ptr,
    rows_in,
    cols_out,
    width,
    stride_xm,
    stride_ym,
    kind: tl.constexpr,  # a BlockKind's value: 0 Q4_0, 1 Q4_1, 2 Q8_0
    has_bias: tl.constexpr,
    use_dot: tl.constexpr,
    block_m: tl.constexpr,
    block_n: tl.constexpr,
    block_k: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * block_m + tl.arange(0, block_m)
    cols = pid_n * block_n + tl.arange(0, block_n)
    row_ok = rows < rows_in
    col_ok = cols < cols_out
    groups = width // 32
    acc = tl.full((block_m, block_n), 0.0, tl.float32)  # tl.full: tl.zeros is a jitted helper
    for k0 in range(0, width, block_k):  # one fixed order over K, never split
        k = k0 + tl.arange(0, block_k)
        k_ok = k < width
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        ).to(tl.float32)
        w_ok = k_ok[:, None] & col_ok[None, :]
        group = k // 32
        # The weight tile as [block_k, block_n]: element (k, n) of W.T.
        d = tl.load(d_ptr + cols[None, :] * groups + group[:, None], mask=w_ok, other=0.0).to(tl.float32)
        if kind == 2:
            q8 = tl.load(q_ptr + cols[None, :] * width + k[:, None], mask=w_ok, other=0)
            w = d * q8.to(tl.float32)
        else:
            byte_at = group * 16 + k % 16
            packed = tl.load(q_ptr + cols[None, :] * (width // 2) + byte_at[:, None], mask=w_ok, other=0)
            shift = ((k % 32) // 16 * 4).to(tl.uint8)
            q4 = ((packed >> shift[:, None]) & 15).to(tl.float32)
            if kind == 0:
                w = d * (q4 - 8.0)
            else:
                m = tl.load(m_ptr + cols[None, :] * groups + group[:, None], mask=w_ok, other=0.0)
                w = d * q4 + m.to(tl.float32)
        if use_dot:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:  # [block_m, block_k, block_n] products, each (row, column) summed over its K tile
            # tl.reduce with tl.sum's own combine function, which is what tl.sum runs on the GPU:
            # tl.sum itself is a jitted helper that only an interpreter-wide TRITON_INTERPRET runs.
            acc += tl.reduce(x[:, :, None] * w[None, :, :], 1, tl.standard._sum_combine)
    if has_bias:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


# The row count is not specialised on (Triton would compile M=1 and M % 16 == 0 apart): one
# compiled kernel for every M, so a row's arithmetic cannot depend on its step's size.
_compiled = triton.jit(_weight_only_body, do_not_specialize=["rows_in"])
_interpreted = InterpretedFunction(_weight_only_body)


def weight_only_linear(  # noqa: PLR0917 (the held form's fields, in order)
    x: torch.Tensor,
    kind: BlockKind,
    values: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    method: Method = DEFAULT_METHOD,
) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype. `values`: [N, K/2] uint8 nibbles (Q4_*) or [N, K] int8 (Q8_0);
    `scales` (and Q4_1's `mins`): [N, K/32] float16; `bias`: [N] or None. All on x's device."""
    if x.dim() != 2:
        raise ValueError(f"weight_only_linear takes [tokens, in_features], not {tuple(x.shape)}")
    x = x.contiguous()
    rows, width = x.shape
    out = scales.shape[0]
    if scales.shape[1] * GROUP != width:
        raise ValueError(f"activations have {width} inputs, the weights {scales.shape[1] * GROUP}")
    compiled = x.device.type == "cuda"
    # The interpreter narrows float32 to bfloat16 by truncation, the GPU to nearest: on the CPU the
    # kernel writes float32 and torch rounds it to nearest, so both give the same rounding.
    y = torch.empty((rows, out), dtype=x.dtype if compiled else torch.float32, device=x.device)
    if rows == 0:
        return y.to(x.dtype)
    kernel = _compiled if compiled else _interpreted
    tile = TILES[method]
    grid = (triton.cdiv(rows, tile.block_m), triton.cdiv(out, tile.block_n))
    kernel[grid](
        x,
        values,
        scales,
        scales if mins is None else mins,  # unread unless KIND is Q4_1
        scales if bias is None else bias,  # unread unless HAS_BIAS
        y,
        rows,
        out,
        width,
        x.stride(0),
        y.stride(0),
        kind=int(kind),
        has_bias=bias is not None,
        use_dot=int(method),
        block_m=tile.block_m,
        block_n=tile.block_n,
        block_k=tile.block_k,
        num_warps=NUM_WARPS,
    )
    return y.to(x.dtype)
