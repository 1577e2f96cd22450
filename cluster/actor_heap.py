"""Freeze a Ray actor's start-up heap once it is built (`workers/gc_heap.py`).

Only inside an actor's own process (a rank's worker actor, a Serve replica): the same classes
built directly in a driver (tests, benchmarks) leave that process's collector alone, since the
process goes on to build and drop other things, and a cycle frozen there would never be freed.
"""

from __future__ import annotations

import ray

from raydix.workers.gc_heap import freeze_start_up_heap


def in_actor_process() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def freeze_actor_heap(where: str) -> int | None:
    """Freeze this actor process's heap; None (nothing done) outside an actor."""
    return freeze_start_up_heap(where) if in_actor_process() else None
