"""The prefix cache: full device pages of sessions' leading tokens, indexed by their content.

A page's key is a chain: key(i) = H(key(i - 1), the tokens of page i), and key(-1) = H(the model's
identity). A key names a page's tokens *and* every token before them under one model, so a page
matches only with its whole prefix (as vLLM's block hashes do). Many sessions of one application
open with the same instructions: the first computes their KV, the others map the same pages.

What it holds (device page ids of the manager's `PageAllocator`, which counts an indexed page as
owned for as long as it is indexed):
- `_page_of` / `_key_of`: the index, key -> page and back; an indexed page is always full.
- `_refs`: how many sessions' page tables hold each indexed page. A page no session holds stays
  indexed as cache, in `_idle` (least recently let go first), until pressure takes it (`evict`).

Invariants the manager keeps (worker/engine/memory/manager.py): an indexed page is never written
again (every write of each of its holders lands past it); a session's indexed pages are a leading
run of its page table; a page with references is never evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.store.prefix_label import MAX_PUBLISHED_PREFIXES
from worker.engine.config import EngineConfig

_KEY_BYTES = 16
# Named prefixes remembered (whether or not their pages are still cached); a few times what is published.
MAX_NAMED_PREFIXES = 4 * MAX_PUBLISHED_PREFIXES


@dataclass(frozen=True)
class PrefixStats:
    """The cache's figures (`MemoryStats.prefix`, the worker's /metrics)."""

    # Indexed pages: held by sessions or idle as cache.
    cached_pages: int
    # Indexed pages held by two sessions or more, and the references (page-table entries) to them.
    shared_pages: int
    shared_references: int
    # Appends that started with no KV and looked their prefix up: found at least one page, or none.
    hits: int
    misses: int
    # Tokens whose KV came from the cache instead of a forward pass.
    tokens_reused: int
    # The names of the named prefixes whose every full page is cached, most recently named first
    # (what the worker publishes to placement: shared/store/prefix_label.py).
    held_prefixes: tuple[str, ...] = ()
    # The host tier's copies of cached pages (parked once however many parked sessions hold
    # them: host_prefix.py), and the references to them.
    host_pages: int = 0
    host_references: int = 0


def prefix_cache(config: EngineConfig, page_size: int) -> PrefixCache | None:
    """The engine's cache, None when off. The `no_session` baseline recomputes every turn's
    history by definition, so it never maps a prefix either."""
    if config.prefix_cache == "off" or config.no_session:
        return None
    return PrefixCache(model_root(config), page_size)


def model_root(config: EngineConfig) -> bytes:
    """The chain's root: the model's identity (weights, their form, the dtype and the KV's, the random
    weights' seed), so a page never matches under another model, on this worker or in another's
    published chains."""
    identity = repr((config.model, config.dtype, config.seed, config.weights, config.kv_dtype))
    return hashlib.blake2b(identity.encode(), digest_size=_KEY_BYTES).digest()


class PrefixCache:
    def __init__(self, root: bytes, page_size: int) -> None:
        self.root = root
        self.page_size = page_size
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0
        # Named prefixes (a session's open named its prefix's text): name -> the key of its last
        # full page, most recently named last; bounded.
        self._names: OrderedDict[str, bytes] = OrderedDict()

    def chain(self, tokens: Sequence[int], pages: int) -> list[bytes]:
        """The keys of the first `pages` full pages of `tokens`."""
        keys: list[bytes] = []
        previous = self.root
        size = self.page_size
        for i in range(pages):
            block = array("i", tokens[i * size : (i + 1) * size]).tobytes()
            previous = hashlib.blake2b(previous + block, digest_size=_KEY_BYTES).digest()
            keys.append(previous)
        return keys

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest leading run of `keys` that is indexed (counted as a hit or a miss)."""
        pages: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        if pages:
            self.hits += 1
            self.tokens_reused += len(pages) * self.page_size
        elif keys:
            self.misses += 1
        return pages

    def hold(self, pages: Iterable[int]) -> None:
        """A session's page table now holds these indexed pages."""
        for page in pages:
            self._refs[page] += 1
            self._idle.pop(page, None)

    def insert(self, key: bytes, page: int) -> bool:
        """Index the full page `page`, which one session holds; False (nothing changed) when `key`
        already names another page (two sessions computed the same prefix at once)."""
        if key in self._page_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        self._refs[page] = 1
        return True

    def is_indexed(self, page: int) -> bool:
        return page in self._key_of

    def key_of(self, page: int) -> bytes | None:
        """The chain key of device page `page` when it is indexed, else None."""
        return self._key_of.get(page)

    def page_of(self, key: bytes) -> int | None:
        """The cached page `key` names, if any (a restore's question: not counted as a hit or a miss)."""
        return self._page_of.get(key)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def let_go(self, page: int) -> bool:
        """A session's page table no longer holds `page`: True when it is indexed (it stays, as
        cache once nobody holds it), False when it is not (the caller frees it)."""
        refs = self._refs.get(page)
        if refs is None:
            return False
        self._refs[page] = refs - 1
        if refs == 1:
            self._idle[page] = None
        return True

    @property
    def evictable(self) -> int:
        """Indexed pages no session holds: what `evict` can give back."""
        return len(self._idle)

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def evict(self, count: int) -> list[int]:
        """Unindex up to `count` unheld pages, least recently let go first (the caller frees them)."""
        evicted: list[int] = []
        while self._idle and len(evicted) < count:
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            del self._refs[page]
            evicted.append(page)
        return evicted

    def name(self, name: str, tokens: Sequence[int]) -> None:
        """A session opened with the prefix `name` whose tokens are `tokens` (its full pages are
        the ones that may be cached: a named prefix is held while its last full page is)."""
        pages = len(tokens) // self.page_size
        if not pages:
            return
        self._names[name] = self.chain(tokens, pages)[-1]
        self._names.move_to_end(name)
        while len(self._names) > MAX_NAMED_PREFIXES:
            self._names.popitem(last=False)

    def held_names(self, most: int) -> tuple[str, ...]:
        """Up to `most` named prefixes whose pages are cached, most recently named first."""
        held: list[str] = []
        for name, key in reversed(self._names.items()):
            if len(held) == most:
                break
            if key in self._page_of:
                held.append(name)
        return tuple(held)

    def stats(self) -> PrefixStats:
        shared = [refs for refs in self._refs.values() if refs >= 2]
        return PrefixStats(
            cached_pages=len(self._key_of),
            shared_pages=len(shared),
            shared_references=sum(shared),
            hits=self.hits,
            misses=self.misses,
            tokens_reused=self.tokens_reused,
            held_prefixes=self.held_names(MAX_PUBLISHED_PREFIXES),
        )
