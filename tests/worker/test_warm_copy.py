"""A warm copy (the new worker's side of a make-before-break handover): its history's KV computed in
the background, then adopted by the restore with a longer history, prefilling only the rest."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.protocol.messages import OpenConfig
from tests.worker.test_scheduler import session
from worker.engine import Engine
from worker.engine.scheduler import Scheduler

CONFIG = OpenConfig(stop_token_ids=())
HISTORY = [(5 * j) % 200 + 1 for j in range(300)]


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine.load("tiny", kv_tokens=4096, host_kv_tokens=0) as engine:
        yield engine


def test_an_adopted_warm_copy_prefills_only_what_came_after(engine: Engine) -> None:
    warmed = engine.warm_async("s", config=CONFIG, history=HISTORY[:280], accepted_seq=6).result(timeout=60)
    assert warmed.finish == "length" and warmed.length == 280
    before = engine.stats().tokens_forwarded
    engine.open_session(session_id="s", config=CONFIG, history=HISTORY, adopt=True)
    result = engine.run_turn("s", tokens=[7, 8], seq=9, max_output_tokens=3, timeout=60)
    assert engine.stats().tokens_forwarded - before == 20 + 2 + 2  # the 20 new tokens, the chunk, 2 decodes
    fresh = engine.open_session(config=CONFIG, history=HISTORY)
    assert engine.run_turn(fresh, tokens=[7, 8], max_output_tokens=3, timeout=60).tokens == result.tokens


def test_a_copy_catches_up_by_prefilling_only_the_new_turns(engine: Engine) -> None:
    engine.warm_async("s", config=CONFIG, history=HISTORY[:200]).result(timeout=60)
    before = engine.stats().tokens_forwarded
    caught_up = engine.warm_async("s", config=CONFIG, history=HISTORY[:280], extend=True).result(timeout=60)
    assert caught_up.finish == "length" and caught_up.length == 280
    assert engine.stats().tokens_forwarded - before == 80  # only the turns logged since the first read
    engine.open_session(session_id="s", config=CONFIG, history=HISTORY, adopt=True)
    result = engine.run_turn("s", tokens=[7, 8], max_output_tokens=3, timeout=60)
    fresh = engine.open_session(config=CONFIG, history=HISTORY)
    assert engine.run_turn(fresh, tokens=[7, 8], max_output_tokens=3, timeout=60).tokens == result.tokens


def test_a_copy_the_history_does_not_extend_is_replaced(engine: Engine) -> None:
    engine.warm_async("s", config=CONFIG, history=[9] * 50).result(timeout=60)
    engine.open_session(session_id="s", config=CONFIG, history=HISTORY, adopt=True)
    result = engine.run_turn("s", tokens=[7, 8], max_output_tokens=3, timeout=60)
    fresh = engine.open_session(config=CONFIG, history=HISTORY)
    assert engine.run_turn(fresh, tokens=[7, 8], max_output_tokens=3, timeout=60).tokens == result.tokens
    assert engine.stats().sessions == 2


def test_a_copy_still_warming_is_adopted_with_what_it_has(engine: Engine) -> None:
    warming = engine.warm_async("s", config=CONFIG, history=HISTORY[:280])
    # Queued right behind the warm-up: adopted before (or while) it ran, never recomputed twice.
    engine.open_session(session_id="s", config=CONFIG, history=HISTORY, adopt=True)
    assert warming.result(timeout=60).finish in ("cancelled", "length")
    result = engine.run_turn("s", tokens=[7, 8], max_output_tokens=3, timeout=60)
    fresh = engine.open_session(config=CONFIG, history=HISTORY)
    assert engine.run_turn(fresh, tokens=[7, 8], max_output_tokens=3, timeout=60).tokens == result.tokens
    assert engine.stats().sessions == 2


def test_without_adopt_an_existing_session_is_refused(engine: Engine) -> None:
    engine.warm_async("s", config=CONFIG, history=HISTORY).result(timeout=60)
    with pytest.raises(Exception, match="already exists"):
        engine.open_session(session_id="s", config=CONFIG, history=HISTORY)


def test_background_rows_come_after_client_rows_within_one_piece() -> None:
    warm_a, warm_b = (
        session("warm_a", 900, 0, wants_output=False),
        session("warm_b", 700, 0, wants_output=False),
    )
    for warm in (warm_a, warm_b):
        assert warm.active is not None
        warm.active.background = True
    client, decode = session("client", 40, 8), session("decode", 50, 49)
    scheduler = Scheduler(
        max_batch_tokens=2048, max_batch_rows=8, max_append_piece=256, max_background_piece=64
    )
    batch = scheduler.schedule([warm_a, warm_b, client, decode])
    assert batch is not None
    assert [(r.session.session_id, r.count) for r in batch.rows] == [
        ("decode", 1),
        ("client", 32),
        ("warm_b", 64),  # the copies' share, smaller than a client's piece
    ]
    # On a CPU the copies wait for a step with no client row (or MAX_DEFERRED_STEPS of them).
    cpu = Scheduler(
        max_batch_tokens=2048,
        max_batch_rows=8,
        max_append_piece=256,
        max_background_piece=64,
        piggyback=False,
    )
    held = cpu.schedule([warm_a, warm_b, client, decode])
    assert held is not None and [r.session.session_id for r in held.rows] == ["decode", "client"]
    # With no client row: still one piece, so a chunk that arrives waits for one piece only.
    alone = scheduler.schedule([warm_a, warm_b])
    assert alone is not None and [(r.session.session_id, r.count) for r in alone.rows] == [("warm_b", 64)]
