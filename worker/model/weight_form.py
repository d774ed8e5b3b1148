"""How the model's matrices are held and multiplied: the `--weights` setting, resolved once at load.

- `float`: every matrix dequantised to the model's dtype and multiplied by `F.linear` (the path
  the exactness tests against transformers run).
- `int4`: GGUF Q4_0/Q4_1 matrices served from their stored nibbles and float16 scales; on a CPU
  with AVX2 (and the `_q4q8` extension built) by integer dot products against activations quantised
  per row and group of 32, as llama.cpp does (linear_q4q8.py), elsewhere by torch's packed int4
  kernel with bfloat16 activations (linear_int4.py); 8-bit and
  float matrices (Q8_0, F16, a safetensors checkpoint's) as int8; any other stored type is refused,
  since no kernel here takes it and requantising it to 4 bits would lose what the file kept. The
  output projection stays 8-bit (`output_projection`).
- `int8`: every matrix at 8 bits (`int8_linear`): where the block kernels run, Q8_0 groups of 32 (a
  stored Q8_0 matrix as it is) through the q8 x q8 kernel (linear_q8q8.py), elsewhere requantised
  to int8 per row (linear_int8.py).
- `auto`: the fastest form that keeps the engine's promises on this device: `int4` on the CPU for a
  GGUF file whose matrices are Q4_0/Q4_1 (the rest at 8 bits or more), else `float`. A quantised
  form must (1) give a session streamed in micro-turns the same tokens as its history sent whole,
  and (2) agree with the float path's greedy tokens at least as often as llama.cpp does. `int4`
  holds both (docs/benchmarks.md, "Weight forms"): (1) bit for bit, since every step computes a
  row the same way whatever the step's shape (the int4 kernel's rows are independent, the torch
  attention backend takes one path for every row count, and worker/numerics.py keeps MKL's sums
  shape-independent); (2) measured 2026-11-27 (`python -m loadtest.weight_quality`): with torch's
  int4 kernel (AVX-512 VM, load 3-6) greedy 226/240 on the peer workload and 165/240 on six chat
  prompts, against llama.cpp's 66/240 and 214/240, and mean |logprob difference| 0.031 against
  0.029; with the block kernels (AVX2 VM: q4 x q8 layers, q8 x q8 output projection, a second
  activation level in outlier groups) 232/240 and 216/240 against llama.cpp's 88/240 and 188/240,
  and mean |logprob difference| 0.012 (at worst 0.11) against llama.cpp's 0.031 (0.27); with the
  native row ops (2026-11-28, Zen 4 VM) 240/240 and 201/240 against llama.cpp's 66/240 and 214/240,
  0.012 (0.10) against 0.029 (0.25), every greedy divergence at a token the float path itself
  chose by under 0.1 logits ("The decoder's row ops in C"); with the KV pool in float16 (`auto`'s
  for the quantised forms, worker/attention/kv_dtype.py; Zen 3 VM) 232/240 and 197/240, 0.012 (0.20),
  the pool's rounding alone moving no float-path token ("The KV pool in float16"); with int8 keys
  (Xeon VM, one run) 232/240 and 179/240, 0.017 (0.19), where float16's were 240/240 and 181/240,
  0.012 (0.11), and llama.cpp's 66/240 and 214/240, 0.029 (0.25) ("On a Xeon VM: int8 keys"); with
  int8 keys and values (`auto`'s pool where the cpu attention kernel serves; Zen 5 VM, one run)
  226/240 and 176/240, 0.017 (0.17), where int8 keys' were 232/240 and 179/240, 0.017 (0.19),
  float16's 232/240 and 197/240, 0.012 (0.20), llama.cpp's 66/240 and 214/240, 0.029 (0.25)
  ("Int8 values"). A float
  checkpoint stays `float` (requantising it is a choice `--weights int4` makes explicitly).
  On CUDA `auto` stays `float` (bf16 `F.linear` on tensor cores): the weight-only kernels read
  4.5-5 bits a weight (Q4_0/Q4_1; Q8_0 8.5) instead of 16, but compute in float32 on CUDA cores
  (not tensor cores) with no split over K, to stay exact and row-invariant, and on the H200 they
  were slower than bf16 at every shape measured: 2.2x (SmolLM2, one row) to 5.7x (Llama-3.1-8B,
  one row), far more at prefill (docs/benchmarks.md, "Weight forms on CUDA").

On CUDA, `int4` and `int8` are weight-only: the GGUF's Q4_0/Q4_1/Q8_0 blocks as stored (others
quantised at load into the same groups of 32, worker/model/weight_form_cuda.py), multiplied by a
Triton kernel that dequantises exactly and computes in float32 (worker/model/weight_only_kernel.py),
with the model's bfloat16, float16 or float32 activations unquantised. On the CPU the quantised
forms compute around float32 activations (`--dtype float32`).

The embedding lookup stays exact in every form on the CPU (embedding.py: the stored rows it looks
up, dequantised); on CUDA it is a dense table in the model's dtype, as under `float`. A tied output
projection gets the form's matrix like any other, but for `int4` on the CPU: 8-bit rows with
bfloat16 activations (`output_projection`).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import torch

from shared.settings import WEIGHT_FORMS
from worker.model.block_dot import UNAVAILABLE_REASON, block_dot_available, block_dot_vnni
from worker.model.embedding import Embedding, FloatEmbedding, StoredEmbedding
from worker.model.linear import FloatLinear, Linear
from worker.model.linear_int4 import INT4_STORED_TYPES, Int4Linear
from worker.model.linear_int8 import Int8Linear, Int8WeightOnlyLinear
from worker.model.linear_q4q8 import Q4Q8Linear
from worker.model.linear_q8q8 import Q8Q8Linear
from worker.model.stored import StoredTensor

logger = logging.getLogger(__name__)

# A tensor as a loader hands it over: a dense float tensor, or a GGUF matrix in its stored blocks.
Source = torch.Tensor | StoredTensor
StoredType = gguf.GGMLQuantizationType

_FLOAT_TYPES = frozenset(
    {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
)
# Stored types at 8 bits or more: served int8 under `int4`, which would otherwise lose precision.
_WIDE_TYPES = _FLOAT_TYPES | {gguf.GGMLQuantizationType.Q8_0}


def int4_kernel() -> type[Q4Q8Linear] | type[Int4Linear]:
    """The CPU's `int4` matrices: the q4 x q8 kernel where it runs (AVX2 and the built extension),
    torch's packed int4 kernel elsewhere."""
    return Q4Q8Linear if block_dot_available() else Int4Linear


def int8_linear(parts: Sequence[Source], bias: torch.Tensor | None) -> Linear:
    """An 8-bit matrix on the CPU: Q8_0 groups through the q8 x q8 kernel where it runs (stored Q8_0
    blocks as they are, anything else quantised into them), else int8 rows through `torch._int_mm`
    (a near-scalar loop on AVX2: docs/benchmarks.md, "Weight forms")."""
    if block_dot_available():
        stored = [p for p in parts if isinstance(p, StoredTensor) and p.kind == StoredType.Q8_0]
        if len(stored) == len(parts):
            return Q8Q8Linear.from_stored(StoredTensor.cat(stored), bias)
        return Q8Q8Linear.from_float(torch.cat([as_float(p).float() for p in parts]), bias)
    return Int8Linear.from_float(torch.cat([as_float(p).float() for p in parts]), bias)


def as_float(source: Source) -> torch.Tensor:
    return source.dequantize() if isinstance(source, StoredTensor) else source


@dataclass(frozen=True)
class WeightForm:
    """A resolved form (`float`, `int8` or `int4`) and where it builds its matrices."""

    name: str
    dtype: torch.dtype
    device: torch.device

    def linear(self, parts: Sequence[Source], bias: torch.Tensor | None, *, what: str) -> Linear:
        """One matrix from `parts` stacked along their rows (fused projections), in this form."""
        if bias is not None:
            bias = bias.to(device=self.device, dtype=self.dtype).contiguous()
        if self.name == "float":
            weight = torch.cat([as_float(p).to(device=self.device, dtype=self.dtype) for p in parts])
            return FloatLinear(weight.contiguous(), bias)
        if self.device.type == "cuda":
            from worker.model.weight_form_cuda import block_linear  # imports triton: CUDA only

            return block_linear(self.name, parts, bias, self.device)
        stored = [p for p in parts if isinstance(p, StoredTensor)]
        if self.name == "int4":
            kinds = {p.kind for p in stored}
            if stored and len(stored) == len(parts) and kinds <= INT4_STORED_TYPES and len(kinds) == 1:
                return int4_kernel().from_stored(StoredTensor.cat(stored), bias)
            refused = sorted(k.name for k in kinds - INT4_STORED_TYPES - _WIDE_TYPES)
            if refused:
                raise ValueError(
                    f"--weights int4: {what} is stored as {', '.join(refused)}, which no int4 kernel "
                    "here takes; use --weights int8 or float"
                )
            if not stored:  # a float checkpoint: quantised at load into Q4_1-like groups
                return int4_kernel().from_float(torch.cat([as_float(p).float() for p in parts]), bias)
        return int8_linear(parts, bias)

    def output_projection(self, source: Source) -> Linear:
        """The output projection (logits of the sampled rows only). Under `int4` on the CPU it is 8-bit
        (never 4: it decides every token): Q8_0 groups through the q8 x q8 kernel where it runs (SmolLM2's
        tied Q8_0 table as stored), else int8 rows with bfloat16 activations (Int8WeightOnlyLinear).
        The first is the nearer to the float path and the faster (docs/benchmarks.md, "Weight forms")."""
        if self.name != "int4" or self.device.type != "cpu":
            return self.linear([source], None, what="the output projection")
        if block_dot_available():
            return int8_linear([source], None)
        return Int8WeightOnlyLinear.from_float(as_float(source).float(), None)

    def kernels(self) -> str:
        """What multiplies this form's matrices here, for the start-up line."""
        if self.name == "float" or self.device.type != "cpu":
            return self.name
        if self.name == "int8":
            if block_dot_available():
                return "int8 (Q8_0 groups, q8 x q8 integer dot products, AVX2)"
            return f"int8 (int8 rows, torch._int_mm: {UNAVAILABLE_REASON})"
        if block_dot_available():
            isa = "AVX2, AVX-512 VNNI from 3 rows" if block_dot_vnni() else "AVX2"
            return f"int4 (q4 x q8 integer dot products, {isa}; 8-bit matrices q8 x q8)"
        return f"int4 (torch's packed int4 kernel: {UNAVAILABLE_REASON})"

    def embedding(self, source: Source) -> Embedding:
        # Stored rows are dequantised on the host as they are looked up: on CUDA that would make
        # every step wait for its token ids to reach the host, so there the table is dense.
        if isinstance(source, StoredTensor) and self.name != "float" and self.device.type == "cpu":
            return StoredEmbedding(source, self.dtype)
        return FloatEmbedding(as_float(source).to(device=self.device, dtype=self.dtype).contiguous())


FLOAT_FORM_NAME = "float"


def resolve_weight_form(
    requested: str, *, device: torch.device, dtype: torch.dtype, stored_types: frozenset[StoredType]
) -> WeightForm:
    """The form `requested` means for this device and checkpoint; a clear start-up error if none.

    `stored_types` are the checkpoint's matrix types as stored (empty for a float checkpoint).
    """
    if requested not in WEIGHT_FORMS:
        raise ValueError(f"--weights {requested!r}: expected one of {', '.join(WEIGHT_FORMS)}")
    name = _auto(device, stored_types) if requested == "auto" else requested
    if name != FLOAT_FORM_NAME and device.type not in ("cpu", "cuda"):
        raise ValueError(f"--weights {name}: no {device.type} kernel yet; use --weights float or auto")
    if name != FLOAT_FORM_NAME and device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ValueError(f"--weights {name} on cuda needs triton (installed with torch's CUDA wheels)")
    if name != FLOAT_FORM_NAME and device.type == "cpu" and dtype != torch.float32:
        raise ValueError(f"--weights {name} computes around float32 activations; use --dtype float32")
    if name == "int4":
        refused = sorted(k.name for k in stored_types - INT4_STORED_TYPES - _WIDE_TYPES)
        if refused:
            raise ValueError(
                f"--weights int4: the checkpoint stores matrices as {', '.join(refused)}, which no int4 "
                "kernel here takes; use --weights int8 or float"
            )
    return WeightForm(name, dtype, device)


def _auto(device: torch.device, stored_types: frozenset[StoredType]) -> str:
    """`int4` where the file's own 4-bit blocks can be served as stored on the CPU, else `float`."""
    servable = stored_types & INT4_STORED_TYPES and not stored_types - INT4_STORED_TYPES - _WIDE_TYPES
    return "int4" if device.type == "cpu" and servable else FLOAT_FORM_NAME
