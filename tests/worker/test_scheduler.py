from __future__ import annotations

from concurrent.futures import Future

from shared.protocol.messages import OpenConfig
from worker.engine.scheduler import MAX_DEFERRED_STEPS, Scheduler
from worker.engine.session import Session
from worker.engine.turn import Turn


def session(name: str, total: int, cached: int, wants_output: bool = True) -> Session:
    s = Session(name, OpenConfig(), history=list(range(total)), now=0.0, seed=0, context_limit=4096)
    s.num_cached = cached
    s.active = Turn(
        seq=1,
        input_tokens=[],
        max_output_tokens=4 if wants_output else 0,
        logprobs=False,
        future=Future(),
        on_token=None,
        submitted_at=0.0,
    )
    return s


def test_decodes_first_then_shortest_appends_split_at_the_budget() -> None:
    long, short, decode = session("long", 500, 0), session("short", 30, 10), session("decode", 50, 49)
    batch = Scheduler(max_batch_tokens=100, max_batch_rows=8).schedule([long, short, decode])
    assert batch is not None
    assert [(r.session.session_id, r.start, r.count, r.sample) for r in batch.rows] == [
        ("decode", 49, 1, True),
        ("short", 10, 20, True),
        ("long", 0, 79, False),  # split: the rest continues next step, nothing sampled yet
    ]
    assert batch.num_tokens == 100


def test_no_output_turns_are_not_sampled_and_row_limit_holds() -> None:
    rows = [session(f"s{i}", 10, 0, wants_output=False) for i in range(5)]
    batch = Scheduler(max_batch_tokens=1000, max_batch_rows=3).schedule(rows)
    assert batch is not None and len(batch.rows) == 3 and not any(r.sample for r in batch.rows)


def test_nothing_to_do() -> None:
    assert Scheduler(max_batch_tokens=10, max_batch_rows=2).schedule([session("done", 10, 10)]) is None


def test_a_long_append_goes_in_pieces_with_or_without_others() -> None:
    long, decode = session("long", 900, 0), session("decode", 50, 49)
    scheduler = Scheduler(max_batch_tokens=2048, max_batch_rows=8, max_append_piece=256)
    batch = scheduler.schedule([long, decode])
    assert batch is not None
    assert [(r.session.session_id, r.count) for r in batch.rows] == [("decode", 1), ("long", 256)]
    # Alone too: a chunk that arrives while this step runs waits for one piece, not 900 tokens.
    alone = scheduler.schedule([long])
    assert alone is not None and [r.count for r in alone.rows] == [256]


def test_on_a_cpu_a_long_append_waits_for_a_step_without_micro_turns() -> None:
    long, decode = session("long", 900, 0), session("decode", 50, 49)
    scheduler = Scheduler(max_batch_tokens=2048, max_batch_rows=8, max_append_piece=256, piggyback=False)
    held = scheduler.schedule([long, decode])
    assert held is not None and [(r.session.session_id, r.count) for r in held.rows] == [("decode", 1)]
    alone = scheduler.schedule([long])  # between micro-turns: its piece
    assert alone is not None and [(r.session.session_id, r.count) for r in alone.rows] == [("long", 256)]


def test_on_a_cpu_a_held_append_rides_after_max_deferred_steps() -> None:
    long, decode, chunk = session("long", 900, 0), session("decode", 50, 49), session("chunk", 40, 8)
    scheduler = Scheduler(max_batch_tokens=2048, max_batch_rows=8, max_append_piece=256, piggyback=False)
    for _ in range(MAX_DEFERRED_STEPS):
        batch = scheduler.schedule([long, decode, chunk])  # a micro-turn's append is never held
        assert batch is not None and [r.session.session_id for r in batch.rows] == ["decode", "chunk"]
    forced = scheduler.schedule([long, decode, chunk])
    assert forced is not None
    assert [(r.session.session_id, r.count) for r in forced.rows] == [
        ("decode", 1),
        ("chunk", 32),
        ("long", 256),
    ]
    again = scheduler.schedule([long, decode])  # the count starts over
    assert again is not None and [r.session.session_id for r in again.rows] == ["decode"]
