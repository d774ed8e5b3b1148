"""The host tier's copies of prefix-cache pages: one per key, however many parked sessions hold it.

When pressure parks idle sessions that hold the same cached device pages (an application's
instructions), the first to go copies each such page to the host and the copy is indexed here
under the page's chain key (prefix_cache.py); every other holder parked after it maps that copy
instead of copying the page again. So the host tier holds a shared prefix once, as the device did
(issue #33: parked once, not once per session). A session brought back maps the device's cached
page of the same key when there is one, and otherwise copies the page back and indexes it on the
device again, so the sessions restored after it map it there (worker/engine/memory/manager.py).

Never pinned: a copy lives exactly as long as some parked session's host table holds it; its last
holder frees it (there is no host cache of pages nobody holds). A copy is never written: a session
whose cut would write into one gives it up, as it does an indexed device page.

What it holds (host page ids of the manager's host `PageAllocator`): `_page_of` / `_key_of`, the
index key -> copy and back, and `_refs`, how many sessions' host tables hold each copy (>= 1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class HostPrefixCopies:
    def __init__(self) -> None:
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}

    def find(self, key: bytes) -> int | None:
        """The host copy of the cached page `key` names, if one is on the host."""
        return self._page_of.get(key)

    def key(self, page: int) -> bytes | None:
        """The chain key of host page `page` when it is a copy of a cached page, else None."""
        return self._key_of.get(page)

    def add(self, key: bytes, page: int) -> None:
        """Host page `page` is now the copy of `key`, held by the session that copied it."""
        assert key not in self._page_of, "one copy per key"
        self._page_of[key] = page
        self._key_of[page] = key
        self._refs[page] = 1

    def hold(self, page: int) -> None:
        """One more session's host table holds the copy `page`."""
        self._refs[page] += 1

    def let_go(self, page: int) -> bool:
        """A session's host table no longer holds `page`: True when the caller frees it (its own
        page, or a copy nobody holds any more, unindexed here), False while others hold the copy."""
        refs = self._refs.get(page)
        if refs is None:
            return True
        if refs > 1:
            self._refs[page] = refs - 1
            return False
        del self._refs[page], self._page_of[self._key_of.pop(page)]
        return True

    def freed_by_letting_go(self, tables: Iterable[list[int]]) -> int:
        """How many host pages would be free if every one of these host tables let go: their own
        pages, and the copies nobody else holds."""
        own = 0
        held: Counter[int] = Counter()
        for table in tables:
            for page in table:
                if page in self._refs:
                    held[page] += 1
                else:
                    own += 1
        return own + sum(1 for page, count in held.items() if self._refs[page] == count)

    @property
    def pages(self) -> int:
        return len(self._refs)

    @property
    def references(self) -> int:
        return sum(self._refs.values())
