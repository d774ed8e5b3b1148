"""The one owner of KV memory: device pages, the host tier, each session's window and residency.

The engine core asks it for pages before each append (`prepare`) and tells it when a turn ends
(`trim`), when a session ends (`release`) and when its KV can no longer be trusted (`forget`). It
answers with pages or a typed, retryable `CapacityExhausted` having changed nothing.

A session's KV lives in one place at a time:
- on the device: `session.pages` cover its first `num_cached` tokens (and the active turn's room);
- on the host: `session.host_pages` hold the pages that covered its first `num_cached` tokens,
  copied whole (worker/engine/memory/page_copy.py); the device pages went back to the pool;
- nowhere: `num_cached` is 0 and its next append recomputes its history from its tokens.

Pressure policy. When an append needs more device pages than are free, idle sessions (no turn
active or queued) give theirs up, least recently active first: each is parked on the host when the
tier has room, or can be given room by dropping host-resident idle sessions older than it; only
otherwise is its KV dropped. A session on the host is copied back when its next chunk arrives
(`prefetch`, if pages are free) or at the latest when its append is prepared. No deadlock by
construction: a busy session never waits for another to let go; whatever idle sessions hold can
always be taken (parked or dropped), and when that is not enough the chunk is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from shared.errors import CapacityExhausted
from shared.store.log_format import Cut
from worker.attention.kv_pool import KVPool
from worker.engine.memory.kv_transfer import KVExport, gather, page_shape, scatter, staging
from worker.engine.memory.page_allocator import PageAllocator
from worker.engine.memory.page_copy import CopyCounter, HostKVPool, PageCopier
from worker.engine.session import Session

logger = logging.getLogger(__name__)

# A client told to retry after capacity ran out waits about this long before its next try.
CAPACITY_RETRY_MS = 500


@dataclass(frozen=True)
class MemoryStats:
    """What the owner reports (`EngineStats`, the worker's /metrics)."""

    device_pages_total: int
    device_pages_used: int
    host_pages_total: int
    host_pages_used: int
    offloads: CopyCounter
    restores: CopyCounter
    # KV dropped under pressure (its session recomputes it), and the recomputes that followed.
    drops: int
    recomputes: int
    recomputed_tokens: int


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVManager:
    def __init__(self, device_pool: KVPool, host_pages: int, sessions: Mapping[str, Session]) -> None:
        self.page_size = device_pool.page_size
        self.device = PageAllocator(device_pool.num_pages)
        self.host: PageAllocator | None = None
        self.copier: PageCopier | None = None
        if host_pages > 0:
            self.host = PageAllocator(host_pages)
            self.copier = PageCopier(device_pool, HostKVPool(device_pool, host_pages))
            logger.info(
                "host KV tier: %d pages x %d tokens (%.1f MiB)",
                host_pages,
                self.page_size,
                host_pages * device_pool.page_bytes / 2**20,
            )
        # Every open session (the core's table, read only here): where eviction looks for victims.
        self.sessions = sessions
        self.drops = 0
        self.recomputes = 0
        self.recomputed_tokens = 0

    # ---- the core's questions -------------------------------------------------------------------

    def prepare(self, session: Session, cut: Cut | None, grows_by: int) -> None:
        """Get `session` ready to append `grows_by` tokens (inputs and the outputs it may ask for):
        apply `cut` to its window (the prefix's KV stays), bring its KV back from the host, and
        reserve device pages for all of it. Raises `CapacityExhausted` having changed nothing."""
        on_host = bool(session.host_pages)
        length = len(session.tokens) if cut is None else cut.keep + cut.recent
        cached = session.num_cached if cut is None else min(session.num_cached, cut.keep)
        if cut is not None:
            kept = _pages(cached, self.page_size)
        else:
            kept = len(session.host_pages) if on_host else len(session.pages)
        device_kept = 0 if on_host else kept
        fresh = max(_pages(length + grows_by, self.page_size) - device_kept, 0)
        released = 0 if on_host else len(session.pages) - kept
        available = self.device.num_free + released + self._evictable(session)
        if fresh > available:
            raise CapacityExhausted(
                f"KV pool full: {fresh} pages needed, {available} free or held by idle sessions",
                retry_after_ms=CAPACITY_RETRY_MS,
            )
        # Nothing below can fail: the pages are there.
        if cut is not None:
            self._cut(session, cut, kept, cached)
        if session.recompute and len(session.tokens) > session.num_cached:
            self.recomputes += 1
            self.recomputed_tokens += len(session.tokens) - session.num_cached
        session.recompute = False
        if fresh > self.device.num_free:
            self._evict(fresh, keep=session)
        if session.host_pages:
            self._restore(session)
            fresh -= len(session.pages)
        last = session.pages[-1] if session.pages else None
        session.pages.extend(self.device.allocate(fresh, after=last))

    def prefetch(self, session: Session) -> None:
        """A chunk arrived for a session parked on the host: start copying it back now if the pages
        are free, so the copy overlaps the wait for its turn (`prepare` does it otherwise)."""
        if session.host_pages and len(session.host_pages) <= self.device.num_free:
            self._restore(session)

    def trim(self, session: Session) -> None:
        """A turn ended: give back the pages reserved for outputs it did not produce."""
        needed = _pages(len(session.tokens), self.page_size)
        if len(session.pages) > needed:
            self.device.free(session.pages[needed:])
            del session.pages[needed:]

    def release(self, session: Session) -> None:
        """The session ended: every page it held, in either tier, is free."""
        self.device.free(session.pages)
        if self.host is not None:
            self.host.free(session.host_pages)
        session.pages, session.host_pages, session.num_cached = [], [], 0

    def forget(self, session: Session) -> None:
        """The session's KV cannot be used (a failed step, or the no-session baseline): its next
        append recomputes its history."""
        self.release(session)
        session.recompute = True

    def stats(self) -> MemoryStats:
        if self.copier is not None:
            self.copier.settle()
        return MemoryStats(
            device_pages_total=self.device.num_pages,
            device_pages_used=self.device.num_used,
            host_pages_total=self.host.num_pages if self.host is not None else 0,
            host_pages_used=self.host.num_used if self.host is not None else 0,
            # Copies: a snapshot, not the copier's live counters (a before/after difference works).
            offloads=replace(self.copier.offloaded) if self.copier is not None else CopyCounter(),
            restores=replace(self.copier.restored) if self.copier is not None else CopyCounter(),
            drops=self.drops,
            recomputes=self.recomputes,
            recomputed_tokens=self.recomputed_tokens,
        )

    # ---- internals ------------------------------------------------------------------------------

    def _cut(self, session: Session, cut: Cut, kept: int, cached: int) -> None:
        """Apply `cut`: the first `kept` pages (the prefix's KV) stay where they are."""
        if session.host_pages:
            assert self.host is not None
            self.host.free(session.host_pages[kept:])
            del session.host_pages[kept:]
        else:
            self.device.free(session.pages[kept:])
            del session.pages[kept:]
        session.num_cached = cached
        session.tokens = cut.apply(session.tokens)

    def _evictable(self, keep: Session) -> int:
        return sum(len(s.pages) for s in self.sessions.values() if s is not keep and not s.is_busy)

    def _evict(self, free_wanted: int, *, keep: Session) -> None:
        """Park or drop idle sessions, least recently active first, until `free_wanted` pages are free."""
        idle = sorted(
            (s for s in self.sessions.values() if s is not keep and not s.is_busy and s.pages),
            key=lambda s: s.last_activity,
        )
        for session in idle:
            if self.device.num_free >= free_wanted:
                return
            self._park(session)

    def _park(self, session: Session) -> None:
        pages = _pages(session.num_cached, self.page_size)
        if pages and self._host_room(pages, session):
            assert self.host is not None and self.copier is not None
            host_pages = self.host.allocate(pages)
            self.copier.to_host(session.pages[:pages], host_pages)
            self.device.free(session.pages)
            session.pages, session.host_pages = [], host_pages
            logger.debug("parked the KV of idle session %s on the host (%d pages)", session.session_id, pages)
            return
        self._drop(session, "its next chunk recomputes it")

    def _drop(self, session: Session, why: str) -> None:
        """Pressure took an idle session's KV (device or host): counted, and recomputed when needed."""
        self.forget(session)
        self.drops += 1
        logger.info("dropped the KV of idle session %s: %s", session.session_id, why)

    def _host_room(self, pages: int, for_session: Session) -> bool:
        """Whether the host tier holds `pages` more, after dropping parked idle sessions older than
        `for_session` (oldest first) if it must."""
        if self.host is None or pages > self.host.num_pages:
            return False
        if self.host.num_free >= pages:
            return True
        older = sorted(
            (
                s
                for s in self.sessions.values()
                if s.host_pages and not s.is_busy and s.last_activity <= for_session.last_activity
            ),
            key=lambda s: s.last_activity,
        )
        if self.host.num_free + sum(len(s.host_pages) for s in older) < pages:
            return False
        for session in older:
            if self.host.num_free >= pages:
                break
            self._drop(session, "room on the host for a newer one")
        return True

    def _restore(self, session: Session) -> None:
        assert self.host is not None and self.copier is not None
        pages = self.device.allocate(len(session.host_pages))
        self.copier.to_device(session.host_pages, pages)
        self.host.free(session.host_pages)
        session.pages, session.host_pages = pages, []

    # ---- a drain's copy: KV that leaves for another worker, or arrives from one -----------------

    def export_kv(self, session: Session, device_pool: KVPool) -> KVExport:
        """A copy of `session`'s KV (its first `num_cached` tokens, whole pages) for another worker,
        gathered from whichever tier holds each page (the device's first, then the host tier's:
        a parked session may keep a leading run on the device); the session keeps its pages."""
        count = _pages(session.num_cached, self.page_size)
        on_device = session.pages[:count]
        on_host = session.host_pages[: count - len(on_device)]
        paged, axis = device_pool.paged(), device_pool.page_axis
        data = staging(paged, axis, len(on_device) + len(on_host))
        stream = self.copier.stream if self.copier is not None else None
        ready = gather(paged, axis, on_device, data, stream=stream)
        if on_host:
            assert self.copier is not None
            if stream is not None:  # an offload to these pages may still be running
                stream.synchronize()
            gather(
                self.copier.host_paged,
                axis,
                on_host,
                data.narrow(0, len(on_device), len(on_host)),
                stream=None,
            )
        return KVExport(session.tokens[: session.num_cached], data, ready)

    def import_kv(self, session: Session, data: torch.Tensor, tokens: int, device_pool: KVPool) -> None:
        """Give a session just opened (no pages yet) the KV of its first `tokens` tokens from
        page-major `data` (another worker's pages, any shape of the same elements): into the host
        tier when it has room (where an idle session waits; its first turn brings it to the
        device), else into free device pages.
        Raises `CapacityExhausted` having changed nothing when neither has room (evicting sessions
        here for a copy that can be rebuilt instead is not worth it)."""
        assert not session.pages and not session.host_pages
        data = data.view(-1, *page_shape(device_pool.paged(), device_pool.page_axis))
        count = _pages(tokens, self.page_size)
        if count > data.shape[0]:
            raise ValueError(f"{tokens} tokens need {count} pages, the copy has {data.shape[0]}")
        if self.host is not None and self.copier is not None and self.host.num_free >= count:
            session.host_pages = self.host.allocate(count)
            scatter(data, self.copier.host_paged, self.copier.axis, session.host_pages)
        elif self.device.num_free >= count:
            session.pages = self.device.allocate(count)
            scatter(data, device_pool.paged(), device_pool.page_axis, session.pages)
        else:
            raise CapacityExhausted(
                f"no room for a copy of {count} KV pages", retry_after_ms=CAPACITY_RETRY_MS
            )
        session.num_cached = tokens
        session.recompute = False  # what is not in the copy is computed for the first time here
