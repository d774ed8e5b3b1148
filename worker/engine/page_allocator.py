"""Hands out KV page ids from a fixed pool. Pure Python, no torch: the memory itself is `worker.kv_pool`.

Invariant: every page id is either on the free stack or owned by exactly one session's page table.
`allocate` is all-or-nothing, so a failed request leaves the pool untouched.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfPages(Exception):
    """Raised when fewer pages are free than asked for; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the page pool needs at least one page")
        self.num_pages = num_pages
        # A stack, lowest ids on top: recently freed pages are reused first (warm in cache).
        self._free = list(range(num_pages - 1, -1, -1))
        self._owned = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count < 0:
            raise ValueError(f"cannot allocate {count} pages")
        if count > len(self._free):
            raise OutOfPages(f"{count} pages wanted, {len(self._free)} free")
        pages = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        for page in pages:
            self._owned[page] = 1
        return pages[::-1]

    def free(self, pages: Iterable[int]) -> None:
        released = list(pages)
        for page in released:
            if not self._owned[page]:
                raise ValueError(f"page {page} freed twice or never allocated")
            self._owned[page] = 0
        self._free.extend(reversed(released))
