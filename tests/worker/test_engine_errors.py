"""Bad input raises its typed error and leaves the session exactly as it was."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from shared.errors import (
    Backpressure,
    BadSequence,
    CapacityExhausted,
    ChunkTooLarge,
    ContextFull,
    InvalidMessage,
    SessionNotFound,
    TokenOutOfRange,
)
from worker.engine import Engine

CHUNKS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, 36]]
OUTPUTS = 4
OPTIONS = {"stop_token_ids": (), "max_context_tokens": 200, "logprobs": True}


def run(engine: Engine, sid: str, chunk: list[int]) -> tuple[int, ...]:
    return engine.run_turn(sid, tokens=chunk, max_output_tokens=OUTPUTS, timeout=30).tokens


def untouched(engine: Engine) -> list[tuple[int, ...]]:
    sid = engine.open_session(**OPTIONS)
    outputs = [run(engine, sid, chunk) for chunk in CHUNKS]
    engine.close_session(sid)
    return outputs


def check_error_leaves_session_intact(engine: Engine, provoke: Callable[[str], None]) -> None:
    reference = untouched(engine)
    sid = engine.open_session(**OPTIONS)
    assert run(engine, sid, CHUNKS[0]) == reference[0]
    length_before = engine.run_turn(sid, tokens=[], max_output_tokens=0, timeout=30).length
    provoke(sid)
    assert engine.run_turn(sid, tokens=[], max_output_tokens=0, timeout=30).length == length_before
    assert [run(engine, sid, chunk) for chunk in CHUNKS[1:]] == reference[1:]
    engine.close_session(sid)


def test_token_out_of_range(tiny: Engine) -> None:
    def provoke(sid: str) -> None:
        with pytest.raises(TokenOutOfRange):
            tiny.submit(sid, tokens=[1, 2, tiny.model_config.vocab_size])
        with pytest.raises(TokenOutOfRange):
            tiny.submit(sid, tokens=[-1])

    check_error_leaves_session_intact(tiny, provoke)


def test_chunk_too_large(tiny: Engine) -> None:
    def provoke(sid: str) -> None:
        with pytest.raises(ChunkTooLarge):
            tiny.submit(sid, tokens=[1] * (tiny.config.max_chunk_tokens + 1))

    check_error_leaves_session_intact(tiny, provoke)


def test_bad_sequence(tiny: Engine) -> None:
    def provoke(sid: str) -> None:
        last = tiny.run_turn(sid, tokens=[], max_output_tokens=0, timeout=30).seq
        with pytest.raises(BadSequence):
            tiny.run_turn(sid, tokens=[1, 2], seq=last, timeout=30)
        with pytest.raises(BadSequence):
            tiny.run_turn(sid, tokens=[1, 2], seq=last - 1, timeout=30)

    check_error_leaves_session_intact(tiny, provoke)


def test_context_full(tiny: Engine) -> None:
    def provoke(sid: str) -> None:
        with pytest.raises(ContextFull):
            tiny.run_turn(sid, tokens=[3] * 190, max_output_tokens=OUTPUTS, timeout=30)

    check_error_leaves_session_intact(tiny, provoke)


def test_session_not_found(tiny: Engine) -> None:
    def provoke(sid: str) -> None:
        with pytest.raises(SessionNotFound):
            tiny.run_turn("no-such-session", tokens=[1], timeout=30)
        with pytest.raises(SessionNotFound):
            tiny.close_session("no-such-session")

    check_error_leaves_session_intact(tiny, provoke)


def test_invalid_messages(tiny: Engine) -> None:
    def provoke(sid: str) -> None:
        with pytest.raises(InvalidMessage):
            tiny.submit(sid, tokens=[1], text="both")
        with pytest.raises(InvalidMessage):
            tiny.submit(sid, tokens=[1, "2"])  # type: ignore[list-item]
        with pytest.raises(InvalidMessage):
            tiny.submit(sid, tokens=[1], max_output_tokens=-1)
        with pytest.raises(InvalidMessage):
            tiny.open_session(temperature=-1.0)
        with pytest.raises(InvalidMessage):
            tiny.open_session(no_such_option=1)

    check_error_leaves_session_intact(tiny, provoke)


def test_backpressure(tiny: Engine) -> None:
    # The busy turn adds tokens, so compare against a reference that ran the same busy turn.
    reference_sid = tiny.open_session(**OPTIONS)
    run(tiny, reference_sid, CHUNKS[0])
    started = threading.Event()
    sid = tiny.open_session(**OPTIONS)
    run(tiny, sid, CHUNKS[0])
    busy = tiny.submit(sid, tokens=[], max_output_tokens=40, on_token=lambda _delta: started.set())
    assert started.wait(30)
    # The queue is bounded by what it costs: queued input tokens, and turns asking for output.
    piece = [7] * (tiny.config.max_pending_tokens // 4)
    queued = [tiny.submit(sid, tokens=piece, max_output_tokens=0) for _ in range(4)]
    with pytest.raises(Backpressure) as refused:
        tiny.submit(sid, tokens=[9, 9], max_output_tokens=0).result(30)
    assert refused.value.retry_after_ms is not None
    produced = busy.result(30).tokens
    assert len(produced) == 40 and all(f.result(30).tokens == () for f in queued)
    # Same history without the refused chunk: the reference generates the same 40 tokens, then both agree.
    assert tiny.run_turn(reference_sid, tokens=[], max_output_tokens=40, timeout=30).tokens == produced
    tiny.run_turn(reference_sid, tokens=piece * 4, max_output_tokens=0, timeout=30)
    assert [run(tiny, sid, c) for c in CHUNKS[1:]] == [run(tiny, reference_sid, c) for c in CHUNKS[1:]]


def test_queue_bounds_turns_asking_for_output_not_chunks(tiny: Engine) -> None:
    sid = tiny.open_session(stop_token_ids=())
    started = threading.Event()
    busy = tiny.submit(sid, tokens=[1, 2], max_output_tokens=30, on_token=lambda _d: started.set())
    assert started.wait(30)
    # Twenty small no-output pieces (a paste, a flushed buffer) all queue: together they cost little.
    pieces = [tiny.submit(sid, tokens=[3], max_output_tokens=0) for _ in range(20)]
    bound = tiny.config.max_pending_outputs
    asking = [tiny.submit(sid, tokens=[4], max_output_tokens=1) for _ in range(bound)]
    with pytest.raises(Backpressure):
        tiny.submit(sid, tokens=[5], max_output_tokens=1).result(30)
    assert busy.result(30).finish == "length"
    assert [f.result(30).inputs for f in pieces] == [(3,)] * 20
    assert all(len(f.result(30).tokens) == 1 for f in asking)


def test_capacity_exhausted_when_nothing_can_be_dropped() -> None:
    with Engine.load("tiny", kv_tokens=256, page_size=16) as engine:
        reference = untouched(engine)
        sid = engine.open_session(**OPTIONS)
        assert run(engine, sid, CHUNKS[0]) == reference[0]
        hog = engine.open_session(stop_token_ids=())
        # The hog's turn reserves 14 of the 16 pages and stays busy; the session holds 1.
        started = threading.Event()
        hog_turn = engine.submit(
            hog, tokens=[1] * 20, max_output_tokens=200, on_token=lambda _d: started.set()
        )
        assert started.wait(30)
        with pytest.raises(CapacityExhausted) as refused:
            engine.run_turn(sid, tokens=[2] * 40, max_output_tokens=OUTPUTS, timeout=30)
        assert refused.value.retry_after_ms is not None
        engine.cancel(hog)
        assert hog_turn.result(30).finish == "cancelled"
        engine.close_session(hog)
        assert [run(engine, sid, chunk) for chunk in CHUNKS[1:]] == reference[1:]


def test_capacity_refusal_also_refuses_the_chunks_queued_behind() -> None:
    with Engine.load("tiny", kv_tokens=256, page_size=16) as engine:
        hog = engine.open_session(stop_token_ids=())
        started = threading.Event()
        engine.submit(hog, tokens=[1] * 20, max_output_tokens=200, on_token=lambda _d: started.set())
        assert started.wait(30)
        sid = engine.open_session()
        first = engine.submit(sid, tokens=[2] * 60)
        second = engine.submit(sid, tokens=[3])
        with pytest.raises(CapacityExhausted):
            first.result(30)
        with pytest.raises(CapacityExhausted):
            second.result(30)
        engine.cancel(hog)
        assert engine.run_turn(sid, tokens=[4], timeout=30).length == 1


def test_seqs_may_start_at_zero_and_a_rebuilt_session_keeps_its_accepted_seq(tiny: Engine) -> None:
    fresh = tiny.open_session()
    assert tiny.run_turn(fresh, tokens=[1], seq=0, timeout=30).seq == 0
    rebuilt = tiny.open_session(history=[1, 2, 3], accepted_seq=41)
    with pytest.raises(BadSequence):
        tiny.run_turn(rebuilt, tokens=[4], seq=41, timeout=30)
    assert tiny.run_turn(rebuilt, tokens=[4], seq=42, timeout=30).length == 4
