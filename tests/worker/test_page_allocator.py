from __future__ import annotations

import pytest

from worker.engine.page_allocator import OutOfPages, PageAllocator


def test_allocate_and_free_round_trip() -> None:
    pool = PageAllocator(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and pool.num_free == 0
    pool.free(a)
    assert pool.num_free == 3 and sorted(pool.allocate(3)) == sorted(a)


def test_allocation_is_all_or_nothing() -> None:
    pool = PageAllocator(4)
    pool.allocate(3)
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert pool.num_free == 1


def test_double_free_is_refused() -> None:
    pool = PageAllocator(4)
    pages = pool.allocate(2)
    pool.free(pages)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(pages[:1])
    assert pool.num_free == 4
