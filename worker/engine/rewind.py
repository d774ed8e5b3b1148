"""Rewinds: where a session's history is taken back to, and the rules that refuse one.

A rewind shortens a session's sequence to its first `length` tokens (docs/protocol.md, "Rewind").
Three requests name that length (`RewindTarget`): a token count (`session.rewind` `keep_tokens`),
the end of a finished turn (`session.rewind` `to_seq`: the history as it was right after that
turn's `output.done`, its outputs included), or a turn's first k outputs (`output.cancel` with
`keep_output_tokens`: the running turn, or the session's last one when it already finished; a
queued turn that has not started leaves nothing, not even its input, so only 0 is valid for it).

`rewind_length` is pure over the session's state and raises a typed `InvalidMessage` having
changed nothing; the engine core applies the length it returns (worker/engine/core.py `rewind`).
A length inside the kept prefix (`keep_prefix_tokens`, the prefix text's tokens included) is
refused: the window keeps it for the session's whole life. A turn whose end a window cut took
is unknown to `to_seq` (that history is gone), as is a turn older than the last `MAX_TURN_ENDS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from shared.errors import InvalidMessage
from worker.engine.session import Session
from worker.tokenizer.incremental import TextTail


@dataclass(frozen=True)
class KeepTokens:
    """The history keeps its first `count` tokens."""

    count: int


@dataclass(frozen=True)
class ToTurn:
    """The history as it was right after turn `seq`'s `output.done`, its outputs included."""

    seq: int


@dataclass(frozen=True)
class KeepOutputs:
    """Turn `seq` (running, or the session's last and finished) keeps its first `count` outputs."""

    seq: int
    count: int


RewindTarget: TypeAlias = KeepTokens | ToTurn | KeepOutputs


@dataclass(frozen=True)
class Rewound:
    """A rewind applied: the sequence's new length and the text the session now holds back (the
    text held right after the turn a `ToTurn` named; none otherwise). The token log records both."""

    length: int
    tail: TextTail


def rewind_length(session: Session, target: RewindTarget) -> int:
    """The length `target` rewinds `session` to; `InvalidMessage` when it cannot be rewound there."""
    if isinstance(target, KeepTokens):
        length = target.count
        if length < 0 or length > len(session.tokens):
            raise InvalidMessage(
                f"session.rewind: keep_tokens {length} is past the session's length {len(session.tokens)}"
            )
    elif isinstance(target, ToTurn):
        span = session.ends.get(target.seq)
        if span is None:
            raise InvalidMessage(
                f"session.rewind: no finished turn {target.seq} in the session's history "
                "(unknown, not finished yet, or cut away by the window)"
            )
        length = span[1]
    else:
        length = _kept_outputs(session, target)
    floor = min(session.config.keep_prefix_tokens, len(session.tokens))
    if length < floor:
        raise InvalidMessage(
            f"a rewind to {length} tokens is inside the kept prefix of {floor} tokens (keep_prefix_tokens)"
        )
    return length


def _kept_outputs(session: Session, target: KeepOutputs) -> int:
    if target.count < 0:
        raise InvalidMessage("output.cancel: keep_output_tokens must be >= 0")
    active = session.active
    if active is not None and active.seq == target.seq:
        produced = len(active.output_tokens)
        outputs_start = len(session.tokens) - produced
    elif any(turn.seq == target.seq for turn in session.pending):
        # Not started: it produced nothing and its input never entered; the history ends where it is.
        produced, outputs_start = 0, len(session.tokens)
    else:
        span = session.ends.get(target.seq)
        if span is None or session.is_busy or target.seq != session.ends.last_seq:
            raise InvalidMessage(
                f"output.cancel: turn {target.seq} is neither running nor the session's last turn"
            )
        outputs_start, end = span
        produced = end - outputs_start
    if target.count > produced:
        raise InvalidMessage(
            f"output.cancel: keep_output_tokens {target.count} is more than the {produced} "
            f"tokens turn {target.seq} produced"
        )
    return outputs_start + target.count
