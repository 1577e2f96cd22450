"""The placement group of one replica: one bundle per rank, placed before any worker starts.

A replica reserves one `{"GPU": 1}` bundle per rank (one `{"CPU": 1}` bundle per rank when it
runs without GPUs), with STRICT_PACK by default so that its ranks share a node. Waiting for the
placement is bounded: when the cluster can't place the group in time, the error says how many
GPUs are free and how many the replica needs, instead of hanging.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


def rank_bundles(tp_size: int, use_gpu: bool) -> list[dict[str, float]]:
    """One bundle per rank, in rank order."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return [{"GPU": 1.0} if use_gpu else {"CPU": 1.0} for _ in range(tp_size)]


def create_replica_placement(tp_size: int, use_gpu: bool, strategy: str,
                             timeout_s: float) -> PlacementGroup:
    """Create the replica's placement group and wait up to `timeout_s` for it to be placed.

    On timeout the group is removed (so it can't be placed later behind our back) and a
    RuntimeError explains what is missing.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy must be one of {STRATEGIES}, got {strategy!r}")
    pg = placement_group(rank_bundles(tp_size, use_gpu), strategy=strategy)
    if wait_placed(pg, timeout_s):
        return pg
    remove_placement_group(pg)
    raise RuntimeError(unplaceable_message(tp_size, use_gpu, strategy, timeout_s))


def wait_placed(pg: PlacementGroup, timeout_s: float) -> bool:
    """True once `pg` is placed; False if it is still pending after `timeout_s` seconds."""
    ready, _ = ray.wait([pg.ready()], timeout=max(timeout_s, 0.0))
    return bool(ready)


def check_bundles(pg: PlacementGroup, bundle_offset: int, tp_size: int, use_gpu: bool) -> None:
    """Check that bundles `bundle_offset .. bundle_offset + tp_size - 1` of a caller's placement
    group exist and hold what a rank needs."""
    specs = pg.bundle_specs
    if bundle_offset < 0 or bundle_offset + tp_size > len(specs):
        raise ValueError(f"the placement group has {len(specs)} bundles; bundles "
                         f"{bundle_offset}..{bundle_offset + tp_size - 1} are needed for "
                         f"tp={tp_size}")
    resource = "GPU" if use_gpu else "CPU"
    for i in range(bundle_offset, bundle_offset + tp_size):
        if specs[i].get(resource, 0) < 1:
            raise ValueError(f"bundle {i} of the placement group is {specs[i]}; rank "
                             f"{i - bundle_offset} needs {{'{resource}': 1}}")


def unplaceable_message(tp_size: int, use_gpu: bool, strategy: str, timeout_s: float) -> str:
    """Why a replica's placement group was not placed: what is free against what it needs."""
    resource = "GPU" if use_gpu else "CPU"
    num_free = ray.available_resources().get(resource, 0.0)
    node_sizes = [n["Resources"].get(resource, 0.0) for n in ray.nodes() if n.get("Alive")]
    largest = max(node_sizes, default=0.0)
    where = {"STRICT_PACK": "needs them on one node",
             "STRICT_SPREAD": "needs them on different nodes"}.get(strategy, "")
    return (f"The placement group can't be placed: the cluster has {num_free:g} {resource}(s) "
            f"free, a replica needs tp={tp_size} ({strategy}{' ' + where if where else ''}; "
            f"the largest node has {largest:g} {resource}(s)). Waited {timeout_s:g} s.")

