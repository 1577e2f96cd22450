"""The host tier's copies between device and host slots, queued for the next step plan."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .req_table import SlotArray
from .tree_node import TreeNode

_EMPTY = np.zeros(0, dtype=np.int32)


class KVCopies(NamedTuple):
    """Copies for the ranks to make before a step's forward: device->host writes first, then
    host->device loads, each a pair of equal-length slot arrays (source, destination)."""

    write_device_slots: SlotArray
    write_host_slots: SlotArray
    load_host_slots: SlotArray
    load_device_slots: SlotArray

    @property
    def num_tokens(self) -> int:
        return len(self.write_device_slots) + len(self.load_host_slots)


def _concat(parts: list[SlotArray]) -> SlotArray:
    return np.concatenate(parts).astype(np.int32, copy=False) if parts else _EMPTY.copy()


class CopyQueue:
    """Writes and loads in the order queued, and the nodes being loaded (``loading``): their
    host slots feed a queued load, so host eviction must keep them until the drain."""

    def __init__(self) -> None:
        self._writes: list[tuple[SlotArray, SlotArray]] = []  # (device, host)
        self._loads: list[tuple[SlotArray, SlotArray]] = []  # (host, device)
        self.loading: list[TreeNode] = []

    def __bool__(self) -> bool:
        return bool(self._writes or self._loads)

    def write(self, device_slots: SlotArray, host_slots: SlotArray) -> None:
        self._writes.append((device_slots, host_slots))

    def load(self, host_slots: SlotArray, device_slots: SlotArray) -> None:
        self._loads.append((host_slots, device_slots))

    def hold(self, node: TreeNode) -> None:
        if not node.loading:
            node.loading = True
            self.loading.append(node)

    def drain(self) -> KVCopies:
        """Everything queued since the last drain; the nodes being loaded are free again."""
        copies = KVCopies(
            _concat([d for d, _ in self._writes]), _concat([h for _, h in self._writes]),
            _concat([h for h, _ in self._loads]), _concat([d for _, d in self._loads]))
        self._writes, self._loads = [], []
        for node in self.loading:
            node.loading = False
        self.loading = []
        return copies
