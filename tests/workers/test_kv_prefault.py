"""A CPU KV pool's pages populated ahead of use while the engine is idle (`kv_prefault.py`):
from slot 0 up, a chunk per call, no further than the set distance past the slots in use, the
K/V already there kept, K/V writes into populated slots without page faults, and nothing at all
once the kernel refuses the call."""

from __future__ import annotations

import ctypes
import mmap
import resource

import numpy as np
import pytest
import torch

from raydix.cache.allocator import PagedSlotAllocator
from raydix.workers.kv_pool import KVPool, KVPoolConfig
from raydix.workers.kv_prefault import KVPrefault

PAGE = mmap.PAGESIZE
ROW = 4 * 64 * 4  # one slot of one buffer: 4 heads of 64 float32, 1 KiB


def _pool(num_slots: int = 4096) -> KVPool:
    return KVPool(KVPoolConfig(num_pages=num_slots - 1, page_size=1, num_layers=2,
                               num_kv_heads=4, head_dim=64, dtype=torch.float32), "cpu")


def _resident(buf: torch.Tensor) -> np.ndarray:
    """Per 4 KiB page of `buf`: whether it is in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    num_bytes = buf.numel() * buf.element_size()
    vec = (ctypes.c_ubyte * (-(-num_bytes // PAGE)))()
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(ctypes.c_void_p(buf.data_ptr()), num_bytes, vec) == 0
    return np.frombuffer(vec, dtype=np.uint8) & 1 == 1


def _slot_page(slot: int) -> int:
    return slot * ROW // PAGE


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_populates_from_slot_zero_a_chunk_at_a_time_up_to_the_distance_ahead() -> None:
    pool = _pool()
    # 4 buffers of 1 KiB a slot: 16 slots a chunk, 256 slots ahead of those in use
    prefault = KVPrefault(pool.buffers, chunk_bytes=64 << 10, ahead_bytes=1 << 20)
    assert (prefault.slots_per_chunk, prefault.ahead_slots) == (16, 256)
    assert not any(_resident(b).any() for b in pool.buffers)
    assert prefault.step(in_use=1)
    assert prefault.populated == 16
    for b in pool.buffers:
        resident = _resident(b)
        assert resident[:_slot_page(16)].all() and not resident[_slot_page(16):].any()
    steps = 1
    while prefault.step(in_use=1):
        steps += 1
    assert prefault.populated == 257 and steps == -(-257 // 16)
    for b in pool.buffers:
        resident = _resident(b)
        assert resident[:_slot_page(256) + 1].all()
        assert not resident[_slot_page(257) + 1:].any()
    # writing K/V into the populated slots faults none of their pages in; on a lazy pool the
    # same write faults in 62 pages a buffer
    assert _faults_writing(pool) < _faults_writing(_pool()) - 4 * 60


def _faults_writing(pool: KVPool) -> int:
    k, v = torch.randn(250, 4, 64), torch.randn(250, 4, 64)
    slots = torch.arange(1, 251)
    pool.set_kv(0, slots[:1], k[:1], v[:1])  # the write's own first-call costs
    before = _minor_faults()
    for layer in range(2):
        pool.set_kv(layer, slots, k, v)
    return _minor_faults() - before


def test_follows_the_slots_in_use_and_stops_at_the_pool_end() -> None:
    pool = _pool(num_slots=1024)
    prefault = KVPrefault(pool.buffers, chunk_bytes=64 << 10, ahead_bytes=1 << 20)
    while prefault.step(in_use=1):
        pass
    assert prefault.populated == 257
    assert not prefault.step(in_use=1)  # the distance ahead is in
    while prefault.step(in_use=600):
        pass
    assert prefault.populated == 856
    while prefault.step(in_use=1024):
        pass
    assert prefault.populated == 1024 and all(_resident(b).all() for b in pool.buffers)
    assert not prefault.step(in_use=1024)


def test_the_kv_in_populated_slots_is_kept() -> None:
    pool = _pool()
    slots = torch.tensor([3, 17, 100, 255])
    k, v = torch.randn(4, 4, 64), torch.randn(4, 4, 64)
    pool.set_kv(1, slots, k, v)
    prefault = KVPrefault(pool.buffers, chunk_bytes=64 << 10, ahead_bytes=1 << 20)
    while prefault.step(in_use=256):
        pass
    assert prefault.populated == 512
    assert torch.equal(pool.k_buffers[1][slots], k) and torch.equal(pool.v_buffers[1][slots], v)
    assert int(pool.k_buffers[1].count_nonzero()) == k.numel()
    assert not bool(pool.k_buffers[0].any()) and not bool(pool.v_buffers[0].any())


def test_a_refused_call_stops_populating_for_good(caplog: pytest.LogCaptureFixture) -> None:
    pool = _pool()
    calls = []

    def refuse(addr: int, length: int, advice: int) -> int:
        calls.append((addr, length, advice))
        ctypes.set_errno(22)
        return -1

    prefault = KVPrefault(pool.buffers, chunk_bytes=64 << 10, madvise=refuse)
    with caplog.at_level("INFO", logger="raydix.workers.kv_prefault"):
        assert not prefault.step(in_use=1)
    assert not prefault.step(in_use=1) and prefault.populated == 0
    assert len(calls) == 1 and calls[0][0] % PAGE == 0 and calls[0][2] == 23
    assert "fault in on first use" in caplog.text
    assert not any(_resident(b).any() for b in pool.buffers)


def test_buffers_of_different_slot_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="same slots"):
        KVPrefault([torch.zeros(8, 2), torch.zeros(9, 2)])
    with pytest.raises(ValueError, match="no buffers"):
        KVPrefault([])


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_allocators_high_water_slot_only_rises(page_size: int) -> None:
    alloc = PagedSlotAllocator(num_pages=16, page_size=page_size)
    assert alloc.high_water_slot == page_size  # the padding page only
    first = alloc.alloc(3 * page_size)
    assert first is not None and alloc.high_water_slot == 4 * page_size
    second = alloc.alloc(page_size)
    assert second is not None and alloc.high_water_slot == 5 * page_size
    alloc.free(first)
    alloc.free(second)
    assert alloc.high_water_slot == 5 * page_size
    while alloc.alloc(page_size) is not None:  # freed pages go out after the untouched ones
        pass
    assert alloc.high_water_slot == 17 * page_size
    alloc.clear()
    assert alloc.high_water_slot == 17 * page_size
