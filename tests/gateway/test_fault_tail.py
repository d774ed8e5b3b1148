"""The gateway's undurable tail (`UndurableTurns` in gateway/session/turns.py), as a state machine:
unit tests with no I/O."""

from __future__ import annotations

from gateway.session.turns import UndurableTurns
from shared.protocol.link import LinkChunk, LinkDelta, LinkDone
from shared.protocol.messages import InputChunk, OutputDelta, OutputDone, Timing


def done(seq: int, tokens: tuple[int, ...], durable: int | None) -> LinkDone:
    return LinkDone("s", OutputDone(seq, tokens, None, "length", Timing(0.0, 0.0)), 10, durable_seq=durable)


def test_entries_leave_once_delivered_and_durable_and_duplicates_are_refused() -> None:
    tail = UndurableTurns()
    for seq in (1, 2, 3):
        tail.add(LinkChunk("s", InputChunk(seq, (seq,))), sent=True)
    assert tail.delivered(done(1, (9,), None)) and len(tail) == 3
    assert not tail.delivered(done(1, (9,), None))  # a second done for seq 1
    assert tail.delivered(done(2, (8,), 1)) and len(tail) == 2  # 1 is durable now
    turns = tail.snapshot(None)
    assert [(t.chunk.seq, t.output) for t in turns] == [(2, (8,)), (3, None)]
    tail.durable(3)  # 3 has no answer yet: it stays
    assert len(tail) == 1
    tail.refused(3)
    assert len(tail) == 0


def test_held_chunks_are_sent_once_and_repeated_deltas_are_dropped() -> None:
    tail = UndurableTurns()
    tail.add(LinkChunk("s", InputChunk(1, (1,))), sent=True)
    tail.add(LinkChunk("s", InputChunk(2, (2,))), sent=False)
    tail.add(LinkChunk("s", InputChunk(3, (3,))), sent=False)
    assert [t.chunk.seq for t in tail.snapshot(2)] == [1, 2]  # 3 waits behind an edit: not in a restore
    assert [c.chunk.seq for c in tail.take_unsent(2)] == []  # 2 went with the restore frame
    assert [c.chunk.seq for c in tail.take_unsent(None)] == [3] and tail.take_unsent(None) == []
    first = LinkDelta("s", OutputDelta(1, 0, 5))
    assert tail.delta_is_new(first) and not tail.delta_is_new(first)  # a re-run repeats it
    assert tail.delta_is_new(LinkDelta("s", OutputDelta(1, 1, 6)))


def test_the_new_link_fields_round_trip_and_bad_tails_are_refused() -> None:
    import msgpack
    import pytest

    from shared.errors import InvalidMessage
    from shared.protocol.link import LinkMigrate, LinkOpened, LinkRestore, UndurableTurn
    from shared.protocol.link_codec import decode_link, encode_link
    from shared.protocol.messages import OpenConfig

    tail = (UndurableTurn(InputChunk(4, (1, 2)), (7,)), UndurableTurn(InputChunk(5, None, "hi", 3), None))
    frames = [
        LinkRestore("s", OpenConfig(), None, 3, "ab" * 32, 123, tail),
        LinkRestore("s", OpenConfig()),
        LinkOpened("s", 10, 4, 3),
        done(4, (7,), 3),
        LinkMigrate("s", 4),
    ]
    for frame in frames:
        assert decode_link(encode_link(frame)) == frame
    turns = [{"chunk": {"seq": 5, "tokens": [1]}}, {"chunk": {"seq": 4, "tokens": [2]}}]
    bad = msgpack.packb({"op": "restore", "sid": "s", "config": {}, "tail": turns})
    with pytest.raises(InvalidMessage, match="tail seqs must increase"):
        decode_link(bad)
