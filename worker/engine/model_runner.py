"""Turns a scheduled batch into tensors, runs one forward, and samples the rows that need it.

The only engine module that touches the device. Per step it builds the attention metadata once
(every layer reuses it) and computes logits only at the sampled positions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.settings import EngineSettings
from worker.attention import paged_attention
from worker.attention.base import AttentionMetadata, paged_metadata
from worker.attention.kv_dtype import KVForm
from worker.engine.sampling import SamplingParams, sample
from worker.model.llama import LlamaModel
from worker.model.loader import LoadedModel
from worker.numerics import MKL_CBWR, blas_is_row_invariant

if TYPE_CHECKING:  # annotations only: worker/engine/grammar.py imports xgrammar at the first grammar
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# On CPU a small step (few tokens, short contexts) is faster on one intra-op thread: waking the
# OpenMP team costs more than splitting a few small matmuls saves, and on a machine shared with
# other processes (the gateway, other workers) a second thread mostly spins waiting for a core.
# Long appends, and decode over long contexts (bound by reading the KV), use every core. The token
# bound is the `cpu_single_thread_max_tokens` setting (256: measured on 2 cores with `tiny`;
# SmolLM2 re-measured in docs/benchmarks.md, "The single-thread rule").
CPU_SINGLE_THREAD_MAX_CONTEXT = 4096


@dataclass(frozen=True)
class ForwardRow:
    token_ids: Sequence[int]  # the tokens fed this step
    start: int  # position of the first of them (= tokens already cached)
    pages: Sequence[int]  # the session's page table, covering start + len(token_ids)
    sampling: SamplingParams | None  # None: no token is sampled after this row
    generator: torch.Generator | None
    # The active turn's grammar when its output is constrained (worker/engine/grammar.py).
    grammar: xgr.GrammarMatcher | None = None


@dataclass(frozen=True)
class SampledToken:
    token: int
    logprob: float | None


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int,
        kv_form: KVForm | None = None,
        page_size: int,
        attention: str,
        single_thread_max_tokens: int = EngineSettings.cpu_single_thread_max_tokens,
    ) -> None:
        config = loaded.config
        self.single_thread_max_tokens = single_thread_max_tokens
        self.config = config
        self.device = device
        self.page_size = page_size
        self.cpu_threads = torch.get_num_threads()
        self.model = LlamaModel(config, loaded.weights, device=device, dtype=dtype)
        kv_form = kv_form or KVForm(dtype)
        shape = kv_form.attention_shape(config, device=device, dtype=dtype, page_size=page_size)
        self.attention = paged_attention(attention, shape, num_layers=config.num_layers, num_pages=num_pages)
        self.attention_name = self.attention.name
        self.kv_pool = self.attention.kv_pool
        if device.type == "cpu" and not blas_is_row_invariant():
            logger.warning(
                "MKL sums a row differently by the step's shape (%s was not in force when it first ran): "
                "a session streamed in micro-turns may differ in the last bits from its history sent whole",
                MKL_CBWR,
            )
        logger.info(
            "KV pool: %d pages x %d tokens of %s (%.1f MiB), attention backend %s",
            num_pages,
            page_size,
            kv_form.name,
            self.kv_pool.num_bytes / 2**20,
            self.attention_name,
        )

    def metadata(self, rows: Sequence[ForwardRow]) -> AttentionMetadata:
        """The step's attention metadata, built on the host from the rows' page tables."""
        q_lens = [len(row.token_ids) for row in rows]
        return paged_metadata(
            [row.start for row in rows], q_lens, [row.pages for row in rows], self.page_size
        )

    def close(self) -> None:
        """Give torch back the thread count it had: the per-step choice is process-global."""
        torch.set_num_threads(self.cpu_threads)

    @torch.inference_mode()
    def step(self, rows: Sequence[ForwardRow]) -> list[SampledToken | None]:
        """One forward over `rows`; writes their KV and returns a token for every sampling row."""
        meta = self.metadata(rows)
        num_tokens = len(meta.positions)
        if self.device.type == "cpu":
            small = num_tokens <= self.single_thread_max_tokens
            small = small and sum(meta.kv_lens) <= CPU_SINGLE_THREAD_MAX_CONTEXT
            wanted = 1 if small else self.cpu_threads
            if torch.get_num_threads() != wanted:
                torch.set_num_threads(wanted)
        sampled_rows = [i for i, row in enumerate(rows) if row.sampling is not None]
        # The step's inputs reach the device in one copy: token ids, positions, and the index of
        # every sampled row's last token.
        row_starts = meta.qo_indptr.tolist()
        last_tokens = [row_starts[i + 1] - 1 for i in sampled_rows]
        host = torch.cat(
            [
                torch.tensor([t for row in rows for t in row.token_ids], dtype=torch.int64),
                meta.positions,
                torch.tensor(last_tokens, dtype=torch.int64),
            ]
        )
        on_device = host.to(self.device)
        input_ids, positions = on_device[:num_tokens], on_device[num_tokens : 2 * num_tokens]
        self.attention.plan(meta)
        hidden = self.model.forward(input_ids, positions, self.attention)

        results: list[SampledToken | None] = [None] * len(rows)
        if not sampled_rows:
            return results
        logits = self.model.logits(hidden[on_device[2 * num_tokens :]])
        params = [p for p in (rows[i].sampling for i in sampled_rows) if p is not None]
        generators = [g for g in (rows[i].generator for i in sampled_rows) if g is not None]
        matchers = [rows[i].grammar for i in sampled_rows]
        tokens, logprobs = sample(
            logits, params, generators, matchers if any(m is not None for m in matchers) else ()
        )
        for i, token, logprob in zip(sampled_rows, tokens, logprobs, strict=True):
            results[i] = SampledToken(token, logprob)
        return results
