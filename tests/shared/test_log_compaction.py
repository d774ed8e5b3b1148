"""Compaction of the token log (shared/store/log_compaction.py): what a restore reads is unchanged,
and a session's log stays bounded however many turns, cuts, empty records and duplicates it has.

The logs are those of real windows: each turn is cut before by the engine's own rule
(worker/engine/memory/window.py `cut_before`), and the compaction cadence is the worker's
(worker/server/token_log.py: past 2 x KEEP_RECORDS records since the snapshot, back to KEEP_RECORDS).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from shared.protocol.messages import OpenConfig
from shared.store.log_compaction import compact_log, records_since_snapshot
from shared.store.log_format import (
    DIRECTIVE_BYTES,
    DIRECTIVE_CUT,
    DIRECTIVE_REWIND,
    NO_SEQ,
    RECORD_HEADER_BYTES,
    TOKEN_BYTES,
    Cut,
    decode_log,
    encode_directive,
    encode_log_record,
    log_entries,
)
from worker.engine.memory.window import cut_before
from worker.server.token_log import KEEP_RECORDS

LIMIT = 64
CONFIG = OpenConfig(context_policy="truncate", max_context_tokens=LIMIT, keep_prefix_tokens=4)
MAX_INPUT, MAX_OUTPUT = 6, 3
TAILS = ("", "ab", "naïve ", "日本")


@dataclass
class Session:
    """A session's log as its worker writes it, and its window, turn by turn."""

    rng: random.Random
    history: list[int]
    records: list[bytes]  # each turn's record (with its directive), as appended
    seq: int = 0
    cuts: int = 0
    rewinds: int = 0

    @classmethod
    def start(cls, seed: int, prompt: int = 5) -> Session:
        rng = random.Random(seed)
        prompt_tokens = [rng.randrange(1000) for _ in range(prompt)]
        return cls(rng, list(prompt_tokens), [encode_log_record(NO_SEQ, prompt_tokens)])

    def turn(self) -> bytes:
        """The next turn's record: often empty (a chunk that added nothing is logged too)."""
        rng = self.rng
        self.seq += 1
        empty = rng.random() < 0.3
        inputs = [] if empty else [rng.randrange(1000) for _ in range(rng.randint(1, MAX_INPUT))]
        asked = 0 if empty else rng.choice((0, MAX_OUTPUT))
        outputs = [rng.randrange(1000) for _ in range(rng.randint(0, asked))]
        cut = cut_before(len(self.history), len(inputs) + asked, CONFIG, LIMIT)
        directive = b""
        if cut is not None:
            self.history = cut.apply(self.history)
            directive = encode_directive(DIRECTIVE_CUT, cut)
            self.cuts += 1
        self.history += inputs + outputs
        tail = rng.choice(TAILS)
        record = directive + encode_log_record(
            self.seq, inputs + outputs, inputs=len(inputs), tail_text=tail, tail_context=tail[::-1]
        )
        self.records.append(record)
        return record

    def rewind(self) -> bytes:
        """A rewind's record: back to a length past the kept prefix, after the last turn's seq."""
        length = self.rng.randint(min(4, len(self.history)), len(self.history))
        self.history = self.history[:length]
        self.rewinds += 1
        directive = encode_directive(DIRECTIVE_REWIND, Cut(length, 0))
        record = directive + encode_log_record(self.seq or NO_SEQ, [])
        self.records.append(record)
        return record

    def retried(self) -> bytes:
        """A retried append: the last one to three records again (duplicates, directives and all)."""
        return b"".join(self.records[-self.rng.randint(1, 3) :])


def kept_seqs(log: bytes, keep: int) -> set[int]:
    """The seqs of the turns among the last `keep` records that a reader applies (not duplicates)."""
    entries = list(log_entries(log))
    split = max(len(entries) - keep, 0)
    before = {e.seq for e in entries[:split]}
    return {e.seq for e in entries[split:] if e.seq != NO_SEQ and e.seq not in before} if keep else set()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("keep", [0, 1, 3, 16])
def test_a_compacted_log_reads_as_the_log_it_replaces(seed: int, keep: int) -> None:
    session = Session.start(seed)
    log = session.records[0]
    for turn in range(80):
        log += session.turn()
        if turn % 20 == 10:
            log += session.rewind()  # issue #35: compaction keeps the rewind's rule
        if session.rng.random() < 0.1:
            log += session.retried()
    assert session.cuts > 2 and session.rewinds > 0
    compacted = compact_log(log, keep)
    original, after = decode_log(log, spans_after=-1), decode_log(compacted, spans_after=-1)
    assert after.tokens == original.tokens == session.history
    assert (after.durable_seq, after.tail_text, after.tail_context) == (
        original.durable_seq,
        original.tail_text,
        original.tail_context,
    )
    # The spans of the kept turns answer as before (those a cut reached are gone in both).
    kept = kept_seqs(log, keep)
    assert after.spans == {seq: span for seq, span in original.spans.items() if seq in kept}
    assert len(compacted) < len(log)
    assert records_since_snapshot(compacted) == keep
    assert compact_log(compacted, keep) == compacted  # nothing more to fold


def test_records_since_snapshot_counts_every_record_of_a_log_without_one() -> None:
    session = Session.start(1)
    log = session.records[0] + b"".join(session.turn() for _ in range(9))
    assert records_since_snapshot(log) == 10  # the prompt's record included
    assert records_since_snapshot(b"") == 0
    assert compact_log(log, 10) == log and compact_log(b"", 3) == b""


def test_compaction_keeps_a_log_bounded_over_many_cuts_empty_records_and_retries() -> None:
    """The worker's cadence over 3,000 turns: the log never holds more than the window, one
    snapshot and 2 x KEEP_RECORDS records, and reads as the whole uncompacted log does."""
    session = Session.start(7)
    log, whole, records = session.records[0], session.records[0], 1
    longest = 0
    for _ in range(3000):
        new = session.turn()
        if session.rng.random() < 0.05:
            new += session.retried()
        count = len(list(log_entries(new)))
        if records > KEEP_RECORDS and records + count > 2 * KEEP_RECORDS:
            log, records = compact_log(log, KEEP_RECORDS), KEEP_RECORDS
        log, whole, records = log + new, whole + new, records + count
        longest = max(longest, len(log))
    record_bytes = DIRECTIVE_BYTES + RECORD_HEADER_BYTES + TOKEN_BYTES * (MAX_INPUT + MAX_OUTPUT) + 2 * 8
    bound = DIRECTIVE_BYTES + RECORD_HEADER_BYTES + TOKEN_BYTES * LIMIT + 2 * 8
    bound += (2 * KEEP_RECORDS + 3) * record_bytes  # + a retry's up to 3 records
    print(f"[log] 3000 turns, {session.cuts} cuts: {len(whole)} bytes whole, at most {longest} compacted")
    assert session.cuts > 500
    assert longest <= bound < len(whole) // 10
    state, expected = decode_log(log), decode_log(whole)
    assert (state.tokens, state.durable_seq, state.tail_text) == (
        expected.tokens,
        expected.durable_seq,
        expected.tail_text,
    )
    assert state.tokens == session.history


def test_a_corrupt_log_is_not_compacted() -> None:
    session = Session.start(2)
    log = b"".join(session.turn() for _ in range(5))
    with pytest.raises(ValueError):
        compact_log(log[:-3], 1)
    with pytest.raises(ValueError):
        compact_log(log, -1)
