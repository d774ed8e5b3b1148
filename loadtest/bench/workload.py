"""The deterministic token history every mode replays.

Inputs are pseudo-random but reproducible from (seed, session, turn) alone, so any mode can ask for
any turn's input without replaying the others. Outputs are whatever streaming generated: the
other modes build their histories from that record, so a divergence in one turn can never leak
into the next turn's context and every mode is timed on exactly the same sequences.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable


def input_tokens(seed: int, session: int, turn: int, count: int, vocab_size: int) -> list[int]:
    """`count` token ids in [0, vocab_size); str seeds hash with SHA-512, stable across processes."""
    rng = random.Random(f"microturn-bench:{seed}:{session}:{turn}")
    return [rng.randrange(vocab_size) for _ in range(count)]


def sampled_turns(turns: int, every: int = 10, last: int = 10) -> list[int]:
    """Turn 0, every `every`-th turn and the last `last` turns: what the history-bound modes time."""
    return sorted({0, *range(0, turns, every), *range(max(turns - last, 0), turns)})


class Workload:
    """Inputs of every (session, turn) and the outputs streaming recorded for them.

    `record` is called from streaming's client threads (one per session, so no two threads write
    the same cell); the lock only makes the "is it complete" check safe to call at any time.
    """

    def __init__(
        self, *, sessions: int, turns: int, input_count: int, output_count: int, vocab_size: int, seed: int
    ) -> None:
        self.sessions = sessions
        self.turns = turns
        self.output_count = output_count
        self.inputs = [
            [input_tokens(seed, s, t, input_count, vocab_size) for t in range(turns)] for s in range(sessions)
        ]
        self._outputs: list[list[tuple[int, ...] | None]] = [[None] * turns for _ in range(sessions)]
        self._lock = threading.Lock()

    def record(self, session: int, turn: int, outputs: Iterable[int]) -> None:
        tokens = tuple(outputs)
        if len(tokens) != self.output_count:
            raise RuntimeError(
                f"session {session} turn {turn} generated {len(tokens)} tokens, expected {self.output_count}"
            )
        with self._lock:
            self._outputs[session][turn] = tokens

    def outputs(self, session: int, turn: int) -> tuple[int, ...]:
        with self._lock:
            tokens = self._outputs[session][turn]
        if tokens is None:
            raise RuntimeError(f"streaming has not recorded session {session} turn {turn}")
        return tokens

    def complete(self) -> bool:
        with self._lock:
            return all(tokens is not None for row in self._outputs for tokens in row)

    def history(self, session: int, turn: int) -> list[int]:
        """The sequence session `session` holds before turn `turn`: all earlier inputs and outputs."""
        sequence: list[int] = []
        for t in range(turn):
            sequence += self.inputs[session][t]
            sequence += self.outputs(session, t)
        return sequence
