"""Whether a session takes a chunk, and what the chunk appends: checks only, nothing mutated.

Split from core.py so every reason to refuse a chunk is in one place, in the order they run:
sequence, input (text against the session's held-back tail, worker/tokenizer/incremental.py),
queue cost, context. `admit` either raises a typed error or returns the tokens the chunk commits
and the session's next text tail; the caller applies both, so a refusal leaves the session (seq and
tail included) exactly as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.backpressure import check_queue
from shared.errors import BadSequence, ChunkTooLarge, ContextFull, InvalidMessage
from worker.engine.config import EngineConfig
from worker.engine.session import Session
from worker.engine.turn import Turn
from worker.tokenizer.incremental import EMPTY_TAIL, IncrementalTokenizer, TextTail


def admit(
    session: Session,
    turn: Turn,
    text: IncrementalTokenizer | None,
    config: EngineConfig,
) -> tuple[list[int], TextTail]:
    """(tokens `turn` appends, the session's next text tail), or a typed error."""
    if session.accepted_seq is not None and turn.seq <= session.accepted_seq:
        raise BadSequence(f"seq {turn.seq} is not above the last accepted seq {session.accepted_seq}")
    tokens, tail = commit_input(session, turn, text, config.max_chunk_tokens)
    check_pending(session, turn, len(tokens), config)
    check_context(session, turn, len(tokens), session.context_limit)
    return tokens, tail


def commit_input(
    session: Session, turn: Turn, text: IncrementalTokenizer | None, max_chunk_tokens: int
) -> tuple[list[int], TextTail]:
    """What `turn` commits against the session's tail (`commit_chunk`), within the chunk limit."""
    committed, tail = commit_chunk(
        text,
        session.tail,
        text=turn.text,
        tokens=turn.input_tokens,
        flush=flushes(text=turn.text, flush=turn.flush, max_output_tokens=turn.max_output_tokens),
    )
    if turn.text is not None and len(committed) > max_chunk_tokens:
        raise ChunkTooLarge(f"the text commits {len(committed)} tokens; the limit is {max_chunk_tokens}")
    return committed, tail


def flushes(*, text: str | None, flush: bool, max_output_tokens: int) -> bool:
    """Whether a chunk commits the whole text tail: asked to, asking for output, or a token chunk
    (the text before it is complete)."""
    return flush or max_output_tokens > 0 or text is None


def commit_chunk(
    tokenizer: IncrementalTokenizer | None,
    tail: TextTail,
    *,
    text: str | None,
    tokens: Sequence[int],
    flush: bool,
) -> tuple[list[int], TextTail]:
    """(tokens a chunk appends, the tail after it): a text chunk commits what can no longer change
    (all of it when `flush`); a token chunk commits the tail first, then its tokens. Pure, so a
    restoring worker replays delivered text chunks through exactly this (worker/server/restore.py)."""
    if tokenizer is None or (text is None and tail == EMPTY_TAIL):
        if text is not None:
            raise InvalidMessage("this model has no tokenizer: send tokens")
        return list(tokens), EMPTY_TAIL
    committed, after = tokenizer.feed(tail, text or "", flush=flush)
    return committed + list(tokens), after


def check_pending(session: Session, turn: Turn, tokens: int, config: EngineConfig) -> None:
    """The session's queue rule (shared/backpressure.py) over the turns pending behind its running
    turn: queued no-output chunks merge into one append, so they are bounded by what they cost."""
    pending_tokens, pending_outputs = session.queued_cost()
    check_queue(
        pending_tokens,
        pending_outputs,
        tokens=max(tokens, 1),
        outputs=int(turn.max_output_tokens > 0),
        tokens_limit=config.max_pending_tokens,
        outputs_limit=config.max_pending_outputs,
    )


def check_context(session: Session, turn: Turn, tokens: int, limit: int) -> None:
    projected = session.projected_length()
    if not tokens and turn.max_output_tokens > 0 and projected == 0:
        raise InvalidMessage("an empty chunk cannot ask for output before the session has any tokens")
    grows_by = tokens + turn.max_output_tokens
    if session.config.context_policy == "error":
        if projected + grows_by > limit:
            raise ContextFull(
                f"the session would reach {projected + grows_by} tokens; its context holds {limit}"
            )
    elif session.config.keep_prefix_tokens + grows_by > limit:
        raise ContextFull(f"one chunk and its output ({grows_by} tokens) do not fit a context of {limit}")
