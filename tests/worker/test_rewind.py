"""Rewinds in the engine (issue #35): the history taken back with no forward pass, its pages freed,
shared pages left alone, and every later turn as if the shortened history had been sent whole.

The `tiny` preset: what is checked is pages, counts and equality with a session opened with the
same history, not what a real model says.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from shared.errors import InvalidMessage
from shared.protocol.messages import OpenConfig
from shared.store.log_format import DIRECTIVE_REWIND, Cut, encode_directive, encode_log_record
from tests.worker.smollm2 import engine_on
from worker.engine import Engine, TokenDelta, TurnResult
from worker.engine.rewind import KeepOutputs, KeepTokens, RewindTarget, ToTurn
from worker.model.loader import LoadedModel
from worker.server.restore import plan_restore

PAGE = 16
PROMPT = [(5 * j) % 200 + 1 for j in range(40)]


def _engine(**options: Any) -> Engine:
    defaults: dict[str, Any] = {"kv_tokens": 64 * PAGE, "page_size": PAGE, "host_kv_tokens": 0}
    return Engine.load("tiny", **{**defaults, **options})


def _open(engine: Engine, **options: Any) -> str:
    return engine.open_session(stop_token_ids=(), logprobs=True, **options)


def _rewind(engine: Engine, sid: str, target: RewindTarget) -> int:
    return engine.rewind(sid, target).result(timeout=60).length


def _as_whole(engine: Engine, history: list[int], **turn: Any) -> TurnResult:
    """The turn run by a fresh session opened with `history`: what a rewound session must equal."""
    sid = engine.open_session(stop_token_ids=(), logprobs=True, history=history)
    return engine.run_turn(sid, timeout=60, **turn)


def _same(have: TurnResult, want: TurnResult) -> None:
    assert have.tokens == want.tokens
    assert have.logprobs is not None and want.logprobs is not None
    assert max((abs(a - b) for a, b in zip(have.logprobs, want.logprobs, strict=True)), default=0.0) < 1e-4


def test_a_rewind_of_the_last_reply_frees_its_pages_without_a_forward_pass() -> None:
    with _engine() as engine:
        sid = _open(engine)
        first = engine.run_turn(sid, tokens=PROMPT, max_output_tokens=2, seq=0, timeout=60)
        used = engine.stats().pages_used
        engine.run_turn(sid, tokens=[7, 8, 9], max_output_tokens=30, seq=1, timeout=60)
        assert engine.stats().pages_used > used
        forwarded = engine.stats().tokens_forwarded
        assert _rewind(engine, sid, ToTurn(0)) == first.length == 42
        assert engine.stats().tokens_forwarded == forwarded  # no forward pass
        assert engine.stats().pages_used == used
        # The next turn appends after the rewound end, as if that history had been sent whole.
        history = [*PROMPT, *first.tokens]
        turn = {"tokens": [11, 12], "max_output_tokens": 4}
        _same(engine.run_turn(sid, seq=2, timeout=60, **turn), _as_whole(engine, history, **turn))


def test_keep_tokens_and_keep_output_tokens_land_where_they_say() -> None:
    with _engine() as engine:
        sid = _open(engine)
        engine.run_turn(sid, tokens=PROMPT, max_output_tokens=0, seq=0, timeout=60)
        reply = engine.run_turn(sid, tokens=[3, 4], max_output_tokens=6, seq=1, timeout=60)
        # The last turn, already finished, keeps its first 2 outputs (the ones the client delivered).
        assert _rewind(engine, sid, KeepOutputs(1, 2)) == 40 + 2 + 2
        # Named again with the same count: the same length (a retry changes nothing).
        assert _rewind(engine, sid, KeepOutputs(1, 2)) == 44
        assert _rewind(engine, sid, KeepTokens(30)) == 30
        turn = {"tokens": [21], "max_output_tokens": 3}
        _same(engine.run_turn(sid, seq=2, timeout=60, **turn), _as_whole(engine, PROMPT[:30], **turn))
        assert reply.finish == "length"


def test_a_rewind_cancels_the_running_and_queued_turns_first() -> None:
    with _engine() as engine:
        sid = _open(engine)
        engine.run_turn(sid, tokens=PROMPT, max_output_tokens=0, seq=0, timeout=60)
        first_token = engine.submit(sid, tokens=[1], max_output_tokens=400, seq=1)
        queued = engine.submit(sid, tokens=[2, 3], max_output_tokens=4, seq=2)
        assert _rewind(engine, sid, ToTurn(0)) == 40
        running, waiting = first_token.result(timeout=60), queued.result(timeout=60)
        assert running.finish == "cancelled" and waiting.finish == "cancelled"
        assert waiting.inputs == ()  # it never entered the sequence
        turn = {"tokens": [4], "max_output_tokens": 3}
        _same(engine.run_turn(sid, seq=3, timeout=60, **turn), _as_whole(engine, PROMPT, **turn))


def test_keep_output_tokens_of_the_running_turn_keeps_its_first_outputs() -> None:
    with _engine() as engine:
        sid = _open(engine)
        engine.run_turn(sid, tokens=PROMPT, max_output_tokens=0, seq=0, timeout=60)
        delivered: list[int] = []
        two = threading.Event()

        def on_token(delta: TokenDelta) -> None:
            delivered.append(delta.token)
            if len(delivered) == 2:
                two.set()

        future = engine.submit(sid, tokens=[1], max_output_tokens=400, seq=1, on_token=on_token)
        assert two.wait(60)
        length = _rewind(engine, sid, KeepOutputs(1, 2))
        result = future.result(timeout=60)
        assert result.finish == "cancelled" and length == 41 + 2
        history = [*PROMPT, 1, *result.tokens[:2]]
        assert result.tokens[:2] == tuple(delivered[:2])
        turn = {"tokens": [4], "max_output_tokens": 3}
        _same(engine.run_turn(sid, seq=2, timeout=60, **turn), _as_whole(engine, history, **turn))


def test_keep_output_tokens_zero_of_a_queued_turn_leaves_nothing_of_it() -> None:
    with _engine() as engine:
        sid = _open(engine)
        engine.run_turn(sid, tokens=PROMPT, max_output_tokens=0, seq=0, timeout=60)
        future = engine.submit(sid, tokens=[1], max_output_tokens=4, seq=1)
        length = _rewind(engine, sid, KeepOutputs(1, 0))
        result = future.result(timeout=60)
        if result.inputs:  # it had started: its input stays, none of its outputs
            assert length == 41
        else:
            assert result.finish == "cancelled" and length == 40


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (ToTurn(7), "no finished turn 7"),
        (KeepTokens(500), "past the session's length"),
        (KeepTokens(3), "inside the kept prefix"),
        (KeepOutputs(0, 1), "neither running nor the session's last"),
        (KeepOutputs(1, 5), "more than the 4 tokens"),
    ],
)
def test_bad_targets_are_refused_and_change_nothing(target: RewindTarget, message: str) -> None:
    with _engine() as engine:
        sid = _open(engine, context_policy="truncate", keep_prefix_tokens=8, max_context_tokens=512)
        engine.run_turn(sid, tokens=PROMPT, max_output_tokens=0, seq=0, timeout=60)
        reply = engine.run_turn(sid, tokens=[3], max_output_tokens=4, seq=1, timeout=60)
        pages, forwarded = engine.stats().pages_used, engine.stats().tokens_forwarded
        with pytest.raises(InvalidMessage, match=message):
            _rewind(engine, sid, target)
        assert (engine.stats().pages_used, engine.stats().tokens_forwarded) == (pages, forwarded)
        turn = {"tokens": [9], "max_output_tokens": 2}
        _same(
            engine.run_turn(sid, seq=2, timeout=60, **turn),
            _as_whole(engine, [*PROMPT, 3, *reply.tokens], **turn),
        )


def test_a_turn_cut_away_by_the_window_cannot_be_rewound_to() -> None:
    with _engine() as engine:
        sid = _open(engine, context_policy="truncate", keep_prefix_tokens=4, max_context_tokens=64)
        engine.run_turn(sid, tokens=PROMPT[:10], max_output_tokens=0, seq=0, timeout=60)
        engine.run_turn(sid, tokens=PROMPT, max_output_tokens=0, seq=1, timeout=60)
        # 50 + 30 > 64: the window keeps 4 + the last 17 (51 - 4 - 30), so turn 0's end is gone.
        cut = engine.run_turn(sid, tokens=PROMPT[:30], max_output_tokens=0, seq=2, timeout=60)
        assert cut.cut is not None and cut.length == 4 + 17 + 30
        with pytest.raises(InvalidMessage, match="no finished turn 0"):
            _rewind(engine, sid, ToTurn(0))
        assert _rewind(engine, sid, ToTurn(1)) == 4 + 17  # turn 1 ended where the kept recent end


def test_a_rewind_into_shared_pages_leaves_them_to_the_other_sessions() -> None:
    prefix = [(3 * j) % 200 + 1 for j in range(100)]  # 6 full pages and 4 tokens
    with _engine() as engine:
        first, second = _open(engine), _open(engine)
        engine.run_turn(first, tokens=prefix, max_output_tokens=2, seq=0, timeout=60)
        other = engine.run_turn(second, tokens=prefix, max_output_tokens=2, seq=0, timeout=60)
        shared = engine.stats().memory.prefix
        assert shared is not None and shared.shared_pages == 6
        # Into the middle of the third shared page: it is given up (never written), not freed.
        assert _rewind(engine, first, KeepTokens(40)) == 40
        after = engine.stats().memory.prefix
        assert after is not None and after.cached_pages == 6 and after.shared_pages == 2
        turn = {"tokens": [9, 10], "max_output_tokens": 4}
        forwarded = engine.stats().tokens_forwarded
        rewound = engine.run_turn(first, seq=1, timeout=60, **turn)
        # The third page's 8 kept tokens were fed again into a page of its own, then 2 and 3 decodes.
        assert engine.stats().tokens_forwarded - forwarded == 8 + 2 + 3
        _same(rewound, _as_whole(engine, prefix[:40], **turn))
        # The other session reads the shared pages as they were.
        _same(
            engine.run_turn(second, seq=1, timeout=60, **turn),
            _as_whole(engine, [*prefix, *other.tokens], **turn),
        )


def test_a_parked_session_rewinds_on_the_host() -> None:
    with _engine(kv_tokens=8 * PAGE, host_kv_tokens=32 * PAGE) as engine:
        first = _open(engine)
        engine.run_turn(first, tokens=list(range(1, 90)), max_output_tokens=2, seq=0, timeout=60)
        second = _open(engine)
        engine.run_turn(second, tokens=list(range(100, 190)), max_output_tokens=2, seq=0, timeout=60)
        host_used = engine.stats().memory.host_pages_used
        assert host_used > 0
        assert _rewind(engine, first, KeepTokens(20)) == 20
        # 20 tokens end in the second page, a host copy of a page the prefix cache indexed (the
        # session's first turn): never written into, it is given up too and its 4 tokens are fed
        # again. One page stays.
        memory = engine.stats().memory
        assert memory.host_pages_used == 1 and memory.prefix is not None and memory.prefix.host_pages == 1
        turn = {"tokens": [5, 6], "max_output_tokens": 3}
        _same(
            engine.run_turn(first, seq=1, timeout=60, **turn),
            _as_whole(engine, list(range(1, 21)), **turn),
        )


def test_a_rewind_sent_again_to_the_worker_that_restored_it_from_the_log_changes_nothing() -> None:
    """A rewind the lost worker logged but never answered goes again to the session's next worker
    (gateway/session/edits.py): restored from a log that holds it, the session already is where
    the rewind goes, so each way of naming that length changes nothing, and the next turn answers
    as the rewound history sent whole."""
    with _engine() as engine:
        sid = _open(engine)
        engine.run_turn(sid, tokens=PROMPT, max_output_tokens=0, seq=0, timeout=60)
        reply = engine.run_turn(sid, tokens=[3, 4], max_output_tokens=6, seq=1, timeout=60)
        later = engine.run_turn(sid, tokens=[5, 6], max_output_tokens=4, seq=2, timeout=60)
        length = _rewind(engine, sid, ToTurn(1))
        # The log as the worker wrote it: the three turns, then the rewind after turn 2's record.
        log = (
            encode_log_record(0, PROMPT)
            + encode_log_record(1, [3, 4, *reply.tokens], inputs=2)
            + encode_log_record(2, [5, 6, *later.tokens], inputs=2)
            + encode_directive(DIRECTIVE_REWIND, Cut(length, 0))
            + encode_log_record(2, [])
        )
        plan = plan_restore(sid, log, [], 2, rules=engine.session_rules(OpenConfig()))
        restored = engine.open_session(
            history=plan.history, turn_ends=plan.turn_ends, stop_token_ids=(), logprobs=True
        )
        for target in (ToTurn(1), KeepTokens(length), KeepOutputs(1, len(reply.tokens))):
            assert _rewind(engine, restored, target) == length
        turn = {"tokens": [9, 10], "max_output_tokens": 4}
        want = _as_whole(engine, [*PROMPT, 3, 4, *reply.tokens], **turn)
        _same(engine.run_turn(restored, seq=3, timeout=60, **turn), want)


def _history(engine: Engine, sid: str) -> list[int]:
    return list(engine._core.sessions[sid].tokens)


def test_a_rewind_to_a_chunk_folded_into_a_later_append_lands_at_its_own_end() -> None:
    with _engine() as engine:
        sid = _open(engine)
        engine.run_turn(sid, tokens=PROMPT, max_output_tokens=2, seq=0, timeout=60)
        # Queued behind a running turn, the next three fold into one append; each keeps its own end.
        futures = [
            engine.submit(sid, tokens=[1], max_output_tokens=30, seq=1),
            engine.submit(sid, tokens=[7, 8], max_output_tokens=0, seq=2),
            engine.submit(sid, tokens=[9], max_output_tokens=0, seq=3),
            engine.submit(sid, tokens=[10, 11], max_output_tokens=3, seq=4),
        ]
        results = [f.result(timeout=60) for f in futures]
        assert results[1].length == results[3].length  # folded: one append, one length
        history = _history(engine, sid)
        assert _rewind(engine, sid, ToTurn(2)) == 42 + 1 + 30 + 2
        turn = {"tokens": [4], "max_output_tokens": 3}
        expected = _as_whole(engine, history[: 42 + 1 + 30 + 2], **turn)
        _same(engine.run_turn(sid, seq=5, timeout=60, **turn), expected)


def test_a_rewind_to_a_turn_gives_back_the_text_it_held_and_other_rewinds_drop_it() -> None:
    with _engine() as engine:
        sid = engine.open_session(stop_token_ids=())
        held = engine.run_turn(sid, text="hello wor", seq=0, timeout=60)
        engine.run_turn(sid, text="ld, and more", seq=1, timeout=60)
        # Back to right after turn 0: " wor" is held again, so "ld" completes the same word.
        assert _rewind(engine, sid, ToTurn(0)) == len(held.inputs)
        again = engine.run_turn(sid, text="ld", flush=True, seq=2, timeout=60)
        whole = engine.open_session(stop_token_ids=())
        want = engine.run_turn(whole, text="hello world", flush=True, timeout=60)
        assert [*held.inputs, *again.inputs] == list(want.inputs)
        # A token count ends on a token boundary: nothing is held after it.
        assert _rewind(engine, sid, KeepTokens(1)) == 1
        assert engine.run_turn(sid, text="", flush=True, seq=3, timeout=60).inputs == ()


def test_smollm2_after_rewinds_answers_as_the_history_sent_whole(smollm2_model: LoadedModel) -> None:
    """Point 4 with real weights: after a barge-in (a reply kept to its first outputs), a rewind to
    a turn and one to a token count, each next turn equals the engine fed the history whole."""
    with engine_on(smollm2_model, kv_tokens=2048, host_kv_tokens=0) as engine:
        sid = engine.open_session(stop_token_ids=(), logprobs=True)
        chunks = [[(97 * t + 13 * j) % 5000 + 100 for j in range(10)] for t in range(6)]
        engine.run_turn(sid, tokens=chunks[0], max_output_tokens=4, seq=0, timeout=120)
        engine.run_turn(sid, tokens=chunks[1], max_output_tokens=6, seq=1, timeout=120)
        edits: list[RewindTarget] = [KeepOutputs(1, 2), ToTurn(0), KeepTokens(7)]
        for seq, edit in enumerate(edits, start=2):
            _rewind(engine, sid, edit)
            history = _history(engine, sid)
            turn = {"tokens": chunks[seq], "max_output_tokens": 4}
            _same(engine.run_turn(sid, seq=seq, timeout=120, **turn), _as_whole(engine, history, **turn))
