"""The start-up heap, frozen: a full garbage collection never walks what start-up built.

A process that imports torch, transformers and Ray and builds an engine holds hundreds of
thousands of objects that live as long as it does, and Python's oldest-generation collection
walks every one of them, holding the GIL throughout. Measured with the tiny model on 2 cores:
328 ms for one such collection in the engine process (541,379 objects) and 120 ms in the engine
replica (162,572), the first time a burst of 64 streams allocated enough to start one; every
stream of the replica waited that long. On an H200 the first 64-stream burst of a server showed
an 865 ms gap in a stream and the next burst 26 ms (README, serving on a GPU).

Once start-up is over, `freeze_start_up_heap` collects once and moves every object left into the
permanent generation (`gc.freeze`, as vLLM's engine core does after its start-up): later
collections walk only what serving allocated since. The cost is that a reference cycle among the
frozen objects is never reclaimed, hence the collection first.

While start-up builds that heap, `collection_paused` keeps the collector from running at all:
each oldest-generation collection walks every object built so far, and the engine process's
build (imports, model load, the compiled graphs' tracing) set off five of them, 0.9 s of a
7.7-8.3 s build of the default model in bf16 on 2 cores, and the younger generations' 0.2 s
more. The freeze's one collection after it reclaims what start-up left.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def freeze_start_up_heap(where: str) -> int:
    """Collect, then freeze every object the collector tracks; returns the frozen count.

    Called again (a process that starts a second part), it freezes what was built since."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: start-up heap frozen, %d objects outside later collections (%.0f ms)",
                where, frozen, (time.perf_counter() - start) * 1e3)
    return frozen


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (start-up's build, then
    `freeze_start_up_heap`); the collector's state is restored after it, an error included."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
