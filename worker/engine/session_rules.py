"""How the engine runs one session's turns, for a worker that replays them outside the engine.

A restoring worker re-commits delivered text chunks and re-cuts the window turn by turn
(worker/server/restore.py), and a copy is rebuilt with the window the engine would open it with
(worker/server/warm.py). Both must apply exactly the engine's rules, so the engine hands them out
whole (`Engine.session_rules`): the server imports neither the admission nor the window module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.protocol.messages import OpenConfig
from shared.store.log_format import Cut
from worker.engine.admission import commit_chunk, flushes
from worker.engine.memory.window import cut_before
from worker.tokenizer.incremental import IncrementalTokenizer, TextTail


@dataclass(frozen=True)
class SessionRules:
    # The config as the engine runs it (`keep_prefix_tokens` counting `keep_prefix_text`'s tokens).
    config: OpenConfig
    # The longest sequence the session may reach (worker/engine/memory/window.py `session_limit`).
    limit: int
    # The engine's incremental tokenizer (None: the model has none, chunks carry tokens).
    text: IncrementalTokenizer | None = None
    # The tokens of the session's `keep_prefix_text`: a fresh session opens with them.
    prefix: tuple[int, ...] = ()

    def commit(
        self, tail: TextTail, *, text: str | None, tokens: Sequence[int], flush: bool, max_output_tokens: int
    ) -> tuple[list[int], TextTail]:
        """(the tokens a chunk appends, the text tail after it), exactly as admission commits them."""
        flush = flushes(text=text, flush=flush, max_output_tokens=max_output_tokens)
        return commit_chunk(self.text, tail, text=text, tokens=tokens, flush=flush)

    def cut_before(self, length: int, grows_by: int) -> Cut | None:
        """The cut a turn adding `grows_by` tokens to a history of `length` makes before it runs."""
        return cut_before(length, grows_by, self.config, self.limit)
