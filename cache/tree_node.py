"""A node of the radix tree, and the one conversion of token ids that every key goes through."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .base import TokenArray
from .req_table import SlotArray


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


def as_token_array(token_ids: npt.ArrayLike) -> TokenArray:
    """Token ids as a one-dimensional int32 array (no copy when they already are one)."""
    key = np.asarray(token_ids, dtype=np.int32)
    if key.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {key.shape}")
    return key


def common_page_bytes(key: bytes, data: bytes, pos: int, end: int, page_bytes: int) -> int:
    """Bytes of whole pages on which ``key`` and ``data[pos:end]`` agree (int32 token ids)."""
    num = min(len(key), end - pos) // 4
    ours = np.frombuffer(key, dtype=np.int32, count=num)
    theirs = np.frombuffer(data, dtype=np.int32, count=num, offset=pos)
    differ = ours != theirs
    matched = (int(differ.argmax()) if differ.any() else num) * 4
    return matched // page_bytes * page_bytes
