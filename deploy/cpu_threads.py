"""The CPU threads of an engine replica whose rank runs inside it (tp 1 on a CPU).

Ray starts a worker with `OMP_NUM_THREADS` set to the CPUs it reserved (1 unless told) and at
nice 15 (its `worker_niceness`). An engine replica left so computes on one thread at a low
priority, behind Ray's own processes. So the replica reserves `cpu_threads` CPUs, sets torch's
and OpenMP's thread counts to that explicitly, and takes back the normal priority.

The default leaves one core to Ray, the proxy and the ingress when that still leaves the
engine two; on smaller machines it was chosen by measurement (README, "Serving on a CPU").
A model too small to split a layer's products across threads computes on one thread by
default, whatever the replica reserved: there a second OpenMP thread only doubles the CPU the
step burns and takes the core the serving path needs (README, "Session 19: the engine in a
process of its own").
"""

from __future__ import annotations

import logging
import os

from raydix.router.priority import take_normal_priority
from raydix.workers.config import ModelConfig

logger = logging.getLogger(__name__)

# a layer of fewer weights than this runs its products on one thread: serve_bench's tiny model
# (41K weights a layer) through `raydix serve` on 2 cores made 651.8 tok/s at one stream on one
# thread against 501.6 on two, 2,847 against 2,391 at 64 streams; SmolLM2-135M (3.5M) is faster
# on two (253.6 against 176.4 tok/s at 64 streams)
SMALL_LAYER_WEIGHTS = 1_000_000

# cores <= 2: through `raydix serve` on 2 cores (AMD EPYC Zen 3), two threads made 1.18-1.24x
# the tokens/s of one at 64 streams and the same at one stream (README, "Serving speed"): the
# engine at nice 0 keeps both cores while Ray's processes, at nice 15, take what it leaves
THREADS_ON_SMALL_MACHINES = 2


def default_cpu_threads(num_cores: int) -> int:
    """The engine's threads on a machine of `num_cores` cores."""
    if num_cores - 1 >= 2:
        return num_cores - 1
    return max(min(THREADS_ON_SMALL_MACHINES, num_cores), 1)


def layer_weights(model: ModelConfig) -> int:
    """About how many weights one layer of `model` multiplies per token."""
    attention = model.hidden_size * model.head_dim * 2 * (model.num_heads + model.num_kv_heads)
    return attention + 3 * model.hidden_size * model.intermediate_size


def threads_for_model(num_threads: int, model_path: str) -> int:
    """The default threads for the model at `model_path`: one for a small model."""
    if num_threads > 1 and layer_weights(ModelConfig.from_folder(model_path)) < SMALL_LAYER_WEIGHTS:
        logger.info("CPU threads: 1 of %d (layers under %d weights run faster on one)",
                    num_threads, SMALL_LAYER_WEIGHTS)
        return 1
    return num_threads


def use_cpu_threads(num_threads: int, model_path: str | None = None) -> int:
    """Compute on `num_threads` threads in this process (with `model_path`, a default to fit to
    the model: `threads_for_model`), at the normal priority; returns the nice value the
    process's threads had (Ray's worker_niceness), for the start-up log."""
    import torch

    if model_path is not None:
        num_threads = threads_for_model(num_threads, model_path)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)  # for libraries that start later
    os.environ["MKL_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
    return take_normal_priority("the engine replica")
