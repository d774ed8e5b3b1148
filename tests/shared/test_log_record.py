"""The token log's record format (shared/store/log_format.py): tokens, input count, text tail, directives."""

from __future__ import annotations

import pytest

from shared.store.log_format import (
    DIRECTIVE_CUT,
    DIRECTIVE_REWIND,
    DIRECTIVE_SNAPSHOT,
    NO_SEQ,
    RECORD_HEADER_BYTES,
    Cut,
    LogState,
    decode_log,
    encode_directive,
    encode_log_record,
)


def test_records_round_trip_with_their_input_counts_and_the_last_tail() -> None:
    log = (
        encode_log_record(NO_SEQ, [7, 8])
        + encode_log_record(0, [1, 2, 90], inputs=2, tail_text=" wor", tail_context="hello")
        + encode_log_record(1, [3, 91, 92], inputs=1, tail_text="ld", tail_context="wor")
    )
    state = decode_log(log, spans_after=0)
    tails = {1: ("ld", "wor")}  # what each spanned turn held back (a rewind to it restores it)
    assert state == LogState([7, 8, 1, 2, 90, 3, 91, 92], 1, {1: (5, 6, 8)}, "ld", "wor", tails)
    assert len(encode_log_record(2, [5], inputs=1)) == RECORD_HEADER_BYTES + 4


def test_a_multibyte_tail_round_trips_byte_exactly() -> None:
    text, context = "naïve 日本語 🙂", "é"
    state = decode_log(encode_log_record(3, [], inputs=0, tail_text=text, tail_context=context))
    assert (state.tokens, state.durable_seq, state.tail_text, state.tail_context) == ([], 3, text, context)


def test_a_duplicate_record_is_skipped_tail_and_all() -> None:
    first = encode_log_record(0, [1], tail_text="ab", tail_context="x")
    second = encode_log_record(1, [2], tail_text="cd", tail_context="y")
    stale = encode_log_record(0, [9], tail_text="zz", tail_context="q")  # a retried append
    state = decode_log(first + second + second + stale)
    assert (state.tokens, state.durable_seq, state.tail_text, state.tail_context) == ([1, 2], 1, "cd", "y")


def test_the_tail_of_a_record_with_none_is_empty() -> None:
    state = decode_log(encode_log_record(0, [1], tail_text="ab") + encode_log_record(1, [2, 3], inputs=2))
    assert (state.tail_text, state.tail_context) == ("", "")


@pytest.mark.parametrize("cut", [1, 5, RECORD_HEADER_BYTES + 4 + 1])
def test_a_truncated_record_is_refused(cut: int) -> None:
    record = encode_log_record(0, [1], tail_text="héllo", tail_context="ab")
    with pytest.raises(ValueError):
        decode_log(record[:-cut])


def test_bad_utf8_in_a_tail_is_refused() -> None:
    record = bytearray(encode_log_record(0, [1], tail_text="é"))
    record[-1] = 0xFF  # the second byte of "é"
    with pytest.raises(ValueError):
        decode_log(bytes(record))


def test_an_input_count_above_the_tokens_is_refused() -> None:
    with pytest.raises(ValueError):
        encode_log_record(0, [1], inputs=2)


# --- directives (a window cut, a snapshot) -----------------------------------------------------


def test_a_cut_directive_cuts_the_history_before_its_record_and_moves_the_kept_spans() -> None:
    log = (
        encode_log_record(0, [1, 2, 3], inputs=2)
        + encode_log_record(1, [4, 5, 6], inputs=1)
        + encode_directive(DIRECTIVE_CUT, Cut(2, 3))  # keep [1, 2] + the last 3: [4, 5, 6]
        + encode_log_record(2, [7, 8], inputs=1, tail_text="t")
    )
    state = decode_log(log, spans_after=-1)
    assert state.tokens == [1, 2, 4, 5, 6, 7, 8] and state.durable_seq == 2 and state.tail_text == "t"
    # Turn 0 was reached by the cut (its span is gone); turn 1 lies wholly in the kept recent tokens.
    assert state.spans == {1: (2, 3, 5), 2: (5, 6, 7)}
    assert decode_log(
        encode_log_record(0, [1, 2]) + encode_directive(DIRECTIVE_CUT, Cut(1, 0)) + encode_log_record(1, [3])
    ).tokens == [1, 3]


def test_a_snapshot_replaces_the_history_and_answers_no_turn() -> None:
    log = (
        encode_log_record(0, [1, 2])
        + encode_directive(DIRECTIVE_SNAPSHOT)
        + encode_log_record(5, [9, 8, 7], tail_text="ab", tail_context="c")
        + encode_log_record(6, [6], inputs=1)
    )
    state = decode_log(log, spans_after=-1)
    assert state == LogState([9, 8, 7, 6], 6, {6: (3, 4, 4)}, "", "")
    assert decode_log(log[: -len(encode_log_record(6, [6]))], spans_after=-1).spans == {}


def test_a_rewind_takes_the_history_back_where_it_stands_and_a_retried_copy_is_skipped() -> None:
    def rewind(after_seq: int, length: int) -> bytes:
        return encode_directive(DIRECTIVE_REWIND, Cut(length, 0)) + encode_log_record(after_seq, [])

    turns = encode_log_record(0, [1, 2, 3], inputs=1, tail_text="x") + encode_log_record(
        1, [4, 5, 6], inputs=1
    )
    log = turns + rewind(1, 5)
    state = decode_log(log, spans_after=-1)
    # Turn 1 kept its input and first output; the held-back text went with the rewind.
    spans = {0: (0, 1, 3), 1: (3, 4, 5)}
    assert state == LogState([1, 2, 3, 4, 5], 1, spans, "", "", {0: ("x", "")})
    later = encode_log_record(2, [7], inputs=1)
    # The same rewind again (a retried append) changes nothing; after a later turn it is skipped.
    assert decode_log(log + rewind(1, 5) + later).tokens == [1, 2, 3, 4, 5, 7]
    assert decode_log(log + later + rewind(1, 5) + later).tokens == [1, 2, 3, 4, 5, 7]
    # Before any turn: it names no seq.
    assert decode_log(encode_log_record(NO_SEQ, [8, 9]) + rewind(NO_SEQ, 1)).tokens == [8]


def test_a_duplicate_record_is_skipped_with_its_directive() -> None:
    first = encode_log_record(0, [1, 2, 3])
    second = encode_directive(DIRECTIVE_CUT, Cut(1, 1)) + encode_log_record(1, [4])
    assert decode_log(first + second + second).tokens == [1, 3, 4]


@pytest.mark.parametrize(
    "log",
    [
        encode_log_record(0, [1]) + encode_directive(DIRECTIVE_CUT, Cut(1, 0)),  # no record after it
        encode_directive(DIRECTIVE_CUT, Cut(0, 0))
        + encode_directive(DIRECTIVE_SNAPSHOT)
        + encode_log_record(0, [1]),
        (0xFFFFFFFF).to_bytes(4, "little") + (9).to_bytes(4, "little") + bytes(8) + encode_log_record(0, [1]),
        encode_directive(DIRECTIVE_CUT, Cut(0, 0))[:10],
    ],
    ids=["trailing", "two-in-a-row", "unknown-kind", "truncated"],
)
def test_a_bad_directive_is_refused(log: bytes) -> None:
    with pytest.raises(ValueError):
        decode_log(log)


def test_tokens_of_no_turn_only_open_a_log_and_a_retried_copy_is_skipped() -> None:
    prompt = encode_log_record(NO_SEQ, [7, 8])
    turn = encode_log_record(0, [1, 2], inputs=1)
    assert decode_log(prompt + prompt + turn + prompt + turn).tokens == [7, 8, 1, 2]
