"""The token log's record format (shared/store/schema.py): tokens, input count and text tail."""

from __future__ import annotations

import pytest

from shared.store.schema import NO_SEQ, RECORD_HEADER_BYTES, LogState, decode_log, encode_log_record


def test_records_round_trip_with_their_input_counts_and_the_last_tail() -> None:
    log = (
        encode_log_record(NO_SEQ, [7, 8])
        + encode_log_record(0, [1, 2, 90], inputs=2, tail_text=" wor", tail_context="hello")
        + encode_log_record(1, [3, 91, 92], inputs=1, tail_text="ld", tail_context="wor")
    )
    state = decode_log(log, spans_after=0)
    assert state == LogState([7, 8, 1, 2, 90, 3, 91, 92], 1, {1: (5, 6, 8)}, "ld", "wor")
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
