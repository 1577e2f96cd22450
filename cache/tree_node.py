"""A node of the radix tree with its two structural edits (split, detach), and the one conversion
and check of token ids that every key goes through.

Sizes, locks, access times and events are the cache's (radix.py): nothing here touches them."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .base import TokenArray
from .req_table import SlotArray

_ITEM = 4  # bytes per int32 token id


class TreeNode:
    __slots__ = ("children", "detached", "hit_count", "host_value", "id", "key", "last_access",
                 "loading", "lock_ref", "parent", "value")

    def __init__(
        self, key: bytes, value: SlotArray, parent: TreeNode | None, tick: int, node_id: int
    ) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = tick
        self.detached = False
        self.id = node_id
        # the host tier (hiradix.py): the node's host slots, or None; an empty ``value`` with
        # host slots means the K/V is on the host only
        self.host_value: SlotArray | None = None
        self.hit_count = 0
        self.loading = False  # its host slots feed a load not yet handed to the ranks

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.value)}, lock_ref={self.lock_ref})"


def split_node(child: TreeNode, split_len: int, page_bytes: int, node_id: int) -> TreeNode:
    """``parent -> child`` becomes ``parent -> upper -> child``, ``upper`` holding the first
    ``split_len`` tokens (on each tier the node is on) with the child's locks, access time and
    hit count; returns ``upper``."""
    parent = child.parent
    if parent is None:  # pragma: no cover - roots are never split
        raise RuntimeError("cannot split a root")
    cut = split_len * _ITEM
    upper = TreeNode(child.key[:cut], child.value[:split_len], parent, child.last_access, node_id)
    upper.lock_ref = child.lock_ref
    upper.hit_count = child.hit_count
    if child.host_value is not None:
        upper.host_value = child.host_value[:split_len]
        child.host_value = child.host_value[split_len:]
    child.key = child.key[cut:]
    child.value = child.value[split_len:]
    child.parent = upper
    upper.children[child.key[:page_bytes]] = child
    parent.children[upper.key[:page_bytes]] = upper
    return upper


def detach(node: TreeNode, page_bytes: int) -> None:
    """Take ``node`` out of its parent's children; it is stale from now on."""
    parent = node.parent
    assert parent is not None
    del parent.children[node.key[:page_bytes]]
    node.parent = None
    node.detached = True


def as_token_array(token_ids: npt.ArrayLike) -> TokenArray:
    """Token ids as a one-dimensional int32 array (no copy when they already are one)."""
    key = np.asarray(token_ids, dtype=np.int32)
    if key.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {key.shape}")
    return key


def checked_entry(
    token_ids: npt.ArrayLike, slots: npt.ArrayLike, page_size: int, max_context_len: int | None
) -> tuple[TokenArray, SlotArray]:
    """A key to insert and its slots, checked: equal lengths, whole pages, and no longer than
    ``max_context_len`` (when given)."""
    key = as_token_array(token_ids)
    values = np.asarray(slots)
    if values.ndim != 1 or len(values) != len(key):
        raise ValueError(
            f"key and value lengths differ: {len(key)} token ids, {values.size} slots"
        )
    if len(key) % page_size:
        raise ValueError(f"key length {len(key)} is not a multiple of page_size {page_size}")
    if max_context_len is not None and len(key) > max_context_len:
        raise ValueError(
            f"key of {len(key)} tokens is longer than max_context_len {max_context_len}"
        )
    return key, values


def common_page_bytes(key: bytes, data: bytes, pos: int, end: int, page_bytes: int) -> int:
    """Bytes of whole pages on which ``key`` and ``data[pos:end]`` agree (int32 token ids)."""
    num = min(len(key), end - pos) // 4
    ours = np.frombuffer(key, dtype=np.int32, count=num)
    theirs = np.frombuffer(data, dtype=np.int32, count=num, offset=pos)
    differ = ours != theirs
    matched = (int(differ.argmax()) if differ.any() else num) * 4
    return matched // page_bytes * page_bytes
