"""The restore planner (worker/server/restore.py): log + the gateway's undurable tail -> the session.

Pure unit tests over real log bytes; the end-to-end property is in tests/system/gateway/test_fault_worker.py.
"""

from __future__ import annotations

import pytest

from shared.protocol.link import UndurableTurn
from shared.protocol.messages import InputChunk, OpenConfig
from shared.store.log_format import DIRECTIVE_REWIND, Cut, encode_directive, encode_log_record
from worker.engine import SessionRules
from worker.server.restore import REPLAY_DONES, ForcedTurn, plan_restore
from worker.tokenizer.incremental import EMPTY_TAIL, TextTail


def chunk(seq: int, tokens: list[int], max_out: int | None = None) -> InputChunk:
    return InputChunk(seq, tuple(tokens), None, max_out)


NO_WINDOW = 1024  # a context limit these sessions never reach
LOG = encode_log_record(1, [1, 2, 90, 91], inputs=2) + encode_log_record(2, [3, 4, 92, 93], inputs=2)


def rules(max_output_tokens: int) -> SessionRules:
    return SessionRules(OpenConfig(max_output_tokens=max_output_tokens), NO_WINDOW)


def test_delivered_turns_past_the_log_are_forced_and_the_rest_re_run() -> None:
    tail = [
        UndurableTurn(chunk(2, [3, 4]), (92, 93)),  # the log already has it: skipped
        UndurableTurn(chunk(3, [5, 6]), (94, 95)),  # delivered, not durable: history
        UndurableTurn(chunk(4, [7, 8]), None),  # in flight: re-run
        UndurableTurn(chunk(5, [9, 10]), None),  # queued: re-run
    ]
    plan = plan_restore("s", LOG, tail, 3, rules=rules(2))
    assert plan.history == [1, 2, 90, 91, 3, 4, 92, 93, 5, 6, 94, 95]
    assert plan.forced == [ForcedTurn(3, [5, 6, 94, 95], 2, EMPTY_TAIL)]
    assert [c.seq for c in plan.rerun] == [4, 5]
    assert (plan.finished_seq, plan.durable_seq, plan.answers) == (3, 2, [])


def test_a_logged_turn_whose_answer_was_lost_is_answered_from_the_log() -> None:
    tail = [UndurableTurn(chunk(2, [3, 4]), None), UndurableTurn(chunk(3, [5, 6], 4), None)]
    plan = plan_restore("s", LOG, tail, 1, rules=rules(2))
    [answer] = plan.answers
    done = answer.done
    assert (done.seq, done.tokens, done.finish, answer.length) == (2, (92, 93), "length", 8)
    assert [c.seq for c in plan.rerun] == [3] and plan.finished_seq == 2
    assert plan.history == [1, 2, 90, 91, 3, 4, 92, 93]


def test_after_one_re_run_every_later_chunk_re_runs() -> None:
    tail = [UndurableTurn(chunk(3, [5]), None), UndurableTurn(chunk(4, [6]), (7,))]
    plan = plan_restore("s", LOG, tail, 4, rules=rules(1))
    assert [c.seq for c in plan.rerun] == [3, 4] and plan.forced == []
    assert plan.finished_seq == 2  # seq ordering resumes right before the first re-run


def test_a_corrupt_log_is_refused() -> None:
    with pytest.raises(ValueError):
        plan_restore("s", LOG[:-3], [], None, rules=rules(1))


def test_a_restore_never_reopens_a_finished_turn_to_a_resent_chunk() -> None:
    """The client's last seen seq (`LinkRestore.seen_seq`) may lag the log (its done was lost with the
    socket) or lead it (the turn was not durable yet); either way the rebuilt session's seq ordering
    is past every turn it holds or the client saw, so a resent chunk for one is refused by the
    engine's admission, never run and logged a second time."""
    lagging = plan_restore("s", LOG, [], 1, rules=rules(2))
    assert (lagging.finished_seq, lagging.durable_seq, lagging.rerun) == (2, 2, [])
    leading = plan_restore("s", LOG, [], 3, rules=rules(2))
    assert (leading.finished_seq, leading.history) == (3, [1, 2, 90, 91, 3, 4, 92, 93])
    fresh = plan_restore("s", b"", [], None, rules=rules(2))
    assert fresh.finished_seq is None  # one "none": no turn finished yet


def test_a_client_that_resumes_elsewhere_gets_every_logged_done_it_missed() -> None:
    """Its gateway went away with the `done`s of turns 2 and 3 in it: the client resumes through
    another gateway (an empty tail) having seen 1, and the log answers 2 and 3, in seq order."""
    log = LOG + encode_log_record(3, [5, 94], inputs=1)
    plan = plan_restore("s", log, [], 1, rules=rules(2))
    assert [(a.done.seq, a.done.tokens, a.done.finish) for a in plan.answers] == [
        (2, (92, 93), "length"),
        (3, (94,), "stop"),
    ]
    assert (plan.finished_seq, plan.rerun) == (3, [])
    saw_none = plan_restore("s", log, [], None, rules=rules(2))
    assert [a.done.seq for a in saw_none.answers] == [1, 2, 3]
    saw_all = plan_restore("s", log, [], 3, rules=rules(2))
    assert saw_all.answers == []


def test_the_dones_a_restore_replays_are_bounded() -> None:
    log = b"".join(encode_log_record(seq, [seq, 900 + seq], inputs=1) for seq in range(1, 101))
    plan = plan_restore("s", log, [], None, rules=rules(1))
    assert [a.done.seq for a in plan.answers] == list(range(101 - REPLAY_DONES, 101))


def test_a_rewound_log_restores_the_edited_history_and_where_its_turns_end() -> None:
    # Turn 2 kept its input and first output (output.cancel keep_output_tokens 1), then turn 3.
    rewind = encode_directive(DIRECTIVE_REWIND, Cut(7, 0)) + encode_log_record(2, [])
    log = LOG + rewind + encode_log_record(3, [5, 94], inputs=1)
    tail = [UndurableTurn(chunk(4, [6]), (95,))]  # delivered, not durable: forced after it
    plan = plan_restore("s", log, tail, 4, rules=rules(1))
    assert plan.history == [1, 2, 90, 91, 3, 4, 92, 5, 94, 6, 95]
    assert [end[:3] for end in plan.turn_ends] == [(1, 2, 4), (2, 6, 7), (3, 8, 9), (4, 10, 11)]
    assert {end[3] for end in plan.turn_ends} == {EMPTY_TAIL}


def test_a_turn_that_held_text_back_gives_it_to_the_restored_session() -> None:
    log = encode_log_record(0, [1, 2], tail_text=" wor", tail_context="hello") + encode_log_record(1, [3])
    plan = plan_restore("s", log, [], 1, rules=rules(0))
    assert plan.turn_ends[0] == (0, 2, 2, TextTail(" wor", "hello"))
    assert plan.turn_ends[1] == (1, 3, 3, EMPTY_TAIL)
