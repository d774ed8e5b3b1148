"""One micro-turn: a chunk of input tokens and up to k tokens generated after it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.protocol.messages import FinishReason
from shared.store.log_format import Cut
from worker.tokenizer.incremental import EMPTY_TAIL, TextTail

if TYPE_CHECKING:  # annotations only: worker/engine/grammar.py imports xgrammar at the first grammar
    import xgrammar as xgr

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenDelta:
    """One generated token, delivered as soon as it is sampled (for `stream`)."""

    session_id: str
    seq: int
    index: int
    token: int
    logprob: float | None


@dataclass(frozen=True)
class TurnResult:
    session_id: str
    seq: int
    # The chunk's input as it entered the sequence (text is tokenized by the engine): with `tokens`,
    # exactly what this turn appended, in order, for the session's token log. For text, these are
    # the tokens it committed (the held-back tail of earlier text included, its own tail excluded).
    inputs: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    text: str | None
    finish: FinishReason
    queue_ms: float
    compute_ms: float
    # Length of the session's sequence once this turn is done (inputs and outputs so far).
    length: int
    # The session's uncommitted text right after this turn's input was committed (not the
    # session's tail now: later chunks may have been admitted since). Logged with the turn, so a
    # session rebuilt from the log continues the text exactly (worker/server/restore.py).
    tail: TextTail = EMPTY_TAIL
    # The window cut made just before this turn's input went in (worker/engine/memory/window.py),
    # or None. Logged before the turn's record, so a restore rebuilds the same window.
    cut: Cut | None = None


TokenListener = Callable[[TokenDelta], None]


@dataclass(eq=False)
class Turn:
    """Engine-thread state of one submitted chunk. Only the engine thread touches it after submit."""

    seq: int
    # Set at submit: the token chunk (after the held text tail, if any) or the text's committed tokens.
    input_tokens: list[int]
    max_output_tokens: int
    logprobs: bool
    future: Future[TurnResult]
    on_token: TokenListener | None
    submitted_at: float
    started_at: float | None = None
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    cancelled: bool = False
    # Earlier no-output chunks folded into this turn's append; each completes when the append does.
    absorbed: list[Turn] = field(default_factory=list)
    # A text chunk: tokenized on the engine thread against the session's text tail at submit.
    text: str | None = None
    # Commit the session's text tail with this chunk (implied by a token chunk or by asking for output).
    flush: bool = False
    # The session's (accepted_seq, text tail) before this turn was accepted: a refusal after
    # acceptance (capacity) puts them back, so the client can send the same chunk again, same seq.
    before: tuple[int | None, TextTail] | None = None
    # The session's text tail once this turn's input was committed (set at admission). Each chunk
    # folded into a merged append keeps its own, so each logged record carries the right one.
    tail_after: TextTail = EMPTY_TAIL
    # The cut made before this turn's input (set at activation, for the first turn of an append).
    cut: Cut | None = None
    # Folded into a later chunk's append (`absorbed`): where its own input ends in the sequence,
    # which a rewind `to_seq` goes back to (set at activation).
    input_end: int | None = None
    # A warm-up (`EngineCore.warm`): scheduled after every client turn, within a small budget.
    background: bool = False
    # Structured output (worker/engine/grammar.py): the turn's grammar, compiling or compiled (its
    # own `response_format`, else the session's); the turn is not activated before it is done.
    grammar: Future[xgr.CompiledGrammar] | None = None
    # Made from `grammar` at activation when the turn asks for output; accepts each sampled token.
    matcher: xgr.GrammarMatcher | None = None

    @property
    def grammar_pending(self) -> bool:
        return self.grammar is not None and not self.grammar.done()

    @property
    def grammar_error(self) -> BaseException | None:
        """Why the turn's grammar failed to compile (an `InvalidMessage`), or None."""
        return None if self.grammar is None or not self.grammar.done() else self.grammar.exception()

    @property
    def wants_output(self) -> bool:
        return self.max_output_tokens > 0 and not self.cancelled

    @property
    def grows_by(self) -> int:
        """What the turn may add to the sequence: its input and the outputs it may ask for (the
        window rule's measure, worker/engine/memory/window.py)."""
        return len(self.input_tokens) + (self.max_output_tokens if self.wants_output else 0)

    @property
    def outstanding_tokens(self) -> int:
        """Tokens this turn may still add to the sequence (its input is already counted once active)."""
        return 0 if self.cancelled else self.max_output_tokens - len(self.output_tokens)

    def result(
        self, session_id: str, reason: FinishReason, *, now: float, text: str | None, length: int
    ) -> TurnResult:
        """What the turn's future resolves with once it ended for `reason` (`length`: the session's)."""
        started = self.started_at if self.started_at is not None else now
        return TurnResult(
            session_id=session_id,
            seq=self.seq,
            inputs=tuple(self.input_tokens),
            tokens=tuple(self.output_tokens),
            logprobs=tuple(self.output_logprobs) if self.logprobs else None,
            text=text,
            finish=reason,
            queue_ms=(started - self.submitted_at) * 1000.0,
            compute_ms=(now - started) * 1000.0,
            length=length,
            tail=self.tail_after,
            cut=self.cut,
        )

    def notify(self, session_id: str, token: int, logprob: float | None) -> None:
        """Hand the token just sampled (the last output) to the turn's listener, if it has one; a
        failing listener is logged, never the engine's problem."""
        if self.on_token is None:
            return
        delta = TokenDelta(session_id, self.seq, len(self.output_tokens) - 1, token, logprob)
        try:
            self.on_token(delta)
        except Exception:
            logger.exception("token listener failed for session %s", session_id)
