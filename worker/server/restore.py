"""How a restoring worker rebuilds a session exactly: the token log plus the gateway's tail.

Pure (no I/O): given the log's bytes and the tail the gateway kept (every chunk after the last seq
the old worker confirmed durable, with the output the client already got, if any), decide what the
new session starts from and what still has to run. docs/failover.md has the why; the invariants:

- Every turn ends up in the rebuilt sequence exactly once, in seq order: turns the log holds come
  from the log (a tail entry the log already has is skipped: the old worker flushed it before the
  gateway heard); delivered turns after the log's end are appended as history (inputs then the
  delivered output, forced, no new `done`); the rest are re-run, in order, so each gets exactly one
  `done`.
- Text is exact across the move: the log's last record carries the session's held-back text, the
  forced turns' inputs are committed from it exactly as the engine's admission did, and the new
  session opens with the tail that leaves (`text_tail`), so re-run text chunks continue from it.
- A turn the log holds but whose `done` never reached the client is answered from the log:
  `answers` rebuilds its `done`. Either the worker died between its flush and the frame leaving its
  socket (the tail has the chunk, with no output), or the client's gateway went away with the
  `done` in it and the client resumed elsewhere with an empty tail: every logged turn after the
  client's `seen_seq` is owed (the newest `REPLAY_DONES` of them, as an attach's replay buffer).
- Once one tail chunk must be re-run, every later one is re-run too: outputs depend on everything
  before them. (The gateway drops a `done` for a seq it has already delivered.)
- The window is the one the session had: the log's cuts are applied as it is read, and each forced
  turn is cut before by the same per-turn rule the engine applies (`Engine.session_rules`),
  the cut kept with the turn so the new worker logs it. The engine folds queued no-output chunks
  into one append but never across a cut, so replaying the turns one by one reaches its window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from shared.protocol.link import LinkDone, UndurableTurn
from shared.protocol.messages import FinishReason, InputChunk, OutputDone, Timing
from shared.store.log_format import NO_SEQ, Cut, decode_log
from worker.engine import SessionRules
from worker.engine.turn_ends import TurnEnds
from worker.tokenizer.incremental import TextTail

# The most `done`s a session keeps for a client that comes back (an attach replays them from the
# binding's buffer, a restore from the log): a bound on what a resume sends, never on a session.
REPLAY_DONES: Final = 32


@dataclass(frozen=True, slots=True)
class ForcedTurn:
    """A delivered turn the log lacked: appended as history, then logged like any other turn."""

    seq: int
    tokens: list[int]  # its committed inputs, then the output the client got
    inputs: int
    tail: TextTail  # the session's text tail after its input
    cut: Cut | None = None  # the window cut made before it (logged with it)


@dataclass(frozen=True, slots=True)
class RestorePlan:
    history: list[int]
    # The last seq the rebuilt session has finished (None: none yet): seq ordering carries on after
    # it, so a chunk resent for a turn the log, the tail or the client's view already holds is
    # refused, never run (and logged) a second time.
    finished_seq: int | None
    # The last seq the log in Redis holds: what the new worker reports as durable at first.
    durable_seq: int | None
    forced: list[ForcedTurn] = field(default_factory=list)
    # Chunks to run again, in seq order, once the session is open.
    rerun: list[InputChunk] = field(default_factory=list)
    # `done` frames for turns the log holds but the client never got an answer for.
    answers: list[LinkDone] = field(default_factory=list)
    # The text the session holds back once the history is in: the new session starts from it, so
    # re-run text chunks continue exactly where the old session was.
    text_tail: TextTail = field(default_factory=TextTail)
    # (seq, outputs_start, end) of the turns the rebuilt history holds, the last `MAX_TURN_ENDS`:
    # a rewind `to_seq` reaches them on the new worker as on the old (issue #35).
    turn_ends: tuple[tuple[int, int, int, TextTail], ...] = ()


def plan_restore(
    sid: str,
    log: bytes,
    tail: Sequence[UndurableTurn],
    seen_seq: int | None,
    *,
    rules: SessionRules,
) -> RestorePlan:
    """Raises ValueError on a corrupt log (InvalidMessage: text on a model without a tokenizer).

    `rules` are the engine's for this session (`Engine.session_rules`): a forced turn's inputs are
    what the engine's admission committed, so they are recomputed the same way, statefully in seq
    order from the log's text tail (a re-encode of the chunk's text alone would give other tokens);
    its config gives the default `max_output_tokens` per chunk and the window. `seen_seq` is the
    last output seq the client saw (`LinkRestore.seen_seq`): that turn finished, so the rebuilt
    session is at least there.
    """
    first = tail[0].chunk.seq if tail else None
    # Spans from the first turn that may be owed a `done`: the client's last seen, or before the tail.
    owed_after = [s for s in (seen_seq, None if first is None else first - 1) if s is not None]
    spans_after = min(owed_after, default=NO_SEQ)
    state = decode_log(log, spans_after=NO_SEQ)  # every turn's span: the owed ones answer, all end
    ends = TurnEnds()
    for seq, (_start, inputs_end, end) in sorted(state.spans.items()):
        ends.record(seq, inputs_end, end, TextTail(*state.span_tails.get(seq, ("", ""))))
    state = replace(state, spans={s: span for s, span in state.spans.items() if s > spans_after})
    history = list(state.tokens)
    durable_seq = state.durable_seq
    text_tail = TextTail(state.tail_text, state.tail_context)
    max_output_tokens = rules.config.max_output_tokens
    forced: list[ForcedTurn] = []
    rerun: list[InputChunk] = []
    answers: list[LinkDone] = []
    for turn in tail:
        chunk = turn.chunk
        if not rerun and durable_seq is not None and chunk.seq <= durable_seq:
            if turn.output is None and chunk.seq in state.spans:
                answers.append(_answer(sid, chunk, state.tokens, state.spans[chunk.seq], max_output_tokens))
            continue
        if rerun or turn.output is None:
            rerun.append(chunk)
            continue
        outputs = max_output_tokens if chunk.max_output_tokens is None else chunk.max_output_tokens
        inputs, text_tail = rules.commit(
            text_tail,
            text=chunk.text,
            tokens=chunk.tokens or (),
            flush=bool(chunk.flush),
            max_output_tokens=outputs,
        )
        # What the engine's turn would reserve (turn.py `grows_by`): its input and its outputs.
        cut = rules.cut_before(len(history), len(inputs) + max(outputs, 0))
        if cut is not None:
            ends.after_cut(cut, len(history))
            history = cut.apply(history)
        tokens = inputs + list(turn.output)
        history.extend(tokens)
        ends.record(chunk.seq, len(history) - len(turn.output), len(history), text_tail)
        forced.append(ForcedTurn(chunk.seq, tokens, len(inputs), text_tail, cut))
    # Logged turns the tail does not hold, after the last one the client saw: a gateway that went
    # away took their `done`s with it (the client resumed with an empty tail).
    in_tail = {turn.chunk.seq for turn in tail}
    unseen = sorted(s for s in state.spans if s not in in_tail and (seen_seq is None or s > seen_seq))
    for seq in unseen[-REPLAY_DONES:]:
        answers.append(_logged_answer(sid, seq, state.tokens, state.spans[seq], max_output_tokens))
    answers.sort(key=lambda answer: answer.done.seq)
    seqs = [s for s in (seen_seq, durable_seq, *(f.seq for f in forced)) if s is not None]
    finished = max(seqs) if seqs else None
    if rerun and finished is not None:
        finished = min(finished, rerun[0].seq - 1)
    return RestorePlan(history, finished, durable_seq, forced, rerun, answers, text_tail, tuple(ends.items()))


def _answer(
    sid: str, chunk: InputChunk, tokens: list[int], span: tuple[int, int, int], max_output_tokens: int
) -> LinkDone:
    limit = max_output_tokens if chunk.max_output_tokens is None else chunk.max_output_tokens
    return _logged_answer(sid, chunk.seq, tokens, span, limit)


def _logged_answer(sid: str, seq: int, tokens: list[int], span: tuple[int, int, int], limit: int) -> LinkDone:
    """Turn `seq`'s `done` rebuilt from its span of the logged tokens; `limit` its output limit
    (the chunk's when the tail has it, else the session's default)."""
    start, inputs_end, end = span
    output = tuple(tokens[inputs_end:end])  # the record says where its committed input ends
    # The log keeps tokens, not why a turn stopped: short of its limit means a stop token (a
    # cancelled turn that was answered from the log reads as `stop` too).
    finish: FinishReason = "length" if len(output) >= limit else "stop"
    committed = inputs_end - start
    done = OutputDone(seq, output, None, finish, Timing(0.0, 0.0), committed_tokens=committed)
    return LinkDone(sid, done, end)
