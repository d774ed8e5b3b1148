"""Next-token choice: greedy, or temperature with top-k / top-p, from each session's own generator.

A constrained row (structured output, worker/engine/grammar.py) has its logits masked to the
tokens its grammar allows before anything else, so greedy, top-k/top-p and logprobs all see the
constrained distribution; an unconstrained row's logits are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.engine.grammar import apply_masks

if TYPE_CHECKING:  # annotations only: worker/engine/grammar.py imports xgrammar at the first grammar
    import xgrammar as xgr


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    matchers: Sequence[xgr.GrammarMatcher | None] = (),
) -> tuple[list[int], list[float | None]]:
    """One token per row of fp32 `logits` [rows, vocab]; logprobs are of the unscaled distribution
    (masked first for the rows with a grammar `matchers[row]`; an empty `matchers`: none has one)."""
    if matchers:
        apply_masks(logits, matchers)
    chosen = logits.argmax(dim=-1)
    for row, p in enumerate(params):
        if not p.greedy:
            chosen[row] = _sample_row(logits[row], p, generators[row])
    tokens = chosen.tolist()
    logprobs: list[float | None] = [None] * len(params)
    wanted = [row for row, p in enumerate(params) if p.logprobs]
    if wanted:
        index = torch.tensor(wanted)
        picked = (
            torch.log_softmax(logits[index], dim=-1).gather(1, chosen[index].unsqueeze(1)).squeeze(1).tolist()
        )
        for row, value in zip(wanted, picked, strict=True):
            logprobs[row] = value
    return tokens, logprobs


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    scaled = logits / p.temperature
    if p.top_k is not None and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p is not None and p.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        drop = cumulative - torch.softmax(ordered, dim=-1) >= p.top_p
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device).squeeze(0)
