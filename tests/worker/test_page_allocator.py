from __future__ import annotations

import pytest

from worker.engine.memory.page_allocator import OutOfPages, PageAllocator


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


def test_sessions_grow_contiguously_and_new_runs_leave_room() -> None:
    pool = PageAllocator(100)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a == [0, 1]
    assert b[0] > 40, "a new run starts mid-gap, leaving room for the session before it"
    a += pool.allocate(3, after=a[-1])
    b += pool.allocate(3, after=b[-1])
    assert a == list(range(0, 5)) and b == list(range(b[0], b[0] + 5))


def test_fragmented_pool_still_serves_any_free_pages() -> None:
    pool = PageAllocator(6)
    pages = pool.allocate(6)
    pool.free(pages[::2])  # free pages 0, 2, 4: no two adjacent
    got = pool.allocate(3, after=5)
    assert sorted(got) == [0, 2, 4] and pool.num_free == 0
