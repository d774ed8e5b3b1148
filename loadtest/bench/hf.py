"""The `hf` mode: transformers' own KV cache (`past_key_values`) kept across turns, one session at a time.

This is the usual way to hold a conversation's cache with stock transformers: each turn feeds only
its new tokens (the chunk, plus the previous turn's last output, which was sampled but never fed)
and decodes greedily against the cache. It runs every turn, since the cache is built by running
them, and times them all.

Decoding is teacher-forced onto streaming's outputs: the argmax at each step is compared with the
token streaming generated there, and streaming's token is what gets fed. When the two agree (the
normal case) this is plain greedy decoding; when transformers flips a near-tie, the mismatch is
counted and the session still carries the shared history, so later turns stay comparable. Each
differing choice is weighed: where streaming's token trails transformers' choice by no more than the
dtype's rounding explains (config.py, `HF_NEAR_TIE_EPS`), the turn is a near-tie, not a fault.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from loadtest.bench.config import HF, HF_NEAR_TIE_EPS, BenchConfig
from loadtest.bench.hf_model import to_hf_llama
from loadtest.bench.results import ModeRun
from loadtest.bench.workload import Workload
from worker.model.loader import LoadedModel

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

logger = logging.getLogger(__name__)


class HfSession:
    """One conversation held in a transformers cache."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache: Any = None
        # Only the last position's logits are needed; older transformers call the option differently.
        parameters = inspect.signature(model.forward).parameters
        self._only_last: dict[str, int] = (
            {"logits_to_keep": 1}
            if "logits_to_keep" in parameters
            else {"num_logits_to_keep": 1}
            if "num_logits_to_keep" in parameters
            else {}
        )

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens` to the cache; return the logits after the last of them."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, **self._only_last)
        self.cache = out.past_key_values
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def turn(self, chunk: list[int], forced: tuple[int, ...]) -> tuple[tuple[int, ...], float]:
        """Feed `chunk`, then decode len(forced) tokens, feeding `forced` (all but its last) back in.
        Returns the greedy choices and, of the positions where one differs from `forced`, the
        largest `trailing` of the forced token (0.0 when none differs). Each choice is read before
        the next token is fed, as a greedy loop must: the timing stays that of one."""
        if not forced:
            self.feed(chunk)
            return (), 0.0
        generated: list[int] = []
        worst = 0.0
        feeds = [chunk, *([token] for token in forced[:-1])]  # each choice's input
        for want, tokens in zip(forced, feeds, strict=True):
            logits = self.feed(tokens)
            choice = int(logits.argmax())
            generated.append(choice)
            if choice != want:
                worst = max(worst, trailing(logits, want))
        return tuple(generated), worst


def trailing(logits: torch.Tensor, token: int) -> float:
    """How far `token`'s logit trails the row's largest, as a share of the row's range (largest
    minus smallest). Infinite where the row cannot say: a logit not finite, every logit equal (a
    broken model ties everything), or a token outside the row."""
    row = logits.float()
    if not 0 <= token < row.numel() or not bool(torch.isfinite(row).all()):
        return math.inf
    top = row.max()
    spread = top - row.min()
    if float(spread) == 0.0:
        return math.inf
    return float((top - row[token]) / spread)


def near_tie_bound(dtype: torch.dtype) -> float:
    """The `trailing` up to which a differing choice is a near-tie in `dtype` (config.py)."""
    return HF_NEAR_TIE_EPS * torch.finfo(dtype).eps


def run_hf(loaded: LoadedModel, workload: Workload, config: BenchConfig) -> ModeRun:
    run = ModeRun.empty(HF, sessions=config.sessions, turns=config.turns)
    model = to_hf_llama(loaded)
    bound = near_tie_bound(next(model.parameters()).dtype)
    began = time.perf_counter()
    with torch.inference_mode():
        for session in range(config.sessions):
            hf = HfSession(model)
            pending: list[int] = []  # the previous turn's last output: sampled, not yet in the cache
            for turn in range(config.turns):
                expected = workload.outputs(session, turn)
                started = time.perf_counter()
                generated, worst = hf.turn(pending + workload.inputs[session][turn], expected)
                run.turn_ms[turn][session] = (time.perf_counter() - started) * 1000
                run.checked += 1
                if generated != expected:
                    run.mismatches.append((session, turn))
                    if worst <= bound:
                        run.near_ties.append((session, turn))
                    logger.info(
                        "hf session %d turn %d chose %s, streaming %s (its tokens trail by up to %.2g of "
                        "the logits' range; a near-tie up to %.2g)",
                        session,
                        turn,
                        generated,
                        expected,
                        worst,
                        bound,
                    )
                pending = list(expected[-1:])
            logger.info("hf: session %d done (%.1f s so far)", session, time.perf_counter() - began)
    run.wall_s = time.perf_counter() - began
    return run
