"""Normal CPU priority for a Ray worker process on the request path.

Ray starts its worker processes at nice 15 (its `worker_niceness`). On a host whose cores the
engine replicas keep busy (they take back nice 0 to compute, `deploy/cpu_threads.py`), a process
left at nice 15 gets a few percent of a core: the router actor, which every request waits on and
which also takes every replica's cache events and load reports, then answers a request only
after its backlog of reports has trickled through (measured in `router_bench.py http`: its
answer's p50 80 ms and p90 0.6 s, where Ray's tree actor, sent one call per request, answered
in 10 ms). So the router actor takes back nice 0 too.

So does the ingress, which every request and every token chunk passes through. At nice 15 on 2
cores beside the engine replica (its loop thread and OpenMP team at nice 0), the ingress's event
loop stood still for 100-300 ms at a time while 16 streams started (lags of its loop measured
with a 2 ms timer: 51 over 20 ms, 5 s in all, in four bursts of 16 requests to the tiny model):
a request's first token reached it 100-400 ms after the engine made it, and the next requests
were routed only after that. At nice 0: two lags over 20 ms (the longest 26 ms), and those
bursts' first tokens came 0.13-0.41 s after the requests (median of each burst) instead of
0.33-1.25 s (README, "Serving speed").
"""

from __future__ import annotations

import contextlib
import logging
import os

logger = logging.getLogger(__name__)


def take_normal_priority(who: str) -> int:
    """Nice 0 for every thread of this process (Linux keeps a nice value per thread; threads
    made later inherit their maker's); returns the nice value it had. Without the right to
    raise priority, log it (naming `who`) and stay."""
    was = os.getpriority(os.PRIO_PROCESS, 0)
    if was <= 0:
        return was
    tids = [os.getpid()]
    with contextlib.suppress(OSError):
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, tid, 0)
    except PermissionError:
        logger.warning("%s runs at nice %d (Ray's worker_niceness) and may not raise its "
                       "priority: busier processes delay it", who, was)
    return was
