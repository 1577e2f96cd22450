"""Whether the connected cluster can hold every engine replica asked for.

Serve keeps a replica that no node can take pending without end: `raydix serve` would never
say ready and never fail. So a replica count beyond what the live nodes hold is refused before
deploying, naming what is missing, unless the cluster's autoscaler has a node type that can
hold a replica: then `raydix serve` deploys, says what it waits for, and fails when the nodes
have not come within `autoscaler_timeout_s` (`wait_for_nodes`). Node sizes count, not what is
free: busy nodes free up.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import NamedTuple

import ray

logger = logging.getLogger(__name__)

NOTE_EVERY_S = 10.0  # while waiting for nodes: how often the wait is reported


def replica_resources(tp_size: int, use_gpu_bundles: bool,
                      cpu_threads: int | None) -> dict[str, float]:
    """What one engine replica reserves, all on one node: its own CPU and a GPU per rank; on a
    CPU, its threads (tp 1), or a CPU per rank besides its own (STRICT_PACK bundles)."""
    if use_gpu_bundles:
        return {"CPU": 1.0, "GPU": float(tp_size)}
    if tp_size == 1:
        return {"CPU": float(cpu_threads or 1)}
    return {"CPU": float(1 + tp_size)}


def _fits(have: dict[str, float], per_replica: dict[str, float]) -> int:
    """How many replicas a node of resources `have` holds at once."""
    return min((math.floor(have.get(k, 0.0) / v + 1e-9) for k, v in per_replica.items()
                if v > 0), default=0)


def _describe(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items())


def autoscaler_node_types() -> dict[str, dict[str, float]] | None:
    """The node types the cluster's autoscaler may add ({name: resources}, those with room
    for at least one more node); None when the cluster has no autoscaler. The autoscaler
    records its cluster config in Ray's GCS, which is where this reads it."""
    from ray._private.state import state

    try:
        config = state.get_cluster_config()
    except Exception:  # no record of one (a fixed cluster), or an older GCS
        return None
    if config is None:
        return None
    return {group.name or f"type {i}": {k: float(v) for k, v in group.resources.items()}
            for i, group in enumerate(config.node_group_configs) if group.max_count != 0}


def num_replicas_that_fit(per_replica: dict[str, float]) -> int:
    """How many replicas the live nodes could hold at once, each on one node."""
    return sum(_fits(node["Resources"], per_replica) for node in ray.nodes()
               if node.get("Alive"))


class Shortfall(NamedTuple):
    """Replicas the live nodes can't hold yet and the autoscaler's node types can."""

    num_replicas: int
    fit: int  # replicas the live nodes hold
    per_replica: dict[str, float]
    node_types: tuple[str, ...]  # the autoscaler's node types that hold a replica

    def describe(self) -> str:
        return (f"nodes for {self.num_replicas - self.fit} more engine replica(s) (the cluster "
                f"holds {self.fit} of {self.num_replicas}; a replica needs "
                f"{_describe(self.per_replica)} on one node; node types that hold one: "
                f"{', '.join(self.node_types)})")


def check_replicas_fit(num_replicas: int, per_replica: dict[str, float]) -> Shortfall | None:
    """None when the live nodes hold `num_replicas` replicas; a `Shortfall` when they don't
    but the autoscaler can add nodes that do; else a one-line ValueError."""
    fit = num_replicas_that_fit(per_replica)
    if fit >= num_replicas:
        return None
    need = _describe(per_replica)
    node_types = autoscaler_node_types()
    if node_types:
        holding = tuple(name for name, have in node_types.items() if _fits(have, per_replica))
        if holding:
            return Shortfall(num_replicas, fit, per_replica, holding)
    totals = ray.cluster_resources()
    have = ", ".join(f"{totals.get(k, 0.0):g} {k}" for k in per_replica)
    hint = "--cpu-threads" if set(per_replica) == {"CPU"} else "--tp"
    autoscaler = ""
    if node_types is not None:
        types = "; ".join(f"{name}: {_describe(r)}" for name, r in node_types.items())
        autoscaler = (f", and none of the node types its autoscaler can add holds one "
                      f"({types or 'none can be added'})")
    raise ValueError(
        f"replicas={num_replicas} can't be placed: a replica needs {need} on one node, and this "
        f"cluster ({have} in all) holds {fit}{autoscaler}. Lower --replicas (or {hint}), or add "
        f"nodes.")


def wait_for_nodes(shortfall: Shortfall, timeout_s: float,
                   replicas_running: Callable[[], int], poll_s: float = 0.5,
                   note_every_s: float = NOTE_EVERY_S) -> None:
    """Wait until `replicas_running()` reaches the replicas asked for, saying what it waits
    for now and then; raise a RuntimeError naming what never came after `timeout_s`."""
    start = time.monotonic()
    logger.info("waiting up to %g s for the autoscaler to add %s", timeout_s,
                shortfall.describe())
    noted = start
    while True:
        running = replicas_running()
        if running >= shortfall.num_replicas:
            logger.info("the autoscaler added the nodes: %d engine replicas run", running)
            return
        now = time.monotonic()
        fit = num_replicas_that_fit(shortfall.per_replica)
        if now - start >= timeout_s:
            raise RuntimeError(
                f"waited {timeout_s:g} s for the autoscaler to add nodes: {running} of "
                f"{shortfall.num_replicas} engine replicas run, and the cluster holds {fit} "
                f"(a replica needs {_describe(shortfall.per_replica)} on one node). Check the "
                f"autoscaler, lower --replicas, or raise --autoscaler-timeout-s.")
        if now - noted >= note_every_s:
            noted = now
            logger.info("still waiting for the autoscaler (%.0f s of %g s): %d of %d engine "
                        "replicas run, the cluster holds %d", now - start, timeout_s, running,
                        shortfall.num_replicas, fit)
        time.sleep(poll_s)
