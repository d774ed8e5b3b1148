"""A streaming session: its whole token sequence, which prefix of it has KV, and its page tables.

Invariants (the engine thread is the only writer; the pages are worker/engine/memory/manager.py's):
- `tokens[:num_cached]` have their KV in `pages`, at position p in page `pages[p // page_size]`,
  or, while the session is parked on the host tier, in `host_pages` the same way, after the leading
  run of shared prefix pages that stays in `pages` (often none).
- `len(pages) * page_size >= num_cached`; pages beyond that are reserved for the active turn.
- A leading run of `pages` may be the prefix cache's, shared with other sessions: full pages
  wholly before `num_cached - 1`, never written by this session (worker/engine/memory/prefix_cache.py).
  Likewise a run of `host_pages` (first after `pages`) may be host copies of such pages, shared
  with other parked sessions (worker/engine/memory/host_prefix.py).
- Tokens past `num_cached` are fed by the next forward: the rest of an append that did not fit
  one step, or the last sampled token, which gets its KV at the start of the next append.
- At most one turn is `active`; `pending` turns wait in `seq` order.
- `tail` holds text whose tokens could still change; none of it is in `tokens`.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from shared.protocol.messages import OpenConfig
from worker.engine.sampling import SamplingParams
from worker.engine.turn import Turn
from worker.engine.turn_ends import TurnEnds
from worker.tokenizer.incremental import EMPTY_TAIL, TextTail

if TYPE_CHECKING:  # annotations only: worker/engine/grammar.py imports xgrammar at the first grammar
    import xgrammar as xgr


class Session:
    def __init__(
        self,
        session_id: str,
        config: OpenConfig,
        *,
        history: list[int],
        now: float,
        seed: int | None,
        context_limit: int,
        accepted_seq: int | None = None,
        tail: TextTail = EMPTY_TAIL,
        grammar: Future[xgr.CompiledGrammar] | None = None,
    ) -> None:
        self.session_id = session_id
        self.config = config
        # The grammar of the config's `response_format`: every turn's unless it brings its own.
        self.grammar = grammar
        # The longest this session's sequence may grow (worker/engine/memory/window.py), fixed at open.
        self.context_limit = context_limit
        self.tokens: list[int] = history
        self.num_cached = 0
        self.pages: list[int] = []
        self.host_pages: list[int] = []
        # The next append recomputes KV that existed once (dropped under pressure, or a history
        # given at open or restore): counted as a recompute when it happens.
        self.recompute = bool(history)
        self.active: Turn | None = None
        self.pending: deque[Turn] = deque()
        # The last chunk seq this session accepted (None: none yet, so any seq may start it); chunks
        # must pass it. A restored session starts from the last seq its old worker finished.
        self.accepted_seq = accepted_seq
        # Text received but not yet safe to tokenize (worker/tokenizer/incremental.py). A restored
        # session starts from the text its old worker held back (worker/server/restore.py).
        self.tail: TextTail = tail
        self.last_activity = now
        # Where the recent finished turns end (worker/engine/turn_ends.py): what a rewind goes back to.
        self.ends = TurnEnds()
        # Per-session sampling stream: a session samples the same whatever it is batched with. With
        # no seed it is the session id's: the same session samples the same on every worker.
        if seed is None:
            seed = int.from_bytes(session_id.encode()[:8].ljust(8, b"\0"), "little")
        self.generator = torch.Generator().manual_seed(seed)

    def sampling_params(self) -> SamplingParams:
        """How the active turn's next token is sampled."""
        c, turn = self.config, self.active
        return SamplingParams(c.temperature, c.top_k, c.top_p, logprobs=turn is not None and turn.logprobs)

    @property
    def uncached(self) -> int:
        return len(self.tokens) - self.num_cached

    @property
    def turns(self) -> list[Turn]:
        """The active turn (if any), then the pending ones, in seq order."""
        return ([self.active] if self.active else []) + list(self.pending)

    @property
    def is_busy(self) -> bool:
        return self.active is not None or bool(self.pending)

    def queued_cost(self) -> tuple[int, int]:
        """(input tokens, output-asking turns) waiting in `pending`: what the queue is bounded by.

        Each chunk costs at least one token, so even empty chunks cannot queue without bound.
        """
        tokens = outputs = 0
        for turn in self.pending:
            tokens += max(len(turn.input_tokens), 1)
            outputs += turn.wants_output
        return tokens, outputs

    def projected_length(self) -> int:
        """The longest the sequence can get once every accepted turn is done."""
        length = len(self.tokens)
        if self.active is not None:
            length += self.active.outstanding_tokens
        for turn in self.pending:
            length += len(turn.input_tokens) + turn.max_output_tokens
        return length
