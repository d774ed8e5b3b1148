"""Host buffers mapped as zeros and made resident in the background (worker/mapped_zeros.py), and the
CPU KV pool that uses them."""

from __future__ import annotations

import platform
import re
import threading
from pathlib import Path

import pytest
import torch

from worker import mapped_zeros as module
from worker.attention.kv_pool import KVPool
from worker.mapped_zeros import mapped_zeros

SMAPS = Path("/proc/self/smaps")
_release = re.match(r"(\d+)\.(\d+)", platform.release())
populates = pytest.mark.skipif(
    platform.system() != "Linux"
    or _release is None
    or (int(_release[1]), int(_release[2])) < (5, 14)
    or not SMAPS.exists(),
    reason="MADV_POPULATE_WRITE and /proc/self/smaps are Linux 5.14+",
)
MIB = 1 << 20


@pytest.fixture(autouse=True)
def normal_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite keeps both cores busy: at nice 19 a prefault could take a minute to finish."""
    monkeypatch.setattr(module, "IDLE_NICE", 0)


def resident_kib(address: int) -> int:
    """The resident KiB of the mapping that holds `address`."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


@populates
def test_a_buffer_is_zeros_at_once_and_resident_after_its_prefault() -> None:
    host = mapped_zeros(4 * MIB, torch.float32)  # 16 MiB: 8 pieces
    assert host.tensor.numel() == 4 * MIB and host.tensor.dtype == torch.float32
    assert host.resident.wait(timeout=60)
    assert resident_kib(host.tensor.data_ptr()) >= 16 * 1024
    assert not host.tensor.any()


def test_what_is_written_while_the_pages_are_populated_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    populate = module._madvise
    stored = threading.Event()
    buffers: list[module.MappedZeros] = []
    pattern = torch.arange(1, 4097, dtype=torch.float32)
    spots = [0, MIB // 2 + 5, 2 * MIB - 4096]  # in the first piece, the second, the last

    def write_then_populate(address: int, length: int, advice: int) -> int:
        assert appended.wait(timeout=10)
        if address == buffers[0].tensor.data_ptr() + module.PREFAULT_PIECE:  # the second piece
            for spot in spots:
                buffers[0].tensor[spot : spot + 4096] = pattern
            stored.set()
        return populate(address, length, advice)

    monkeypatch.setattr(module, "_madvise", write_then_populate)
    appended = threading.Event()  # the thread's first call waits for the buffer to be in `buffers`
    buffers.append(mapped_zeros(2 * MIB, torch.float32))
    appended.set()
    host = buffers[0]
    assert host.resident.wait(timeout=60) and stored.is_set()
    for spot in spots:
        assert torch.equal(host.tensor[spot : spot + 4096], pattern)
        host.tensor[spot : spot + 4096] = 0
    assert not host.tensor.any()


def test_a_dropped_buffer_stops_its_prefault(monkeypatch: pytest.MonkeyPatch) -> None:
    populate = module._madvise
    kept: list[module.MappedZeros] = []
    in_list = threading.Event()
    calls: list[int] = []

    def drop_after_the_second_piece(address: int, length: int, advice: int) -> int:
        calls.append(length)
        if len(calls) == 2:
            assert in_list.wait(timeout=10)
            kept.clear()  # the thread's own reference, for this call, is the last one left
        return populate(address, length, advice)

    monkeypatch.setattr(module, "_madvise", drop_after_the_second_piece)
    kept.append(mapped_zeros(4 * MIB, torch.float32))  # 8 pieces
    resident = kept[0].resident
    in_list.set()
    assert resident.wait(timeout=60)
    assert len(calls) == 2


def test_an_empty_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one element"):
        mapped_zeros(0, torch.float32)


@populates
def test_the_cpu_kv_pool_reads_zeros_and_becomes_resident() -> None:
    pool = KVPool(
        num_layers=2,
        num_pages=256,
        page_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
        layout="head_major",
    )
    assert pool.num_bytes == 2 * 2 * 2 * 256 * 16 * 64 * 4
    assert not pool.keys(1).any() and not pool.values(0).any()
    assert pool.resident.wait(timeout=60)
    assert resident_kib(pool.buffer.data_ptr()) >= pool.num_bytes >> 10


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise's huge pages are Linux's")
def test_a_buffer_for_scattered_reads_asks_for_huge_pages_before_any_page_is_touched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    advise = module._madvise
    asked: list[tuple[int, int]] = []

    def watch(address: int, length: int, advice: int) -> int:
        asked.append((advice, length))
        return advise(address, length, advice)

    monkeypatch.setattr(module, "_madvise", watch)
    host = mapped_zeros(4 * MIB, torch.float32, huge_pages=True)
    assert asked[0] == (module.MADV_HUGEPAGE, 16 * MIB)  # the whole buffer, before it is populated
    assert host.resident.wait(timeout=60)
    assert not host.tensor.any()
    assert {advice for advice, _ in asked[1:]} <= {module.MADV_POPULATE_WRITE}
