"""The logical half of the KV cache: request rows, slot pages and the radix prefix cache.

Pure Python and numpy: no torch, no ray. The physical K/V tensors live in ``raydix.workers``.
"""

from .allocator import PagedSlotAllocator
from .base import CachedPrefix, MatchResult, PrefixCache, PrefixHandle, SizeInfo
from .config import CacheConfig
from .events import CacheEvent, EventBuffer, EventKind, EventSink
from .hiradix import HiRadixCache
from .host_tier import DEFAULT_WRITE_POLICY, WRITE_POLICIES
from .kv_copies import KVCopies
from .manager import KVCacheManager
from .naive import NoPrefixCache
from .radix import RadixCache
from .req_table import ReqToTokenPool, RowWrite, TableDiff
from .tree_node import TreeNode

__all__ = [
    "DEFAULT_WRITE_POLICY",
    "WRITE_POLICIES",
    "CacheConfig",
    "CacheEvent",
    "CachedPrefix",
    "EventBuffer",
    "EventKind",
    "EventSink",
    "HiRadixCache",
    "KVCacheManager",
    "KVCopies",
    "MatchResult",
    "NoPrefixCache",
    "PagedSlotAllocator",
    "PrefixCache",
    "PrefixHandle",
    "RadixCache",
    "ReqToTokenPool",
    "RowWrite",
    "SizeInfo",
    "TableDiff",
    "TreeNode",
]
