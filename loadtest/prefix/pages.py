"""`pages`: what sessions that share a P-token prefix hold of the device pool, and how many fit it.

Figures (issue #33): the device pages `sessions` sessions hold, each the prefix and a `tail` of its
own (cache on: measured; cache off: measured on `off_sessions` of them, whose pages are per session
and add up), and how many such sessions a pool that holds `pool_sessions` of them with the cache
off keeps open with it on, with no host tier, before the first refusal or drop (target: 6x more at
P = 2,048).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadtest.long_session.common import pool_tokens, ratio, tokens
from shared.errors import CapacityExhausted
from worker.engine import Engine

# The bound at P = 2,048 with 256-token tails: at least this many times fewer pages.
PAGES_TARGET = 6.0


@dataclass(frozen=True)
class PagesConfig:
    prefixes: tuple[int, ...] = (1024, 2048)
    sessions: int = 64
    tail: int = 256
    off_sessions: int = 4
    pool_sessions: int = 4
    # Open at most this many with the cache on into the small pool (a bound on the run's time).
    most_sessions: int = 64


def _open_all(engine: Engine, prefix: list[int], count: int, tail: int, first_stream: int) -> list[str]:
    sids = []
    for i in range(count):
        sid = engine.open_session(stop_token_ids=())
        engine.run_turn(
            sid, tokens=prefix + tokens(first_stream + i, 0, tail), max_output_tokens=0, timeout=3600
        )
        sids.append(sid)
    return sids


def _fitting(engine: Engine, prefix: list[int], tail: int, most: int) -> int:
    """Sessions opened (prefix and tail each) before the first refusal or drop."""
    opened = 0
    for i in range(most):
        sid = engine.open_session(stop_token_ids=())
        try:
            engine.run_turn(sid, tokens=prefix + tokens(500 + i, 0, tail), max_output_tokens=0, timeout=3600)
        except CapacityExhausted:
            break
        if engine.stats().memory.drops:
            break
        opened += 1
    return opened


def run_pages(model: str, config: PagesConfig) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for prefix_tokens in config.prefixes:
        prefix = tokens(0, 0, prefix_tokens)
        per_session = pool_tokens(prefix_tokens + config.tail)
        options: dict[str, Any] = {
            "host_kv_tokens": 0,
            "max_chunk_tokens": per_session,
            "max_pending_tokens": per_session,
        }
        with Engine.load(
            model, kv_tokens=per_session * (config.sessions + 1), prefix_cache="on", **options
        ) as on:
            _open_all(on, prefix, config.sessions, config.tail, 100)
            on_pages, page = on.stats().pages_used, on.stats().page_size
            prefix_stats = on.stats().memory.prefix
        with Engine.load(
            model, kv_tokens=per_session * (config.off_sessions + 1), prefix_cache="off", **options
        ) as off:
            _open_all(off, prefix, config.off_sessions, config.tail, 100)
            off_pages = off.stats().pages_used * config.sessions // config.off_sessions
        small = per_session * config.pool_sessions
        with Engine.load(model, kv_tokens=small, prefix_cache="on", **options) as fitted:
            fits_on = _fitting(fitted, prefix, config.tail, config.most_sessions)
        with Engine.load(model, kv_tokens=small, prefix_cache="off", **options) as unfitted:
            fits_off = _fitting(unfitted, prefix, config.tail, config.most_sessions)
        assert prefix_stats is not None
        report[f"P{prefix_tokens}"] = {
            "sessions": config.sessions,
            "device_pages_cache_on": on_pages,
            "device_pages_cache_off": off_pages,
            "prefix_once_plus_tails": prefix_tokens // page
            + config.sessions * (-(-(prefix_tokens % page + config.tail) // page)),
            "pages_off_vs_on": ratio(off_pages, on_pages),
            "shared_pages": prefix_stats.shared_pages,
            "shared_references": prefix_stats.shared_references,
            "pool_pages": small // page,
            "sessions_fit_cache_on": fits_on,
            "sessions_fit_cache_off": fits_off,
            "fit_on_vs_off": ratio(fits_on, fits_off),
            "target": PAGES_TARGET,
        }
    return report
