"""The `hf` mode: transformers' own KV cache (`past_key_values`) kept across turns, one session at a time.

This is the usual way to hold a conversation's cache with stock transformers: each turn feeds only
its new tokens (the chunk, plus the previous turn's last output, which was sampled but never fed)
and decodes greedily against the cache. It runs every turn, since the cache is built by running
them, and times them all.

Decoding is teacher-forced onto streaming's outputs: the argmax at each step is compared with the
token streaming generated there, and streaming's token is what gets fed. When the two agree (the
normal case) this is plain greedy decoding; when transformers flips a near-tie, the mismatch is
counted and the session still carries the shared history, so later turns stay comparable.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from loadtest.bench.config import HF, BenchConfig
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

    def feed(self, tokens: list[int]) -> int:
        """Append `tokens` to the cache; return the greedy choice after the last of them."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, **self._only_last)
        self.cache = out.past_key_values
        return int(out.logits[0, -1].argmax())

    def turn(self, chunk: list[int], forced: tuple[int, ...]) -> tuple[int, ...]:
        """Feed `chunk`, then decode len(forced) tokens, feeding `forced` (all but its last) back in."""
        if not forced:
            self.feed(chunk)
            return ()
        generated = [self.feed(chunk)]
        for token in forced[:-1]:
            generated.append(self.feed([token]))
        return tuple(generated)


def run_hf(loaded: LoadedModel, workload: Workload, config: BenchConfig) -> ModeRun:
    run = ModeRun.empty(HF, sessions=config.sessions, turns=config.turns)
    model = to_hf_llama(loaded)
    began = time.perf_counter()
    with torch.inference_mode():
        for session in range(config.sessions):
            hf = HfSession(model)
            pending: list[int] = []  # the previous turn's last output: sampled, not yet in the cache
            for turn in range(config.turns):
                expected = workload.outputs(session, turn)
                started = time.perf_counter()
                generated = hf.turn(pending + workload.inputs[session][turn], expected)
                run.turn_ms[turn][session] = (time.perf_counter() - started) * 1000
                run.checked += 1
                if generated != expected:
                    run.mismatches.append((session, turn))
                    logger.info(
                        "hf session %d turn %d chose %s, streaming %s", session, turn, generated, expected
                    )
                pending = list(expected[-1:])
            logger.info("hf: session %d done (%.1f s so far)", session, time.perf_counter() - began)
    run.wall_s = time.perf_counter() - began
    return run
