"""The bench's parameters, validated once so every mode can trust them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.settings import BENCH_MODEL

STREAMING = "streaming"
REPREFILL = "reprefill"
HF = "hf"
# Streaming sessions fed text cut mid-word (loadtest/bench/text_mode.py); not run by default.
TEXT = "text"
# The order they run in: the others replay streaming's outputs, so streaming always comes first.
MODES = (STREAMING, TEXT, REPREFILL, HF)
DEFAULT_MODES = (STREAMING, REPREFILL, HF)

# Turns after which session 0 samples RSS: early enough to precede most KV growth, late enough to
# follow warm-up allocations. The second sample is taken after the last turn.
RSS_EARLY_TURNS = 50
# RSS may grow by this fraction between the two samples and still count as flat.
RSS_FLAT_TOLERANCE = 0.05
# transformers may legitimately flip a near-tie; more than this fraction of turns differing beyond
# a near-tie means the converted model is not the engine's model, and the bench fails.
HF_MISMATCH_FAIL_FRACTION = 0.05
# A differing greedy choice is a near-tie when streaming's token trails transformers' own choice by
# at most this many units of the dtype's rounding (`torch.finfo(dtype).eps`) of the row's range
# (largest minus smallest logit). Two computations of one model in bf16 part by about that much (on
# the H200, SmolLM2's shape: logits up to 3.0 apart at ~40, 10 units), and bf16 flips many greedy
# choices on random 8B weights (42 of 80 turns, 2026-11-28); a wrongly converted model trails by a
# large share of the range. In float32 the bound is ~2e-6 of the range: the CPU's exact agreement holds.
HF_NEAR_TIE_EPS = 16


@dataclass(frozen=True)
class BenchConfig:
    model: str = BENCH_MODEL
    device: str = "cpu"
    dtype: str = "float32"
    sessions: int = 4
    turns: int = 300
    input_tokens: int = 16
    output_tokens: int = 8
    modes: tuple[str, ...] = DEFAULT_MODES
    # None lets the engine size its KV pool (a fixed byte budget on CPU, free memory on CUDA).
    kv_tokens: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1:
            raise ValueError("sessions and turns must be at least 1")
        if self.input_tokens < 1:
            raise ValueError("input_tokens must be at least 1: a turn without input has nothing to time")
        if self.output_tokens < 0:
            raise ValueError("output_tokens must be >= 0")
        unknown = [mode for mode in self.modes if mode not in MODES]
        if unknown:
            raise ValueError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
        if STREAMING not in self.modes:
            raise ValueError("the streaming mode is required: the other modes replay its token history")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError("a mode is listed twice")
        # Run in the fixed order whatever order they were given in.
        object.__setattr__(self, "modes", tuple(mode for mode in MODES if mode in self.modes))

    @property
    def session_tokens(self) -> int:
        """Length of a session's sequence after its last turn (the context every mode must hold)."""
        return self.turns * (self.input_tokens + self.output_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "sessions": self.sessions,
            "turns": self.turns,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "modes": list(self.modes),
            "kv_tokens": self.kv_tokens,
            "seed": self.seed,
        }
