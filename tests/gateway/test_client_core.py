"""The Python client's Sans-I/O part: which message answers which request, and nothing is lost."""

from __future__ import annotations

import pytest

from shared.client.clients import ClientCore, ReplyWaiter, SessionClosedError, TurnWaiter, open_config
from shared.errors import BadSequence, ErrorCode, InvalidMessage, SessionNotFound
from shared.protocol.codec import Encoding, encode_server
from shared.protocol.messages import (
    Error,
    InputChunk,
    OutputDelta,
    OutputDone,
    Pong,
    ServerMessage,
    SessionClosed,
    SessionOpened,
    SessionRestored,
    Timing,
)


def done(seq: int) -> OutputDone:
    return OutputDone(seq, (seq,), None, "length", Timing(0.0, 1.0))


def test_turn_waiter_collects_its_deltas_and_buffers_the_rest() -> None:
    core = ClientCore(Encoding.JSON)
    waiter = TurnWaiter(2)
    stream: list[ServerMessage] = [
        done(1),  # an earlier turn (e.g. a replay): someone else's
        OutputDelta(2, 0, 7),
        SessionRestored("s", 10),
        OutputDelta(2, 1, 8),
        done(2),
    ]
    finished = [core.offer(waiter, msg) for msg in stream]
    assert finished == [False, False, False, False, True]
    assert waiter.result == done(2)
    assert [d.token for d in waiter.deltas] == [7, 8]
    assert list(core.buffer) == [done(1), SessionRestored("s", 10)]


def test_scan_takes_the_answer_from_the_buffer_and_keeps_the_order_of_the_rest() -> None:
    core = ClientCore(Encoding.MSGPACK)
    core.buffer.extend([done(1), Pong("x"), done(2), Pong("y")])
    waiter = ReplyWaiter(Pong)
    assert core.scan(waiter)
    assert waiter.result == Pong("x")
    assert list(core.buffer) == [done(1), done(2), Pong("y")]
    turn = TurnWaiter(3)
    assert not core.scan(turn)
    assert list(core.buffer) == [done(1), done(2), Pong("y")]


def test_errors_raise_for_the_request_they_answer() -> None:
    core = ClientCore(Encoding.JSON)
    turn = TurnWaiter(5)
    other = Error(ErrorCode.RATE_LIMITED, "slow down", fatal=False, seq=4, retry_after_ms=50)
    assert not core.offer(turn, other)  # another chunk's error: buffered
    with pytest.raises(BadSequence):
        core.offer(turn, Error(ErrorCode.BAD_SEQUENCE, "no", fatal=False, seq=5))
    with pytest.raises(SessionNotFound):  # fatal: whatever the seq
        core.offer(turn, Error(ErrorCode.SESSION_NOT_FOUND, "gone", fatal=True))
    with pytest.raises(SessionClosedError) as closed:
        core.offer(turn, SessionClosed("idle_timeout"))
    assert closed.value.reason == "idle_timeout"
    opening = ReplyWaiter(SessionOpened)
    with pytest.raises(InvalidMessage):  # no seq: it answers the open
        core.offer(opening, Error(ErrorCode.INVALID_MESSAGE, "bad config", fatal=False))
    assert list(core.buffer) == [other]


def test_close_waiter_takes_session_closed_as_its_answer() -> None:
    waiter = ReplyWaiter(SessionClosed)
    assert ClientCore(Encoding.JSON).offer(waiter, SessionClosed("closed"))


@pytest.mark.parametrize("encoding", list(Encoding))
def test_decode_round_trip(encoding: Encoding) -> None:
    core = ClientCore(encoding)
    msg = done(3)
    assert core.decode(encode_server(msg, encoding)) == msg


def test_open_config_accepts_lists() -> None:
    config = open_config(max_output_tokens=2, stop_token_ids=[1, 2])
    assert config.stop_token_ids == (1, 2) and config.max_output_tokens == 2
    with pytest.raises(TypeError):
        open_config(max_output_token=2)


def test_the_core_runs_each_request_flow_without_a_socket() -> None:
    core = ClientCore(Encoding.JSON)
    opening = core.open(open_config(max_output_tokens=2))
    assert opening.message is not None and opening.message.type == "session.open"
    assert core.offer(opening.waiter, SessionOpened("s1", "tok", "tiny"))
    assert opening.finish() == SessionOpened("s1", "tok", "tiny")
    assert (core.session_id, core.resume_token) == ("s1", "tok")

    chunk = core.chunk(InputChunk(0, (1, 2)))
    waiting = core.wait_turn(0)
    refusal = Error(ErrorCode.BACKPRESSURE, "full", fatal=False, seq=0, retry_after_ms=40)
    assert waiting.message is None and core.offer(waiting.waiter, refusal)
    assert waiting.finish() == pytest.approx(0.04)  # wait, then resend the same chunk
    assert core.resend(0) == chunk
    again = core.wait_turn(0)
    assert core.offer(again.waiter, OutputDelta(0, 0, 7)) is False
    assert core.offer(again.waiter, done(0)) and again.finish() == done(0)
    assert [d.token for d in core.last_deltas] == [7]
