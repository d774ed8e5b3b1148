"""When a drain's target gets a second KV copy stream (worker/server/switchover.py): one costs the
sessions still served least, a second is for a queue one stream would not copy in time."""

from __future__ import annotations

from worker.server.switchover import MAX_COPY_STREAMS, wants_second_stream


def test_a_queue_one_stream_copies_in_time_keeps_one() -> None:
    # 7 sessions left at 0.1 s each: 0.7 s, against 8 s left before the deadline
    assert not wants_second_stream(streams=1, queued=7, mean_copy_s=0.1, time_left_s=8.0)


def test_a_queue_that_would_take_over_half_the_time_left_gets_a_second() -> None:
    # 200 sessions left at 0.1 s each: 20 s, against 8 s left
    assert wants_second_stream(streams=1, queued=200, mean_copy_s=0.1, time_left_s=8.0)
    assert wants_second_stream(streams=1, queued=5, mean_copy_s=0.1, time_left_s=0.9)


def test_never_more_than_the_most_streams_nor_one_for_an_empty_queue() -> None:
    assert not wants_second_stream(streams=MAX_COPY_STREAMS, queued=200, mean_copy_s=0.1, time_left_s=8.0)
    assert not wants_second_stream(streams=1, queued=0, mean_copy_s=5.0, time_left_s=0.1)


def test_past_the_deadline_a_queue_gets_its_second_stream() -> None:
    assert wants_second_stream(streams=1, queued=1, mean_copy_s=0.1, time_left_s=-0.5)
