"""The CPU threads of an engine replica whose rank runs inside it (tp 1 on a CPU).

Ray starts a worker with `OMP_NUM_THREADS` set to the CPUs it reserved (1 unless told) and at
nice 15 (its `worker_niceness`). An engine replica left so computes on one thread at a low
priority, behind Ray's own processes. So the replica reserves `cpu_threads` CPUs, sets torch's
and OpenMP's thread counts to that explicitly, and takes back the normal priority.

The default leaves one core to Ray, the proxy and the ingress when that still leaves the
engine two; on smaller machines it was chosen by measurement (README, "Serving on a CPU").
"""

from __future__ import annotations

import os

from raydix.router.priority import take_normal_priority

# cores <= 2: through `raydix serve` on 2 cores (AMD EPYC Zen 3), two threads made 1.18-1.24x
# the tokens/s of one at 64 streams and the same at one stream (README, "Serving speed"): the
# engine at nice 0 keeps both cores while Ray's processes, at nice 15, take what it leaves
THREADS_ON_SMALL_MACHINES = 2


def default_cpu_threads(num_cores: int) -> int:
    """The engine's threads on a machine of `num_cores` cores."""
    if num_cores - 1 >= 2:
        return num_cores - 1
    return max(min(THREADS_ON_SMALL_MACHINES, num_cores), 1)


def use_cpu_threads(num_threads: int) -> int:
    """Compute on `num_threads` threads in this process, at the normal priority; returns the
    nice value the process's threads had (Ray's worker_niceness), for the start-up log."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(num_threads)  # for libraries that start later
    os.environ["MKL_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
    return take_normal_priority("the engine replica")
