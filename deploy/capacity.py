"""Whether the connected cluster can hold every engine replica asked for.

Serve keeps a replica that no node can take pending without end: `raydix serve` would never
say ready and never fail. So a replica count beyond what the live nodes hold is refused before
deploying, naming what is missing, unless an autoscaler can add nodes (then the deploy waits,
bounded by the start-up timeout). Node sizes count, not what is free: busy nodes free up.
"""

from __future__ import annotations

import contextlib
import logging
import math

import ray

logger = logging.getLogger(__name__)

def replica_resources(tp_size: int, use_gpu_bundles: bool,
                      cpu_threads: int | None) -> dict[str, float]:
    """What one engine replica reserves, all on one node: its own CPU and a GPU per rank; on a
    CPU, its threads (tp 1), or a CPU per rank besides its own (STRICT_PACK bundles)."""
    if use_gpu_bundles:
        return {"CPU": 1.0, "GPU": float(tp_size)}
    if tp_size == 1:
        return {"CPU": float(cpu_threads or 1)}
    return {"CPU": float(1 + tp_size)}


def has_autoscaler() -> bool:
    """The cluster's autoscaler has registered its node types with Ray (it can add nodes)."""
    with contextlib.suppress(Exception):  # Ray's record of it; absent on a fixed cluster
        from ray._private.state import state

        return state.get_cluster_config() is not None
    return False


def num_replicas_that_fit(per_replica: dict[str, float]) -> int:
    """How many replicas the live nodes could hold at once, each on one node."""
    total = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node["Resources"]
        total += min((math.floor(have.get(k, 0.0) / v + 1e-9) for k, v in per_replica.items()
                      if v > 0), default=0)
    return total


def check_replicas_fit(num_replicas: int, per_replica: dict[str, float]) -> None:
    """Raise a one-line ValueError when the cluster can't hold `num_replicas` replicas."""
    fit = num_replicas_that_fit(per_replica)
    if fit >= num_replicas:
        return
    need = ", ".join(f"{v:g} {k}" for k, v in per_replica.items())
    if has_autoscaler():
        logger.warning("the cluster holds %d of %d replicas (%s each); waiting for the "
                       "autoscaler to add nodes", fit, num_replicas, need)
        return
    totals = ray.cluster_resources()
    have = ", ".join(f"{totals.get(k, 0.0):g} {k}" for k in per_replica)
    hint = "--cpu-threads" if set(per_replica) == {"CPU"} else "--tp"
    raise ValueError(
        f"replicas={num_replicas} can't be placed: a replica needs {need} on one node, and this "
        f"cluster ({have} in all) holds {fit}. Lower --replicas (or {hint}), or add nodes.")
