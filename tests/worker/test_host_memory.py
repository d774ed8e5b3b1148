"""Host buffers mapped as zeros and made resident in the background (worker/host_memory.py), and the
CPU KV pool that uses them."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from worker.attention.kv_pool import KVPool
from worker.host_memory import zeroed_host_buffer

SMAPS = Path("/proc/self/smaps")
populates = pytest.mark.skipif(
    platform.system() != "Linux"
    or tuple(int(part) for part in platform.release().split(".")[:2]) < (5, 14)
    or not SMAPS.exists(),
    reason="MADV_POPULATE_WRITE and /proc/self/smaps are Linux 5.14+",
)


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
    host = zeroed_host_buffer(24 << 20, torch.float32)  # 96 MiB: three prefault pieces
    assert host.tensor.numel() == 24 << 20 and host.tensor.dtype == torch.float32
    assert host.resident.wait(timeout=60)
    assert resident_kib(host.tensor.data_ptr()) >= 96 << 10
    assert not host.tensor.any()


def test_what_is_written_while_the_pages_are_populated_is_kept() -> None:
    host = zeroed_host_buffer(16 << 20, torch.float32)
    pattern = torch.arange(1, 4097, dtype=torch.float32)
    spots = [0, 3 << 20, (8 << 20) + 5, (16 << 20) - 4096]  # in each prefault piece
    for spot in spots:
        host.tensor[spot : spot + 4096] = pattern
    assert host.resident.wait(timeout=60)
    for spot in spots:
        assert torch.equal(host.tensor[spot : spot + 4096], pattern)
        host.tensor[spot : spot + 4096] = 0
    assert not host.tensor.any()


def test_a_dropped_buffer_stops_its_prefault() -> None:
    host = zeroed_host_buffer(64 << 20, torch.float32)
    resident = host.resident
    del host
    assert resident.wait(timeout=60)


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
