"""The CPU KV pool is made from the kernel's zero pages: nothing is written at start, and a
slot's pages are touched when it is first used (`host_memory.zeroed`)."""

from __future__ import annotations

import resource

import torch

from raydix.workers.kv_pool import KVPool, KVPoolConfig

PAGE = 4096


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_cpu_pool_is_made_without_touching_its_pages() -> None:
    # 40 MiB per buffer: above glibc's largest mmap threshold, so torch.zeros would map fresh
    # pages and fault every one of them (about 41,000) while filling them
    config = KVPoolConfig(num_pages=40 * 1024 - 1, page_size=1, num_layers=2, num_kv_heads=4,
                          head_dim=64, dtype=torch.float32)
    before = _minor_faults()
    pool = KVPool(config, "cpu")
    assert _minor_faults() - before < 1000
    assert pool.num_bytes == 4 * (40 << 20)
    pointers = {b.data_ptr() for b in pool.buffers}
    assert len(pointers) == 4 and all(p % PAGE == 0 for p in pointers)  # a mapping each
    for b in pool.buffers:
        assert b.shape == (config.num_slots, 4, 64) and b.dtype == torch.float32
        assert b.is_contiguous() and not bool(b.any())  # zeros, as torch.zeros gave
    k = torch.randn(2, 4, 64)
    v = torch.randn(2, 4, 64)
    slots = torch.tensor([7, 40_000])
    pool.set_kv(1, slots, k, v)
    assert torch.equal(pool.k_buffers[1][slots], k) and torch.equal(pool.v_buffers[1][slots], v)
    assert not bool(pool.k_buffers[0].any()) and int(pool.k_buffers[1].count_nonzero()) == k.numel()
