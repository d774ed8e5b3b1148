"""The one owner of KV memory: device pages, the host tier, each session's window and residency.

The engine core asks it for pages before each append (`prepare`) and tells it when a turn ends
(`trim`), when a session ends (`release`) and when its KV can no longer be trusted (`forget`). It
answers with pages or a typed, retryable `CapacityExhausted` having changed nothing.

A session's KV lives in one place at a time:
- on the device: `session.pages` cover its first `num_cached` tokens (and the active turn's room);
- on the host: `session.host_pages` hold the pages that covered its first `num_cached` tokens,
  copied whole (worker/engine/memory/page_copy.py); the device pages went back to the pool, but
  for a leading run of prefix-cache pages other sessions hold too, which stay in `session.pages`
  (shared, not copied once per session). A session's table is always its device pages first, then
  its host pages;
- nowhere: `num_cached` is 0 and its next append recomputes its history from its tokens.

Pressure policy. When an append needs more device pages than are free, idle sessions (no turn
active or queued) give theirs up, least recently active first: each is parked on the host when the
tier has room, or can be given room by dropping host-resident idle sessions older than it; only
otherwise is its KV dropped. A session on the host is copied back when its next chunk arrives
(`prefetch`, if pages are free) or at the latest when its append is prepared. No deadlock by
construction: a busy session never waits for another to let go; whatever idle sessions hold can
always be taken (parked or dropped), and when that is not enough the chunk is refused.

Prefix cache (`prefix_cache.py`, when on). An append that starts with no KV anywhere (a session's
first, or the recompute after its KV was dropped or lost: a restore, a warm copy) maps the longest
chain of cached full pages its tokens begin with, and computes only the rest; when its turn ends,
the full pages it computed are indexed for the sessions after it. No other append hashes or looks
anything up. A shared page is referenced, never copied; the last page an append writes in (the
one holding its last token) is never mapped, and a page is indexed only once it lies wholly before
the session's last cached token, so no holder ever writes into an indexed page (a cut that would
write into one gives it up and recomputes that page's tokens). Under pressure the cache's pages
no session holds go first (least recently let go), before idle sessions are parked; a page any
session holds is only ever let go of by its holders. Parking: an idle session copies to the host
only what is its own while other sessions hold its shared pages; when pressure needs those too
(every holder idle), each cached page is copied to the host once, by its first holder to go, and
the others map that copy (`host_prefix.py`). A restore maps the device's cached page of a copy's
key if there is one, else copies it back and indexes it there again.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from shared.errors import CapacityExhausted
from shared.store.log_format import Cut
from worker.attention.kv_pool import KVPool
from worker.engine.memory.host_prefix import HostPrefixCopies
from worker.engine.memory.kv_transfer import KVExport, gather, page_shape, scatter, staging
from worker.engine.memory.page_allocator import PageAllocator
from worker.engine.memory.page_copy import CopyCounter, HostKVPool, PageCopier
from worker.engine.memory.prefix_cache import PrefixCache, PrefixStats
from worker.engine.session import Session

logger = logging.getLogger(__name__)

# A client told to retry after capacity ran out waits about this long before its next try.
CAPACITY_RETRY_MS = 500


@dataclass(frozen=True)
class MemoryStats:
    """What the owner reports (`EngineStats`, the worker's /metrics)."""

    device_pages_total: int
    # Pages sessions hold. The prefix cache's pages no session holds count as free: they are the
    # first to go when an append needs them.
    device_pages_used: int
    host_pages_total: int
    host_pages_used: int
    offloads: CopyCounter
    restores: CopyCounter
    # KV dropped under pressure (its session recomputes it), and the recomputes that followed.
    drops: int
    recomputes: int
    recomputed_tokens: int
    # The prefix cache (None: off).
    prefix: PrefixStats | None = None


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVManager:
    def __init__(
        self,
        device_pool: KVPool,
        host_pages: int,
        sessions: Mapping[str, Session],
        prefix: PrefixCache | None = None,
    ) -> None:
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
        self.prefix = prefix
        # The host copies of cached pages, shared by the parked sessions that held them (None: off).
        self.host_copies = HostPrefixCopies() if prefix is not None else None
        # Sessions whose append started with no KV and whose turn has not ended: the keys of the
        # full pages that append covers, and how many of them it mapped from the cache.
        self._to_index: dict[str, tuple[list[bytes], int]] = {}

    # ---- the core's questions -------------------------------------------------------------------

    def prepare(self, session: Session, cut: Cut | None, inputs: Sequence[int], outputs: int) -> None:
        """Get `session` ready to append `inputs` and up to `outputs` sampled tokens: apply `cut` to
        its window (the prefix's KV stays), bring its KV back from the host, map what the prefix
        cache holds of it, and reserve device pages for all of it. Raises `CapacityExhausted` having
        changed nothing."""
        grows_by = len(inputs) + outputs
        length = len(session.tokens) if cut is None else cut.keep + cut.recent
        cached = session.num_cached if cut is None else min(session.num_cached, cut.keep)
        if cut is not None:
            kept, cached = self._kept_by_cut(session, cut, cached, refeeds=not inputs and bool(outputs))
        else:
            kept = len(session.pages) + len(session.host_pages)
        device_kept = min(kept, len(session.pages))
        keys, mapped = self._look_up(session, cut, inputs)
        # Host pages it keeps that are copies of pages cached on the device: mapped, not copied back.
        remap = self._cached_on_device(session.host_pages[: kept - device_kept])
        remapped = [page for page in remap if page is not None]
        fresh = max(_pages(length + grows_by, self.page_size) - device_kept - len(mapped) - len(remapped), 0)
        released = self._freed_by_letting_go(session.pages[kept:])
        available = self.device.num_free + released
        if fresh > available:
            available += self._takeable(session, [*mapped, *remapped])
        if fresh > available:
            raise CapacityExhausted(
                f"KV pool full: {fresh} pages needed, {available} free or held by idle sessions",
                retry_after_ms=CAPACITY_RETRY_MS,
            )
        # Nothing below can fail: the pages are there.
        if cut is not None:
            self._cut(session, cut, kept, cached)
        if keys:
            self._map(session, keys, mapped)
        if session.recompute and len(session.tokens) > session.num_cached:
            self.recomputes += 1
            self.recomputed_tokens += len(session.tokens) - session.num_cached
        session.recompute = False
        if self.prefix is not None:
            self.prefix.hold(remapped)  # before eviction, which takes only pages nobody holds
        if fresh > self.device.num_free:
            self._evict(fresh, keep=session, held=remapped)
        if session.host_pages:
            fresh -= self._restore(session, remap)
        last = session.pages[-1] if session.pages else None
        session.pages.extend(self.device.allocate(fresh, after=last))

    def prefetch(self, session: Session) -> None:
        """A chunk arrived for a session parked on the host: start copying it back now if the pages
        are free, so the copy overlaps the wait for its turn (`prepare` does it otherwise)."""
        if not session.host_pages:
            return
        remap = self._cached_on_device(session.host_pages)
        remapped = [page for page in remap if page is not None]
        if len(session.host_pages) - len(remapped) <= self.device.num_free:
            if self.prefix is not None:
                self.prefix.hold(remapped)
            self._restore(session, remap)

    def trim(self, session: Session) -> None:
        """A turn ended: give back the pages reserved for outputs it did not produce."""
        needed = _pages(len(session.tokens), self.page_size)
        if len(session.pages) > needed:
            self._let_go(session.pages[needed:])
            del session.pages[needed:]
        if self._to_index:
            indexing = self._to_index.pop(session.session_id, None)
            if indexing is not None:
                self._index(session, *indexing)

    def truncate(self, session: Session, length: int) -> None:
        """A rewind: the session's history becomes its first `length` tokens (the core shortens
        `tokens`). The KV before the end stays where it is, in either tier; the pages past it go
        back to the pool with no forward pass, and the shared pages among them stay the cache's,
        untouched (other sessions hold them).

        Shared pages are never written, so a rewind into the prefix cache's pages copies on write
        by recomputing: when the page holding the new last cached token is indexed, the session
        gives it up and its few tokens (at most a page) are fed again into a page of its own by the
        next append. Only the page of the last cached token matters: indexed pages are a leading
        run, and the next append writes at that token (a re-fed last token) or after it."""
        cached = min(session.num_cached, length)
        kept = _pages(cached, self.page_size)
        # The page may be on the device (a cached page) or on the host (a shared copy of one).
        held = len(session.pages) + len(session.host_pages)
        if 0 < kept <= held and self._is_shared_copy(session, kept - 1):
            kept -= 1
            cached = kept * self.page_size
        indexing = self._to_index.pop(session.session_id, None)
        self._keep_pages(session, kept, cached)
        if indexing is not None:  # the pages its cancelled turn computed before the end still count
            self._index(session, *indexing)

    def release(self, session: Session) -> None:
        """The session ended: every page it held, in either tier, is free (or cache, if indexed)."""
        self._to_index.pop(session.session_id, None)
        self._let_go(session.pages)
        self._free_host(session.host_pages)
        session.pages, session.host_pages, session.num_cached = [], [], 0

    def forget(self, session: Session) -> None:
        """The session's KV cannot be used (a failed step, or the no-session baseline): its next
        append recomputes its history."""
        self.release(session)
        session.recompute = True

    def name_prefix(self, name: str, tokens: Sequence[int]) -> None:
        """Sessions open with the prefix `name`, of these tokens (published to placement while cached)."""
        if self.prefix is not None:
            self.prefix.name(name, tokens)

    def stats(self) -> MemoryStats:
        if self.copier is not None:
            self.copier.settle()
        return MemoryStats(
            device_pages_total=self.device.num_pages,
            device_pages_used=self.device.num_used
            - (self.prefix.evictable if self.prefix is not None else 0),
            host_pages_total=self.host.num_pages if self.host is not None else 0,
            host_pages_used=self.host.num_used if self.host is not None else 0,
            # Copies: a snapshot, not the copier's live counters (a before/after difference works).
            offloads=replace(self.copier.offloaded) if self.copier is not None else CopyCounter(),
            restores=replace(self.copier.restored) if self.copier is not None else CopyCounter(),
            drops=self.drops,
            recomputes=self.recomputes,
            recomputed_tokens=self.recomputed_tokens,
            prefix=self._prefix_stats(),
        )

    def _prefix_stats(self) -> PrefixStats | None:
        if self.prefix is None or self.host_copies is None:
            return None
        copies = self.host_copies
        return replace(self.prefix.stats(), host_pages=copies.pages, host_references=copies.references)

    # ---- internals ------------------------------------------------------------------------------

    def _cut(self, session: Session, cut: Cut, kept: int, cached: int) -> None:
        """Apply `cut`: the first `kept` pages (the prefix's KV) stay where they are."""
        self._keep_pages(session, kept, cached)
        session.tokens = cut.apply(session.tokens)

    def _keep_pages(self, session: Session, kept: int, cached: int) -> None:
        """The session keeps its first `kept` pages (device ones, then host ones: a parked session
        may keep a leading shared run on the device), holding its first `cached` tokens; it lets go
        of the rest, so shared pages past them stay the cache's and only its own are freed."""
        on_device = len(session.pages)
        if session.host_pages:
            self._free_host(session.host_pages[max(kept - on_device, 0) :])
            del session.host_pages[max(kept - on_device, 0) :]
        self._let_go(session.pages[kept:])
        del session.pages[kept:]
        session.num_cached = cached

    def _takeable(self, keep: Session, mapped: Sequence[int]) -> int:
        """Device pages pressure can free for `keep`'s append, which will hold `mapped`: the cache's
        pages no session holds, and the pages only idle sessions hold (parked or dropped, they let
        go of them)."""
        held = set(mapped)
        takeable = self.prefix.evictable - sum(map(self.prefix.is_idle, held)) if self.prefix else 0
        idle_refs: Counter[int] = Counter()
        for session in self.sessions.values():
            if session is keep or session.is_busy:
                continue
            for page in session.pages:
                if self.prefix is not None and self.prefix.is_indexed(page):
                    idle_refs[page] += 1
                else:
                    takeable += 1
        if self.prefix is not None:
            takeable += sum(
                1 for page, refs in idle_refs.items() if page not in held and self.prefix.refs(page) == refs
            )
        return takeable

    def _evict(self, free_wanted: int, *, keep: Session, held: Sequence[int] = ()) -> None:
        """Take the cache's unheld pages, then park or drop idle sessions, least recently active
        first, until `free_wanted` pages are free (`held`: cached pages `keep` holds already, but
        its table does not list yet)."""
        self._evict_cache(free_wanted)
        # First each idle session's own pages (the shared pages others hold stay). Then, if that
        # was not enough, the shared pages only idle sessions hold, each copied to the host once:
        # all that can always be taken. A page a busy session (or `keep`) holds stays: parking
        # its other holders would free nothing.
        in_use = {*held, *(p for s in self.sessions.values() if s is keep or s.is_busy for p in s.pages)}
        for keep_shared in (True, False):
            idle = sorted(
                (s for s in self.sessions.values() if s is not keep and not s.is_busy and s.pages),
                key=lambda s: s.last_activity,
            )
            for session in idle:
                if self.device.num_free >= free_wanted:
                    return
                count = _pages(session.num_cached, self.page_size) - len(session.host_pages)
                if keep_shared:
                    stay = self._shared_run(session.pages[:count])
                else:
                    stay = next((i for i, p in enumerate(session.pages) if p not in in_use), count)
                self._park(session, stay=stay)
                self._evict_cache(free_wanted)

    def _evict_cache(self, free_wanted: int) -> None:
        if self.prefix is not None and self.device.num_free < free_wanted:
            self.device.free(self.prefix.evict(free_wanted - self.device.num_free))

    # ---- the prefix cache -----------------------------------------------------------------------

    def _look_up(
        self, session: Session, cut: Cut | None, inputs: Sequence[int]
    ) -> tuple[list[bytes], list[int]]:
        """For an append that starts with no KV: the keys of the full pages it covers (all but the
        page of its last token, which it must feed) and the cached pages it can map. Otherwise none."""
        if self.prefix is None or session.num_cached or session.pages or session.host_pages:
            return [], []
        history = session.tokens if cut is None else cut.apply(session.tokens)
        sequence = [*history, *inputs]
        keys = self.prefix.chain(sequence, (len(sequence) - 1) // self.page_size)
        return keys, self.prefix.lookup(keys)

    def _map(self, session: Session, keys: list[bytes], mapped: list[int]) -> None:
        """The append starts from the cached pages; its other full pages are indexed when its turn ends."""
        assert self.prefix is not None
        self.prefix.hold(mapped)
        session.pages = list(mapped)
        session.num_cached = len(mapped) * self.page_size
        if len(keys) > len(mapped):
            self._to_index[session.session_id] = (keys, len(mapped))

    def _index(self, session: Session, keys: list[bytes], start: int) -> None:
        """The turn that computed these pages ended: index those wholly before its last cached token."""
        assert self.prefix is not None
        written = min(len(keys), (session.num_cached - 1) // self.page_size, len(session.pages))
        for i in range(start, written):
            if not self.prefix.insert(keys[i], session.pages[i]):
                return  # computed twice at once: the other copy is the cached one from here on

    def _kept_by_cut(self, session: Session, cut: Cut, cached: int, *, refeeds: bool) -> tuple[int, int]:
        """The pages a cut keeps and the tokens they hold: the prefix's, less the last one if it is
        indexed and the session would write into it after the cut (at `cached`, or at `cached - 1`
        when the turn re-feeds the last token for its logits: no input and nothing left to feed)."""
        kept = _pages(cached, self.page_size)
        if self.prefix is None or not kept:
            return kept, cached
        writes_from = cached - 1 if refeeds and cut.recent == 0 and cached == cut.keep else cached
        if self._is_shared_copy(session, kept - 1) and kept * self.page_size > writes_from:
            kept -= 1
            cached = kept * self.page_size  # the tokens after it are fed again, into a page of its own
        return kept, cached

    def _is_shared_copy(self, session: Session, index: int) -> bool:
        """Whether page `index` of the session's table is a cached page (on the device) or a host
        copy of one (which its restore maps or indexes again): never to be written into."""
        on_device = len(session.pages)
        if index < on_device:
            return self.prefix is not None and self.prefix.is_indexed(session.pages[index])
        host_page = session.host_pages[index - on_device]
        return self.host_copies is not None and self.host_copies.key(host_page) is not None

    def _freed_by_letting_go(self, pages: Sequence[int]) -> int:
        """How many of `pages` become free or evictable cache when a session lets go of them."""
        if self.prefix is None:
            return len(pages)
        return sum(1 for page in pages if not self.prefix.is_indexed(page) or self.prefix.refs(page) == 1)

    def _let_go(self, pages: Sequence[int]) -> None:
        """A session's table drops `pages`: its own are freed, indexed ones stay as cache (a chain's
        last pages first in line for eviction)."""
        if self.prefix is None:
            self.device.free(pages)
            return
        self.device.free([page for page in reversed(pages) if not self.prefix.let_go(page)])

    def _park(self, session: Session, *, stay: int) -> None:
        """Copy the session's KV to the host and let go of its device pages, but for its first
        `stay` pages (cached pages others hold: nothing to gain there). A cached page whose copy
        is on the host already is mapped there, not copied again."""
        pages = _pages(session.num_cached, self.page_size) - len(session.host_pages)
        stay = min(stay, pages)
        if session.host_pages and stay == len(session.pages):
            return  # parked already, but for pages others hold
        moving = session.pages[stay:pages]
        if not moving:
            self._let_go(session.pages[stay:])
            del session.pages[stay:]
            return
        copies = [self._host_copy(page) for page in moving]
        for copy in copies:  # held before making room: the drops that make it must not free them
            if copy is not None and self.host_copies is not None:
                self.host_copies.hold(copy)
        to_copy = [page for page, copy in zip(moving, copies, strict=True) if copy is None]
        if self._host_room(len(to_copy), session):
            assert self.host is not None and self.copier is not None
            allocated = self.host.allocate(len(to_copy))
            if to_copy:
                self.copier.to_host(to_copy, allocated)
            targets = iter(allocated)
            host_pages = []
            for page, copy in zip(moving, copies, strict=True):
                if copy is not None:
                    host_pages.append(copy)
                    continue
                target = next(targets)
                key = self.prefix.key_of(page) if self.prefix is not None else None
                if key is not None and self.host_copies is not None:
                    self.host_copies.add(key, target)  # the other holders parked after it map it
                host_pages.append(target)
            self._let_go(session.pages[stay:])
            session.pages = session.pages[:stay]
            session.host_pages = host_pages + session.host_pages
            logger.debug(
                "parked the KV of idle session %s on the host (%d pages, %d copied, %d shared stay)",
                session.session_id,
                len(moving),
                len(to_copy),
                stay,
            )
            return
        self._free_host([copy for copy in copies if copy is not None])
        self._drop(session, "its next chunk recomputes it")

    def _host_copy(self, page: int) -> int | None:
        """The host copy of device page `page`, when it is cached and a copy is on the host."""
        if self.prefix is None or self.host_copies is None:
            return None
        key = self.prefix.key_of(page)
        return self.host_copies.find(key) if key is not None else None

    def _cached_on_device(self, host_pages: Sequence[int]) -> list[int | None]:
        """For each host page: the device page cached under its key when it is a copy, else None."""
        if self.prefix is None or self.host_copies is None:
            return [None] * len(host_pages)
        remap: list[int | None] = []
        for page in host_pages:
            key = self.host_copies.key(page)
            remap.append(self.prefix.page_of(key) if key is not None else None)
        return remap

    def _free_host(self, pages: Sequence[int]) -> None:
        """A session's host table drops `pages`: its own are freed, a copy when nobody holds it."""
        if self.host is None:
            return
        copies = self.host_copies
        self.host.free([page for page in pages if copies is None or copies.let_go(page)])

    def _shared_run(self, pages: Sequence[int]) -> int:
        """How many leading `pages` are cached pages another session holds too."""
        if self.prefix is None:
            return 0
        run = 0
        for page in pages:
            if not self.prefix.is_indexed(page) or self.prefix.refs(page) < 2:
                break
            run += 1
        return run

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
                if s.host_pages
                and s is not for_session
                and not s.is_busy
                and s.last_activity <= for_session.last_activity
            ),
            key=lambda s: s.last_activity,
        )
        if self.host_copies is not None:
            freed = self.host_copies.freed_by_letting_go(s.host_pages for s in older)
        else:
            freed = sum(len(s.host_pages) for s in older)
        if self.host.num_free + freed < pages:
            return False
        for session in older:
            if self.host.num_free >= pages:
                break
            self._drop(session, "room on the host for a newer one")
        return True

    def _restore(self, session: Session, remap: Sequence[int | None]) -> int:
        """Bring the session's host pages back after the device pages it kept: those `remap` names
        (cached device pages of the same key, held for it already) are mapped, the others copied
        into fresh pages; a copied copy of a cached page is indexed on the device again. How many
        fresh device pages it took."""
        assert self.host is not None and self.copier is not None
        to_copy = [page for page, cached in zip(session.host_pages, remap, strict=True) if cached is None]
        targets = self.device.allocate(len(to_copy), after=session.pages[-1] if session.pages else None)
        if to_copy:
            self.copier.to_device(to_copy, targets)
        fresh = iter(targets)
        for page, cached in zip(session.host_pages, remap, strict=True):
            if cached is not None:
                session.pages.append(cached)
                continue
            target = next(fresh)
            key = self.host_copies.key(page) if self.host_copies is not None else None
            if key is not None and self.prefix is not None:
                self.prefix.insert(key, target)  # the sessions restored after it map it here
            session.pages.append(target)
        self._free_host(session.host_pages)
        session.host_pages = []
        return len(to_copy)

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
            self.copier.wait_for_host()  # CUDA: an offload to these pages may still be running
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
        page-major `data` (another worker's pages, any shape of the same elements). On an
        accelerator: into the host tier when it has room (where an idle session waits; its first
        turn brings it to the device), else into free device pages. On the CPU the other way round:
        the device pool is host memory too, so a copy there is already where its first turn reads
        it (through the host tier it was copied twice on the engine thread, the first time into
        pages never touched before, a page fault per 4 KB: ~64 ms of the engine thread per 18 MB
        session in a loaded drain, docs/benchmarks.md "What a drain's copies cost").
        Raises `CapacityExhausted` having changed nothing when neither has room (evicting sessions
        here for a copy that can be rebuilt instead is not worth it)."""
        assert not session.pages and not session.host_pages
        data = data.view(-1, *page_shape(device_pool.paged(), device_pool.page_axis))
        count = _pages(tokens, self.page_size)
        if count > data.shape[0]:
            raise ValueError(f"{tokens} tokens need {count} pages, the copy has {data.shape[0]}")
        host_has_room = self.host is not None and self.copier is not None and self.host.num_free >= count
        device_first = device_pool.device.type == "cpu" and self.device.num_free >= count
        if host_has_room and not device_first:
            assert self.host is not None and self.copier is not None
            session.host_pages = self.host.allocate(count)
            self.copier.wait_for_host()  # CUDA: a restore may still be reading pages just freed
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
