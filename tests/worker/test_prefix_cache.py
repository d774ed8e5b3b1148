"""The prefix cache: sessions that open with the same tokens share their full pages, counted once.

Mechanics (pages, references, the pressure order, the switch) run the `tiny` preset; exactness runs
SmolLM2-135M's real weights against an engine with the cache off, case by case (issue #33, point 4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from shared.errors import CapacityExhausted
from shared.protocol.messages import OpenConfig
from tests.worker.smollm2 import engine_on
from worker.engine import Engine, TurnResult
from worker.engine.memory.manager import MemoryStats
from worker.engine.memory.prefix_cache import PrefixStats
from worker.model.loader import LoadedModel

PAGE = 16
PREFIX = [(3 * j) % 200 + 1 for j in range(100)]  # 6 full pages and 4 tokens


def _tail(i: int, n: int = 8) -> list[int]:
    return [(17 * i + 5 * j) % 200 + 1 for j in range(n)]


def _prefix(engine: Engine) -> PrefixStats:
    stats = engine.stats().memory.prefix
    assert stats is not None
    return stats


def test_sessions_with_the_same_opening_map_its_full_pages_once() -> None:
    with Engine.load("tiny", kv_tokens=64 * PAGE, page_size=PAGE, host_kv_tokens=0) as engine:
        sids = [engine.open_session(stop_token_ids=()) for _ in range(3)]
        engine.run_turn(sids[0], tokens=PREFIX + _tail(0), max_output_tokens=2, timeout=60)
        # 110 tokens with the outputs: 7 pages, of which the 6 wholly before the last token are indexed.
        assert engine.stats().pages_used == 7
        assert _prefix(engine) == PrefixStats(6, 0, 0, hits=0, misses=1, tokens_reused=0)
        before = engine.stats().tokens_forwarded
        engine.run_turn(sids[1], tokens=PREFIX + _tail(1), max_output_tokens=2, timeout=60)
        # Only its own 12 tokens (4 of the prefix's partial page and its 8) were fed, then one decode.
        assert engine.stats().tokens_forwarded - before == 4 + 8 + 1
        engine.run_turn(sids[2], tokens=PREFIX + _tail(2), max_output_tokens=2, timeout=60)
        assert engine.stats().pages_used == 6 + 3  # the prefix once, one private page each
        assert _prefix(engine) == PrefixStats(6, 6, 18, hits=2, misses=1, tokens_reused=2 * 96)
        # Later micro-turns never look anything up.
        for sid in sids:
            engine.run_turn(sid, tokens=[5, 6], max_output_tokens=1, timeout=60)
        assert (_prefix(engine).hits, _prefix(engine).misses) == (2, 1)


def test_a_partial_last_page_is_never_shared() -> None:
    with Engine.load("tiny", kv_tokens=64 * PAGE, page_size=PAGE, host_kv_tokens=0) as engine:
        first, second = engine.open_session(stop_token_ids=()), engine.open_session(stop_token_ids=())
        engine.run_turn(first, tokens=PREFIX, max_output_tokens=0, timeout=60)
        engine.run_turn(second, tokens=PREFIX, max_output_tokens=0, timeout=60)
        # 100 tokens: pages 0-5 shared; page 6 (tokens 96-99) is each session's own.
        assert _prefix(engine).shared_pages == 6 and engine.stats().pages_used == 8


def test_references_return_to_zero_and_the_whole_pool_can_be_had_again() -> None:
    with Engine.load("tiny", kv_tokens=16 * PAGE, page_size=PAGE, host_kv_tokens=0) as engine:
        sids = [engine.open_session(stop_token_ids=()) for _ in range(3)]
        for i, sid in enumerate(sids):
            engine.run_turn(sid, tokens=PREFIX + _tail(i), max_output_tokens=2, timeout=60)
        for sid in sids:
            engine.close_session(sid)
        stats = _prefix(engine)
        assert (stats.shared_pages, stats.shared_references) == (0, 0)
        # What stays is cache nobody holds, which counts as free: the pool is whole again.
        assert stats.cached_pages == 6 and engine.stats().pages_used == 0
        whole = engine.open_session(stop_token_ids=())
        result = engine.run_turn(whole, tokens=_tail(9, 200), max_output_tokens=50, timeout=60)
        assert len(result.tokens) == 50 and engine.stats().pages_used == 16
        engine.close_session(whole)
        assert engine.stats().memory.drops == 0


def test_cache_entries_go_before_idle_sessions_are_parked() -> None:
    with Engine.load("tiny", kv_tokens=16 * PAGE, page_size=PAGE, host_kv_tokens=64 * PAGE) as engine:
        computing = engine.open_session(stop_token_ids=())
        engine.run_turn(computing, tokens=PREFIX + _tail(0), max_output_tokens=2, timeout=60)
        engine.close_session(computing)  # its 6 indexed pages stay as cache
        idle = engine.open_session(stop_token_ids=())
        engine.run_turn(idle, tokens=_tail(1, 60), max_output_tokens=2, timeout=60)  # 4 pages
        newcomer = engine.open_session(stop_token_ids=())
        # 8 pages: 10 are free or cache, so 2 of the closed session's cached pages go.
        engine.run_turn(newcomer, tokens=_tail(2, 120), max_output_tokens=2, timeout=60)
        memory = engine.stats().memory
        assert memory.offloads.count == 0 and memory.drops == 0  # the idle session kept its pages
        assert memory.device_pages_used == 4 + 8  # held; the rest of the pool is unheld cache
        # Indexed: 4 of the closed session's 6, the idle session's 3, the newcomer's 7.
        assert memory.prefix is not None and memory.prefix.cached_pages == 4 + 3 + 7


def test_a_page_a_busy_session_holds_is_never_taken_and_the_refusal_stays_typed() -> None:
    with Engine.load("tiny", kv_tokens=12 * PAGE, page_size=PAGE, host_kv_tokens=64 * PAGE) as engine:
        idle, busy = engine.open_session(stop_token_ids=()), engine.open_session(stop_token_ids=())
        engine.run_turn(idle, tokens=PREFIX + _tail(0), max_output_tokens=1, timeout=60)
        running = engine.submit(busy, tokens=PREFIX + _tail(1), max_output_tokens=40)
        # The busy one holds the 6 shared pages and 3 of its own; the idle one is parked (its
        # private page freed), but the shared pages stay: there is not room for 4 more pages.
        other = engine.open_session(stop_token_ids=())
        refused = engine.submit(other, tokens=_tail(2, 60), max_output_tokens=8)
        with pytest.raises(CapacityExhausted) as error:
            refused.result(timeout=60)
        assert error.value.retry_after_ms is not None
        assert len(running.result(timeout=60).tokens) == 40
        # The parked session comes back exactly as if it had stayed (checked below with weights).
        engine.run_turn(idle, tokens=[1, 2], max_output_tokens=2, timeout=60)


def test_a_parked_session_copies_only_its_own_pages_while_others_hold_the_shared_ones() -> None:
    with Engine.load("tiny", kv_tokens=16 * PAGE, page_size=PAGE, host_kv_tokens=64 * PAGE) as engine:
        first, second = engine.open_session(stop_token_ids=()), engine.open_session(stop_token_ids=())
        engine.run_turn(first, tokens=PREFIX + _tail(0), max_output_tokens=1, timeout=60)
        engine.run_turn(second, tokens=PREFIX + _tail(1), max_output_tokens=1, timeout=60)
        # 6 shared + 1 + 1 pages held; a newcomer of 9 pages parks `first` (the least recent): its
        # one page of its own goes to the host, the 6 shared pages stay for `second`.
        newcomer = engine.open_session(stop_token_ids=())
        engine.run_turn(newcomer, tokens=_tail(2, 140), max_output_tokens=2, timeout=60)
        memory = engine.stats().memory
        assert memory.offloads.pages == 1 and memory.host_pages_used == 1 and memory.drops == 0
        assert memory.prefix is not None and memory.prefix.shared_references == 12
        # Back from the host: one page copied, the turn feeds only its own tokens.
        before = engine.stats().tokens_forwarded
        engine.run_turn(first, tokens=[1, 2], max_output_tokens=1, timeout=60)
        assert engine.stats().memory.restores.pages == 1
        assert engine.stats().tokens_forwarded - before == 1 + 2


def test_idle_sessions_park_the_shared_pages_once_and_map_them_again_when_they_come_back() -> None:
    # `second` comes back through a cut whose kept prefix (20 tokens) ends inside the 2nd shared
    # page: it must not write into that page, which `first` maps (it re-feeds those 4 tokens).
    window = {"max_context_tokens": 130, "context_policy": "truncate", "keep_prefix_tokens": 20}

    def scenario(engine: Engine) -> tuple[list[TurnResult], list[Any]]:
        first = engine.open_session(stop_token_ids=(), logprobs=True)
        second = engine.open_session(stop_token_ids=(), logprobs=True, retention_ratio=1.0, **window)
        results = [
            engine.run_turn(sid, tokens=PREFIX + _tail(i), max_output_tokens=1, timeout=60)
            for i, sid in enumerate((first, second))
        ]
        # 6 shared + 1 + 1 pages held; a crowd of 13 pages takes the shared pages too (only idle
        # sessions hold them): their own pages go to the host, and the 6 shared pages once.
        crowd = engine.open_session(stop_token_ids=())
        engine.run_turn(crowd, tokens=_tail(3, 200), max_output_tokens=2, timeout=60)
        figures: list[Any] = [engine.stats().memory]
        engine.close_session(crowd)
        results.append(engine.run_turn(first, tokens=[3], max_output_tokens=2, timeout=60))
        figures.append(engine.stats().memory)
        results.append(engine.run_turn(second, tokens=_tail(4, 25), max_output_tokens=2, timeout=60))
        assert results[-1].cut is not None
        figures.append(engine.stats().memory)
        results.append(engine.run_turn(first, tokens=[4], max_output_tokens=2, timeout=60))
        for sid in (first, second):
            engine.close_session(sid)
        figures.append(engine.stats())
        return results, figures

    options: dict[str, Any] = {"kv_tokens": 16 * PAGE, "page_size": PAGE, "host_kv_tokens": 64 * PAGE}
    with Engine.load("tiny", prefix_cache="off", **options) as alone:
        expected, _ = scenario(alone)
    with Engine.load("tiny", **options) as engine:
        got, (parked, first_back, second_back, closed) = scenario(engine)
    assert parked.drops == 0 and parked.prefix is not None
    # Host pages: the prefix once and one page of each session's own (not 2 x (6 + 1)).
    assert parked.host_pages_used == parked.offloads.pages == 6 + 2
    assert (parked.prefix.host_pages, parked.prefix.host_references) == (6, 12)
    # `first` copies back what the crowd evicted from the device cache (3 of the 6, the chain's
    # last pages first) and its own page, maps the other 3, and indexes the 3 it copied again.
    assert first_back.restores.pages == 3 + 1 and first_back.prefix is not None
    assert (first_back.prefix.shared_pages, first_back.prefix.host_pages) == (0, 6)
    # `second`'s cut keeps 1 page (mapped: nothing copied) and lets go of the host copies.
    assert second_back.restores.pages == 4 and second_back.host_pages_used == 0
    assert second_back.prefix is not None and second_back.prefix.shared_references == 2
    assert closed.memory.prefix is not None and closed.memory.prefix.host_pages == 0
    assert closed.pages_used == 0 and closed.memory.host_pages_used == 0  # no page leaks
    # Exact: the same tokens and logprobs as with the cache off (each session parked whole).
    assert [r.tokens for r in got] == [r.tokens for r in expected]
    for have, want in zip(got, expected, strict=True):
        assert have.logprobs is not None and want.logprobs is not None
        assert max(abs(a - b) for a, b in zip(have.logprobs, want.logprobs, strict=True)) < 1e-4


def test_a_named_prefix_is_held_while_its_pages_are_cached() -> None:
    with Engine.load("tiny", kv_tokens=16 * PAGE, page_size=PAGE, host_kv_tokens=0) as engine:
        engine.name_prefix("app-a", PREFIX).result(timeout=10)
        assert _prefix(engine).held_prefixes == ()  # named, not computed yet
        sid = engine.open_session(stop_token_ids=())
        engine.run_turn(sid, tokens=PREFIX + _tail(0), max_output_tokens=1, timeout=60)
        engine.close_session(sid)
        assert _prefix(engine).held_prefixes == ("app-a",)  # cached, though nobody holds it
        crowd = engine.open_session(stop_token_ids=())
        engine.run_turn(crowd, tokens=_tail(1, 240), max_output_tokens=1, timeout=60)
        assert _prefix(engine).held_prefixes == ()  # evicted for the crowd


def test_a_warm_copy_and_a_restored_history_map_the_prefix_and_feed_only_the_rest() -> None:
    with Engine.load("tiny", kv_tokens=64 * PAGE, page_size=PAGE, host_kv_tokens=0) as engine:
        first = engine.open_session(stop_token_ids=(), logprobs=True)
        engine.run_turn(first, tokens=PREFIX + _tail(0), max_output_tokens=1, timeout=60)
        # A warm copy (a drain's handover) of a session whose history begins with the prefix.
        before = engine.stats().tokens_forwarded
        copy = engine.warm_async("copy", config=OpenConfig(stop_token_ids=()), history=PREFIX + _tail(1))
        copy.result(timeout=60)
        assert engine.stats().tokens_forwarded - before == 100 + 8 - 96
        # A session restored from its log (opened with its history): its next append maps it too.
        restored = engine.open_session(history=PREFIX + _tail(2), stop_token_ids=())
        before = engine.stats().tokens_forwarded
        engine.run_turn(restored, tokens=[7, 8], max_output_tokens=1, timeout=60)
        assert engine.stats().tokens_forwarded - before == 100 + 8 + 2 - 96
        stats = _prefix(engine)
        assert (stats.hits, stats.misses, stats.tokens_reused) == (2, 1, 2 * 96)
        assert engine.stats().memory.recomputed_tokens == 2 * (100 + 8 - 96)  # both: what was not mapped


def test_off_shares_nothing() -> None:
    with Engine.load(
        "tiny", kv_tokens=64 * PAGE, page_size=PAGE, host_kv_tokens=0, prefix_cache="off"
    ) as engine:
        sids = [engine.open_session(stop_token_ids=()) for _ in range(2)]
        for i, sid in enumerate(sids):
            engine.run_turn(sid, tokens=PREFIX + _tail(i), max_output_tokens=2, timeout=60)
        assert engine.stats().memory.prefix is None and engine.stats().pages_used == 14


# ---- exactness with real weights: each case against the same turns with the cache off --------------

Scenario = Callable[[Engine], list[TurnResult]]
# An application's instructions: 13 full pages of SmolLM2's vocabulary and 4 tokens more.
INSTRUCTIONS = [(7919 * j) % 40000 + 100 for j in range(212)]


def _exact(loaded: LoadedModel, scenario: Scenario, **options: Any) -> PrefixStats:
    """Run `scenario` with the cache off, then on (both on the run's one SmolLM2 load): the same
    tokens and logprobs. The cache's figures."""
    with engine_on(loaded, prefix_cache="off", **options) as alone:
        expected = scenario(alone)
    with engine_on(loaded, **options) as shared:
        got = scenario(shared)
        prefix = _prefix(shared)
    assert [r.tokens for r in got] == [r.tokens for r in expected]
    for have, want in zip(got, expected, strict=True):
        assert have.logprobs is not None and want.logprobs is not None
        assert (
            max((abs(a - b) for a, b in zip(have.logprobs, want.logprobs, strict=True)), default=0.0) < 1e-4
        )
    assert prefix.hits >= 1
    return prefix


def _opening(i: int) -> list[int]:
    return INSTRUCTIONS + [2000 + 7 * i + j for j in range(5)]


def _open(engine: Engine, **options: Any) -> str:
    return engine.open_session(stop_token_ids=(), logprobs=True, **options)


def _micro_turns(engine: Engine, sids: list[str], rounds: int) -> list[TurnResult]:
    results = []
    for turn in range(rounds):
        futures = [
            engine.submit(sid, tokens=[300 + turn, 301 + i], max_output_tokens=3)
            for i, sid in enumerate(sids)
        ]
        results += [f.result(timeout=120) for f in futures]
    return results


@pytest.mark.slow
def test_exact_with_several_sessions_at_once(smollm2_model: LoadedModel) -> None:
    def scenario(engine: Engine) -> list[TurnResult]:
        first = _open(engine)
        results = [engine.run_turn(first, tokens=_opening(0), max_output_tokens=4, timeout=120)]
        sids = [_open(engine) for _ in range(3)]
        futures = [
            engine.submit(sid, tokens=_opening(i + 1), max_output_tokens=4) for i, sid in enumerate(sids)
        ]
        results += [f.result(timeout=120) for f in futures]
        return results + _micro_turns(engine, [first, *sids], 2)

    prefix = _exact(smollm2_model, scenario, kv_tokens=4096, host_kv_tokens=0)
    assert prefix.hits == 3 and prefix.shared_pages == 13 and prefix.shared_references == 4 * 13


@pytest.mark.slow
def test_exact_after_the_computing_session_closed_and_after_eviction_and_recompute(
    smollm2_model: LoadedModel,
) -> None:
    def scenario(engine: Engine) -> list[TurnResult]:
        computing = _open(engine)
        results = [engine.run_turn(computing, tokens=_opening(0), max_output_tokens=3, timeout=120)]
        engine.close_session(computing)
        after_close = _open(engine)
        results.append(engine.run_turn(after_close, tokens=_opening(1), max_output_tokens=3, timeout=120))
        results += _micro_turns(engine, [after_close], 2)
        engine.close_session(after_close)
        # A long session takes the whole pool: the cached pages nobody holds are evicted.
        crowd = _open(engine)
        results.append(
            engine.run_turn(
                crowd, tokens=[(31 * j) % 9000 + 50 for j in range(500)], max_output_tokens=2, timeout=120
            )
        )
        engine.close_session(crowd)
        recomputing = _open(engine)
        results.append(engine.run_turn(recomputing, tokens=_opening(2), max_output_tokens=3, timeout=120))
        remapping = _open(engine)
        results.append(engine.run_turn(remapping, tokens=_opening(3), max_output_tokens=3, timeout=120))
        return results + _micro_turns(engine, [recomputing, remapping], 2)

    prefix = _exact(smollm2_model, scenario, kv_tokens=32 * PAGE, host_kv_tokens=0)
    assert (prefix.hits, prefix.misses) == (2, 3)  # the crowd missed too


@pytest.mark.slow
def test_exact_after_a_host_round_trip(smollm2_model: LoadedModel) -> None:
    parked: list[MemoryStats] = []

    def scenario(engine: Engine) -> list[TurnResult]:
        sids = [_open(engine) for _ in range(3)]
        results = [
            engine.run_turn(sid, tokens=_opening(i), max_output_tokens=3, timeout=120)
            for i, sid in enumerate(sids)
        ]
        # 13 shared pages and 1 of each session's own; a newcomer's 19 pages in a pool of 24 park
        # them all on the host (the shared pages once), and each comes back in turn.
        other = _open(engine)
        tokens = [(31 * j) % 9000 + 50 for j in range(300)]
        results.append(engine.run_turn(other, tokens=tokens, max_output_tokens=2, timeout=120))
        parked.append(engine.stats().memory)
        for j, sid in enumerate(sids):
            results.append(engine.run_turn(sid, tokens=[300, 301 + j], max_output_tokens=3, timeout=120))
        return results

    with_cache = _exact(smollm2_model, scenario, kv_tokens=24 * PAGE, host_kv_tokens=64 * PAGE)
    assert with_cache.hits == 2
    off, on = parked
    assert off.drops == on.drops == 0 and on.prefix is not None
    assert off.host_pages_used == 3 * 14 and on.host_pages_used == 13 + 3
    assert (on.prefix.host_pages, on.prefix.host_references) == (13, 3 * 13)


@pytest.mark.slow
def test_exact_across_cuts_that_keep_part_of_the_shared_prefix(smollm2_model: LoadedModel) -> None:
    # The opening is 217 tokens; turns of 24 + 2 cut before the 4th turn, keeping 40 tokens (2.5
    # of the 13 shared pages: the 3rd is given up and its 8 kept tokens re-fed) and the recent ones.
    options = {
        "max_context_tokens": 300,
        "context_policy": "truncate",
        "keep_prefix_tokens": 40,
        "retention_ratio": 0.8,
    }

    def scenario(engine: Engine) -> list[TurnResult]:
        sids = [_open(engine, **options) for _ in range(2)]
        results = [
            engine.run_turn(sid, tokens=_opening(i), max_output_tokens=3, timeout=120)
            for i, sid in enumerate(sids)
        ]
        for turn in range(5):
            for i, sid in enumerate(sids):
                chunk = [(97 * turn + 13 * j + i) % 9000 + 100 for j in range(24)]
                results.append(engine.run_turn(sid, tokens=chunk, max_output_tokens=2, timeout=120))
        assert sum(r.cut is not None for r in results) == 2  # each session's, kept prefix shared
        return results

    _exact(smollm2_model, scenario, kv_tokens=4096, host_kv_tokens=0)
