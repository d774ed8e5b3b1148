"""Restoring a `truncate` session keeps its window (worker/server/restore.py, issue #24 point 5).

The property: a session rebuilt from its log (cuts recorded as directives) plus the gateway's tail
(delivered turns forced as history, the rest re-run) has the window the uninterrupted session had,
at every durable point, across several cuts, including forced turns that need a cut of their own;
and the re-run turns give the same outputs and the same cuts. The reference submits every chunk at
once, so the engine folds queued no-output chunks into one append: the restore replays them one by
one, and the window must not depend on that.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from shared.protocol.link import UndurableTurn
from shared.protocol.messages import InputChunk, OpenConfig
from shared.store.log_format import DIRECTIVE_CUT, decode_log, encode_directive, encode_log_record
from worker.engine import Engine, SessionRules, TurnResult
from worker.engine.memory.window import session_limit
from worker.server.restore import ForcedTurn, plan_restore

OUT = 3
CONFIG = OpenConfig(
    max_output_tokens=OUT,
    stop_token_ids=(),
    context_policy="truncate",
    max_context_tokens=96,
    keep_prefix_tokens=8,
    retention_ratio=0.8,
)
TURNS = 60


def chunks() -> list[InputChunk]:
    """5-token chunks; every third asks for output, the others fold into the next append."""
    return [
        InputChunk(seq, tuple((seq * 7 + i * 13) % 500 for i in range(5)), None, OUT if seq % 3 == 2 else 0)
        for seq in range(TURNS)
    ]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine.load("tiny", kv_tokens=4096, max_pending_tokens=4096, max_pending_outputs=64) as e:
        yield e


def submit_all(engine: Engine, sid: str, todo: list[InputChunk]) -> list[TurnResult]:
    futures: list[Future[TurnResult]] = [
        engine.submit(sid, tokens=c.tokens, seq=c.seq, max_output_tokens=c.max_output_tokens) for c in todo
    ]
    return [f.result(60) for f in futures]


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[TurnResult]:
    sid = engine.open_session(config=CONFIG)
    results = submit_all(engine, sid, chunks())
    engine.close_session(sid)
    return results


def record(result: TurnResult | ForcedTurn) -> bytes:
    """The record worker/server/service.py logs for a turn: its cut's directive, then the turn."""
    if isinstance(result, ForcedTurn):
        tokens, inputs, tail = result.tokens, result.inputs, result.tail
    else:
        tokens, inputs, tail = list(result.inputs + result.tokens), len(result.inputs), result.tail
    directive = b"" if result.cut is None else encode_directive(DIRECTIVE_CUT, result.cut)
    return directive + encode_log_record(
        result.seq, tokens, inputs=inputs, tail_text=tail.text, tail_context=tail.context
    )


def test_the_reference_cuts_several_times(reference: list[TurnResult]) -> None:
    cuts = [r.seq for r in reference if r.cut is not None]
    assert len(cuts) >= 5, cuts
    assert any(reference[seq].tokens == () for seq in cuts)  # a cut before a folded no-output chunk


@pytest.mark.parametrize("delivered_after", [0, 1, 3, 100])
def test_a_restored_truncate_session_keeps_the_window_and_continues_exactly(
    engine: Engine, reference: list[TurnResult], delivered_after: int
) -> None:
    all_chunks = chunks()
    limit = session_limit(CONFIG, engine.context_limit)
    forced_cuts = rerun_cuts = 0
    for durable in range(-1, TURNS - 1, 4):
        delivered = min(durable + delivered_after, TURNS - 1)
        log = b"".join(record(r) for r in reference[: durable + 1])
        tail = [
            UndurableTurn(c, reference[c.seq].tokens if c.seq <= delivered else None)
            for c in all_chunks[durable + 1 :]
        ]
        plan = plan_restore("s", log, tail, delivered, rules=SessionRules(CONFIG, limit, None))
        # Forced turns are cut where the session cut them, and their records (with the cut) make
        # the log the new worker holds read as the uninterrupted session's.
        assert [f.cut for f in plan.forced] == [reference[f.seq].cut for f in plan.forced]
        forced_cuts += sum(f.cut is not None for f in plan.forced)
        whole = decode_log(b"".join(record(r) for r in reference[: delivered + 1])).tokens
        assert plan.history == whole
        assert decode_log(log + b"".join(record(f) for f in plan.forced)).tokens == whole
        sid = engine.open_session(history=plan.history, accepted_seq=plan.finished_seq, config=CONFIG)
        for result in submit_all(engine, sid, plan.rerun):
            expected = reference[result.seq]
            assert (result.inputs, result.tokens, result.cut) == (
                expected.inputs,
                expected.tokens,
                expected.cut,
            )
            rerun_cuts += result.cut is not None
        engine.close_session(sid)
    if delivered_after:
        assert forced_cuts > 0  # forced turns crossed a cut
    if delivered_after < 100:
        assert rerun_cuts > 0  # and so did re-run ones
