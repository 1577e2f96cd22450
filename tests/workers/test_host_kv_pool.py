"""The host KV pool: its copies move exactly the named slots, and its sizing refuses what the
host cannot hold, in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydix.workers.config import WorkerConfig
from raydix.workers.host_kv_pool import HostKVPool, host_pool_pages
from raydix.workers.step import SlotCopy


def _slots(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def test_writes_then_loads_move_exactly_the_named_slots() -> None:
    device = [torch.arange(8 * 2 * 3, dtype=torch.float32).reshape(8, 2, 3) + 100 * layer
              for layer in range(3)]
    before = [b.clone() for b in device]
    pool = HostKVPool(device, num_pages=4, page_size=1, pin_memory=False)
    assert pool.num_slots == 5 and [b.shape for b in pool.buffers] == [(5, 2, 3)] * 3
    # back up slots 6 and 2 into host slots 1 and 4; then load host 4 into slot 6 and host 1
    # into slot 2 in the same step: the writes come first, so the loads read them
    pool.apply(SlotCopy(_slots(6, 2), _slots(1, 4)), SlotCopy(_slots(4, 1), _slots(6, 2)))
    for layer, (dev, old) in enumerate(zip(device, before, strict=True)):
        assert torch.equal(pool.buffers[layer][1], old[6]) and torch.equal(pool.buffers[layer][4],
                                                                             old[2])
        assert torch.equal(dev[6], old[2]) and torch.equal(dev[2], old[6])
        untouched = [0, 1, 3, 4, 5, 7]
        assert torch.equal(dev[untouched], old[untouched])


def test_copies_outside_either_pool_are_refused() -> None:
    pool = HostKVPool([torch.zeros(8, 1, 2)], num_pages=2, page_size=2, pin_memory=False)
    with pytest.raises(ValueError, match="host slots"):
        pool.check(SlotCopy(_slots(2), _slots(6)), to_host=True)
    with pytest.raises(ValueError, match="device slots"):
        pool.check(SlotCopy(_slots(2), _slots(8)), to_host=False)
    with pytest.raises(ValueError, match="as many destinations"):
        SlotCopy(_slots(1, 2), _slots(3))


def test_sizing_by_ratio_or_size_and_bounded_by_host_memory() -> None:
    assert host_pool_pages(100, 1000, 3.0, 0.0, 1, 10**9) == 300
    assert host_pool_pages(100, 1000, 0.0, 0.002, 1, 10**9) == 2000
    with pytest.raises(ValueError, match=r"needs 10\.00 GB over 2 rank\(s\), more than 80% of "
                                         r"the 10\.00 GB"):
        host_pool_pages(1000, 10**6, 5.0, 0.0, 2, 10 * 10**9)
    with pytest.raises(ValueError, match="holds no page"):
        host_pool_pages(100, 10**9, 0.0, 0.5, 1, 10**12)


@pytest.mark.parametrize(("ratio", "size", "message"), [
    (1.5, 0.0, "hicache_ratio must be >= 2"),
    (-1.0, 0.0, "must be >= 0"),
    (0.0, -2.0, "must be >= 0"),
    (3.0, 1.0, "not both"),
])
def test_bad_settings_get_one_line_errors(ratio: float, size: float, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        WorkerConfig(model_path="unused", hicache_ratio=ratio, hicache_size_gb=size)
    assert "\n" not in str(info.value)
