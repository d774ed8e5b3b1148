"""Hands out KV page ids from a fixed pool. Pure Python, no torch: the memory is `worker.attention.kv_pool`.

Invariant: every page id is either free or owned: by exactly one session's page table, or by the
prefix cache, which indexes it for any number of sessions' tables to hold and counts them
(prefix_cache.py). `allocate` is all-or-nothing, so a failed request leaves the pool untouched.

Placement keeps sessions contiguous where it can: a session grows into the pages right after its
last one when they are free, and a new run starts in the middle of the largest free gap, so the
sessions on both sides keep room to grow. A contiguous page table lets an attention backend read
a session's KV as one view of the pool instead of gathering it page by page. When the pool is too
fragmented for that, any free pages do: contiguity is a speed-up, never a requirement.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_FREE_RUN = re.compile(rb"\x00+")


class OutOfPages(Exception):
    """Raised when fewer pages are free than asked for; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the page pool needs at least one page")
        self.num_pages = num_pages
        self._owned = bytearray(num_pages)  # 0 free, 1 owned
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def allocate(self, count: int, *, after: int | None = None) -> list[int]:
        """`count` pages; with `after` (the table's last page), the pages following it if all are free."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} pages")
        if count > self._num_free:
            raise OutOfPages(f"{count} pages wanted, {self._num_free} free")
        if count == 0:
            return []
        if after is not None:
            following = range(after + 1, after + 1 + count)
            fits = following.stop <= self.num_pages
            if fits and self._owned.find(1, following.start, following.stop) == -1:
                return self._take(following)
        start = self._roomy_start(count)
        if start is not None:
            return self._take(range(start, start + count))
        # Fragmented: the lowest free pages. count <= num_free guarantees each search finds one.
        pages: list[int] = []
        position = 0
        while len(pages) < count:
            found = self._owned.find(0, position)
            pages.append(found)
            position = found + 1
        return self._take(pages)

    def free(self, pages: Iterable[int]) -> None:
        released = list(pages)
        for page in released:
            if not self._owned[page]:
                raise ValueError(f"page {page} freed twice or never allocated")
        for page in released:
            self._owned[page] = 0
        self._num_free += len(released)

    def _roomy_start(self, count: int) -> int | None:
        best_start, best_length = 0, 0
        for run in _FREE_RUN.finditer(self._owned):
            if run.end() - run.start() > best_length:
                best_start, best_length = run.start(), run.end() - run.start()
        if best_length < count:
            return None
        if best_start == 0:  # nobody on the left needs room
            return 0
        return best_start + (best_length - count) // 2

    def _take(self, pages: Iterable[int]) -> list[int]:
        taken = list(pages)
        for page in taken:
            self._owned[page] = 1
        self._num_free -= len(taken)
        return taken
