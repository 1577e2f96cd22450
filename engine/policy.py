"""Orders the waiting queue: first come first served, longest cached prefix, or priority."""

from __future__ import annotations

from raydix.cache import KVCacheManager

from .request import Request


def order_waiting(
    waiting: list[Request], policy: str, cache: KVCacheManager, max_lpm_waiting: int
) -> list[Request]:
    """The waiting requests in the order admission should try them.

    ``lpm`` matches each request against the prefix cache and puts the longest hits first
    (ties keep arrival order); with more than ``max_lpm_waiting`` requests waiting it falls
    back to ``fcfs``, as matching them all would cost more than it saves. ``priority`` puts
    larger priorities first, then arrival order. Retracted requests keep their place at the
    front under ``fcfs``.
    """
    if policy == "lpm" and len(waiting) <= max_lpm_waiting:
        hits = {
            id(req): cache.match_prefix(req.fill_ids[:-1], req.params.extra_key).cached_len
            for req in waiting
        }
        return sorted(waiting, key=lambda req: -hits[id(req)])
    if policy == "priority":
        return sorted(waiting, key=lambda req: -req.params.priority)
    return list(waiting)
