"""Rotary position embeddings (rotate-half convention, as in HF Llama), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch

from worker.model.config import Llama3RopeScaling, ModelConfig


def inverse_frequencies(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to the model's context, built once at load."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        # sin with its first half negated: rotate-half's sign, folded into the table (exact).
        half = config.head_dim // 2
        self.signed_sin = torch.cat([-angles[:, :half].sin(), angles[:, half:].sin()], dim=-1).to(
            device=device, dtype=dtype
        )

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for these positions, [tokens, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1]: the swapped halves times the
    signed sin give the same products bit for bit (a sign flip is exact), in fewer operations."""
    out = x * cos
    out += x.roll(x.shape[-1] // 2, -1) * signed_sin
    return out
