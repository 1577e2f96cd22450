"""The host tier of one rank's KV pool (the seeds' HostKVCache).

Every buffer of the rank's device pool (K and V of each layer, `[num_slots, heads, head_dim]`
for this rank's heads) gets a host twin with the same layout and dtype, indexed by host slot:
page 0 is padding, usable host pages are 1 .. num_pages, as on the device. The memory is
pinned on CUDA (copies run at full PCIe speed) and plain on CPU, where the copy path is the
same code. The engine's host allocator (`cache/hiradix.py`) hands out the host slots; a step
plan's `device_to_host` and `host_to_device` name what to copy.

Sizing: `hicache_ratio` host tokens per device token (at least 2), or `hicache_size_gb` per
rank; at most `HOST_MEMORY_SHARE` of the host's available memory over the replica's ranks
(they share one node), which is refused in one line rather than left to the OOM killer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .step import SlotCopy, StepPlan

if TYPE_CHECKING:
    from .config import WorkerConfig
    from .kv_pool import KVPool, MLAKVPool
    from .parallel import TPGroup

logger = logging.getLogger(__name__)

HOST_MEMORY_SHARE = 0.8  # most of the host's available memory the tier may take
GB = 1e9


def available_host_bytes() -> int:
    """The host's available memory (`MemAvailable`; free pages where /proc is missing)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_pool_pages(device_pages: int, bytes_per_page: int, hicache_ratio: float,
                    hicache_size_gb: float, tp_size: int, available_bytes: int) -> int:
    """Host pages per rank for the tier: from the ratio or the size, checked against memory."""
    if hicache_size_gb > 0:
        pages = int(hicache_size_gb * GB // bytes_per_page)
        asked = f"hicache_size {hicache_size_gb:g} GB per rank"
    else:
        pages = int(device_pages * hicache_ratio)
        asked = f"hicache_ratio {hicache_ratio:g} x the device pool"
    if pages < 1:
        raise ValueError(f"{asked} holds no page of {bytes_per_page} bytes")
    need = pages * bytes_per_page * tp_size
    limit = int(available_bytes * HOST_MEMORY_SHARE)
    if need > limit:
        raise ValueError(f"the host KV tier ({asked}) needs {need / GB:.2f} GB over {tp_size} "
                         f"rank(s), more than {HOST_MEMORY_SHARE:.0%} of the "
                         f"{available_bytes / GB:.2f} GB of host memory available; lower "
                         f"hicache_ratio or hicache_size")
    return pages


class HostKVPool:
    """Host twins of a device pool's slot-indexed buffers, and the copies between them."""

    def __init__(self, device_buffers: Sequence[torch.Tensor], num_pages: int, page_size: int,
                 pin_memory: bool) -> None:
        if num_pages < 1:
            raise ValueError(f"the host KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = (num_pages + 1) * page_size
        self.device_buffers = list(device_buffers)
        self.device = self.device_buffers[0].device
        self.pinned = pin_memory
        self.buffers = [torch.empty((self.num_slots, *b.shape[1:]), dtype=b.dtype,
                                    pin_memory=pin_memory) for b in self.device_buffers]

    @property
    def max_num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers)

    def check(self, copy: SlotCopy | None, to_host: bool) -> None:
        """Raise ValueError for a copy outside either pool (before anything runs)."""
        if copy is None:
            return
        num_device_slots = self.device_buffers[0].shape[0]
        device, host = (copy.src_slots, copy.dst_slots) if to_host else (
            copy.dst_slots, copy.src_slots)
        for name, slots, limit in (("device", device, num_device_slots),
                                   ("host", host, self.num_slots)):
            if len(slots) and (int(np.min(slots)) < 0 or int(np.max(slots)) >= limit):
                raise ValueError(f"{name} slots of a host-tier copy must be in [0, {limit})")

    def apply(self, device_to_host: SlotCopy | None, host_to_device: SlotCopy | None) -> None:
        """The step's copies, before its forward: writes to the host first, then loads."""
        if device_to_host is not None and len(device_to_host):
            src = self._device_index(device_to_host.src_slots)
            dst = torch.from_numpy(device_to_host.dst_slots.astype(np.int64))
            for dev, host in zip(self.device_buffers, self.buffers, strict=True):
                host[dst] = dev.index_select(0, src).to("cpu")
        if host_to_device is not None and len(host_to_device):
            src = torch.from_numpy(host_to_device.src_slots.astype(np.int64))
            dst = self._device_index(host_to_device.dst_slots)
            for dev, host in zip(self.device_buffers, self.buffers, strict=True):
                staged = host.index_select(0, src)
                if self.pinned:
                    staged = staged.pin_memory()
                dev[dst] = staged.to(self.device, non_blocking=True)

    def _device_index(self, slots: np.ndarray) -> torch.Tensor:
        index = torch.from_numpy(slots.astype(np.int64))
        return index if self.device.type != "cuda" else index.to(self.device, non_blocking=True)


def log_host_pool(pool: HostKVPool, device_tokens: int, available_bytes: int,
                  tp_size: int) -> None:
    logger.info("host KV pool: %d tokens (%.2f GB per rank, %.1fx the device pool's %d, %s "
                "memory); %.2f GB of host memory available for %d rank(s)",
                pool.max_num_tokens, pool.num_bytes / GB, pool.max_num_tokens / device_tokens,
                device_tokens, "pinned" if pool.pinned else "plain", available_bytes / GB,
                tp_size)


def make_host_pool(config: WorkerConfig, pool: KVPool | MLAKVPool, group: TPGroup,
                   device: torch.device) -> HostKVPool:
    """The host tier's twin of the rank's KV pool; every rank gets the same number of pages."""
    from .parallel import all_reduce_min

    bytes_per_page = sum(b[0].numel() * b.element_size() for b in pool.buffers) * (
        config.page_size)
    available = available_host_bytes()
    error = None
    try:
        pages = host_pool_pages(pool.config.num_pages, bytes_per_page, config.hicache_ratio,
                                config.hicache_size_gb, config.tp_size, available)
    except ValueError as e:  # every rank must reach the collective below
        pages, error = 0, e
    pages = all_reduce_min(pages, group)
    if error is not None:
        raise error
    if pages < 1:
        raise ValueError("another rank of the replica cannot hold the host KV tier")
    host = HostKVPool(pool.buffers, pages, config.page_size, pin_memory=device.type == "cuda")
    log_host_pool(host, pool.config.max_num_tokens, available, config.tp_size)
    return host


def check_copies(host_pool: HostKVPool | None, plan: StepPlan) -> None:
    """Raise ValueError for a plan's host-tier copies that this rank cannot make."""
    if host_pool is None:
        if plan.device_to_host or plan.host_to_device:
            raise ValueError("the plan copies to or from the host KV tier, which this "
                             "rank does not have (hicache_ratio / hicache_size unset)")
        return
    host_pool.check(plan.device_to_host, to_host=True)
    host_pool.check(plan.host_to_device, to_host=False)
