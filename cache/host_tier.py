"""The host tier's rules, as pure functions over tree nodes; ``HiRadixCache`` keeps the state.

A node is on the device (a non-empty ``value``), in host memory (``host_value``), or both, and
device nodes form the top of every path (see hiradix.py).
"""

from __future__ import annotations

import numpy as np

from .base import PrefixHandle
from .req_table import SlotArray
from .tree_node import TreeNode
from .tree_paths import path_nodes

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
DEFAULT_WRITE_POLICY = "write_through_selective"
_ITEM = 4
_EMPTY = np.zeros(0, dtype=np.int32)


def hits_to_write(write_policy: str, write_through_threshold: int) -> int:
    """Hits (inserts that cover a device node) after which the node is copied to the host: 1
    with ``write_through``, the threshold with ``write_through_selective`` (``write_back``
    copies on device eviction instead). Refuses an unknown policy or a threshold below 1."""
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
    if write_through_threshold < 1:
        raise ValueError(f"write_through_threshold must be >= 1, got {write_through_threshold}")
    return 1 if write_policy == "write_through" else write_through_threshold


def split_tiers(
    node: TreeNode, matched: int, values: list[SlotArray]
) -> tuple[SlotArray, TreeNode, int]:
    """A path of ``matched`` tokens ending at ``node`` (``values``: each node's device slots,
    top first) as its device part (slots and last node) and the host-only length below it."""
    device_node = node
    while len(device_node.value) == 0 and device_node.parent is not None:
        device_node = device_node.parent
    device_values = [v for v in values if len(v)]
    slots = np.concatenate(device_values) if device_values else _EMPTY
    return slots, device_node, matched - len(slots)


def host_only_path(handle: PrefixHandle) -> list[TreeNode] | None:
    """The handle's host-only nodes, top first, from right below ``handle.node`` down to
    ``handle.host_node``; None when that path no longer holds ``handle.host_len`` tokens on
    the host only (it was dropped, loaded or cut differently since the match)."""
    node = handle.host_node
    if not handle.host_len or not isinstance(node, TreeNode) or node.detached:
        return None
    path = path_nodes(node, handle.node)
    if not path or path[0].parent is not handle.node or any(len(n.value) for n in path):
        return None
    if sum(len(n.key) for n in path) // _ITEM != handle.host_len:
        return None
    return path


def host_evictable(node: TreeNode) -> bool:
    """A host-only leaf that no queued load reads: the host tier's eviction may drop it."""
    return node.parent is not None and not len(node.value) and not node.children and not (
        node.loading)
