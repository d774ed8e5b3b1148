"""How a restoring worker rebuilds a session exactly: the token log plus the gateway's tail.

Pure (no I/O): given the log's bytes and the tail the gateway kept (every chunk after the last seq
the old worker confirmed durable, with the output the client already got, if any), decide what the
new session starts from and what still has to run. docs/failover.md has the why; the invariants:

- Every turn ends up in the rebuilt sequence exactly once, in seq order: turns the log holds come
  from the log (a tail entry the log already has is skipped: the old worker flushed it before the
  gateway heard); delivered turns after the log's end are appended as history (inputs then the
  delivered output, forced, no new `done`); the rest are re-run, in order, so each gets exactly one
  `done`.
- A turn the log holds but whose `done` never reached the client (the worker died between its flush
  and the frame leaving its socket) is answered from the log: `answers` rebuilds its `done`.
- Once one tail chunk must be re-run, every later one is re-run too: outputs depend on everything
  before them. (The gateway drops a `done` for a seq it has already delivered.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.protocol.link import LinkChunk, LinkDone, TailTurn
from shared.protocol.messages import FinishReason
from shared.redis_schema import decode_log


@dataclass(frozen=True, slots=True)
class RestorePlan:
    history: list[int]
    # The seq ordering carries on from here (None: no turn yet).
    last_seq: int | None
    # The last seq the log in Redis holds: what the new worker reports as durable at first.
    log_last_seq: int | None
    # (seq, inputs + output) of delivered turns the log lacked: appended as history, then logged.
    forced: list[tuple[int, list[int]]] = field(default_factory=list)
    # Chunks to run again, in seq order, once the session is open.
    rerun: list[LinkChunk] = field(default_factory=list)
    # `done` frames for turns the log holds but the client never got an answer for.
    answers: list[LinkDone] = field(default_factory=list)


def plan_restore(
    log: bytes,
    tail: Sequence[TailTurn],
    last_seq: int | None,
    *,
    chunk_inputs: Callable[[LinkChunk], list[int]],
    max_output_tokens: int,
) -> RestorePlan:
    """Raises ValueError on a corrupt log. `chunk_inputs` gives a chunk's input tokens as the
    engine appends them; `max_output_tokens` is the session's default per chunk."""
    first = tail[0].chunk.seq if tail else None
    state = decode_log(log, spans_after=None if first is None else first - 1)
    history = list(state.tokens)
    log_last = state.last_seq
    plan = RestorePlan(history, last_seq, log_last)
    for turn in tail:
        chunk = turn.chunk
        if not plan.rerun and log_last is not None and chunk.seq <= log_last:
            if turn.output is None and chunk.seq in state.spans:
                plan.answers.append(
                    _answer(chunk, state.tokens, state.spans[chunk.seq], chunk_inputs, max_output_tokens)
                )
            continue
        if plan.rerun or turn.output is None:
            plan.rerun.append(chunk)
            continue
        tokens = chunk_inputs(chunk) + list(turn.output)
        history.extend(tokens)
        plan.forced.append((chunk.seq, tokens))
    seqs = [s for s in (last_seq, log_last, *(seq for seq, _ in plan.forced)) if s is not None]
    resumed_at = max(seqs) if seqs else None
    if plan.rerun and resumed_at is not None:
        resumed_at = min(resumed_at, plan.rerun[0].seq - 1)
    return RestorePlan(history, resumed_at, log_last, plan.forced, plan.rerun, plan.answers)


def _answer(
    chunk: LinkChunk,
    tokens: list[int],
    span: tuple[int, int],
    chunk_inputs: Callable[[LinkChunk], list[int]],
    max_output_tokens: int,
) -> LinkDone:
    start, end = span
    output = tuple(tokens[start + len(chunk_inputs(chunk)) : end])
    limit = max_output_tokens if chunk.max_output_tokens is None else chunk.max_output_tokens
    # The log keeps tokens, not why a turn stopped: short of its limit means a stop token (a
    # cancelled turn that was answered from the log reads as `stop` too).
    finish: FinishReason = "length" if len(output) >= limit else "stop"
    return LinkDone(chunk.sid, chunk.seq, output, None, finish, 0.0, 0.0, end)
