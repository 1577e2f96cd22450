"""The placement group of one replica: one bundle per rank, placed before any worker starts.

A replica reserves one `{"GPU": 1}` bundle per rank (one `{"CPU": 1}` bundle per rank when it
runs without GPUs), with STRICT_PACK by default so that its ranks share a node. Waiting for the
placement is bounded: when the cluster can't place the group in time, the error says how many
GPUs are free and how many the replica needs, instead of hanging. A STRICT_PACK group that no
live node could ever hold fails at once (`check_replica_fits`), for Serve's replicas too: Serve
would otherwise keep such a replica pending without end.
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
    if strategy == "STRICT_PACK" and largest_fit(tp_size, use_gpu, num_extra_cpus=0) is None:
        raise RuntimeError(unplaceable_message(tp_size, use_gpu, strategy, None))
    pg: PlacementGroup = placement_group(rank_bundles(tp_size, use_gpu), strategy=strategy)
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


def unplaceable_message(tp_size: int, use_gpu: bool, strategy: str,
                        timeout_s: float | None) -> str:
    """Why a replica's placement group was not placed: what is free against what it needs.
    `timeout_s` None: it was not tried, as no node is large enough."""
    resource = "GPU" if use_gpu else "CPU"
    num_free = ray.available_resources().get(resource, 0.0)
    node_sizes = [n["Resources"].get(resource, 0.0) for n in ray.nodes() if n.get("Alive")]
    largest = max(node_sizes, default=0.0)
    where = {"STRICT_PACK": "needs them on one node",
             "STRICT_SPREAD": "needs them on different nodes"}.get(strategy, "")
    return (f"The placement group can't be placed: the cluster has {num_free:g} {resource}(s) "
            f"free, a replica needs tp={tp_size} ({strategy}{' ' + where if where else ''}; "
            f"the largest node has {largest:g} {resource}(s)). "
            + ("No node is large enough." if timeout_s is None else f"Waited {timeout_s:g} s."))


def largest_fit(tp_size: int, use_gpu: bool, num_extra_cpus: int) -> dict[str, float] | None:
    """The total resources of a live node that can hold `tp_size` ranks plus `num_extra_cpus`
    CPUs (the engine's own bundle) at once; None when no node can, however idle."""
    resource = "GPU" if use_gpu else "CPU"
    need = {resource: float(tp_size)}
    need["CPU"] = need.get("CPU", 0.0) + num_extra_cpus
    for node in ray.nodes():
        have = node["Resources"] if node.get("Alive") else {}
        if have and all(have.get(k, 0.0) >= v for k, v in need.items()):
            return dict(have)
    return None


def check_replica_fits(tp_size: int, use_gpu: bool, num_extra_cpus: int = 1) -> None:
    """Raise a ValueError when no live node of the connected cluster is large enough for one
    replica: `tp_size` GPUs (CPUs without GPUs) plus `num_extra_cpus` CPUs, all on one node,
    as STRICT_PACK needs. Checks node sizes, not what is free: a busy node frees up."""
    if largest_fit(tp_size, use_gpu, num_extra_cpus) is not None:
        return
    resource = "GPU" if use_gpu else "CPU"
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    sizes = sorted((n.get(resource, 0.0) for n in nodes), reverse=True)
    largest = sizes[0] if sizes else 0.0
    need = tp_size + (0 if use_gpu else num_extra_cpus)
    if largest >= need:  # enough GPUs somewhere, but not with the engine's CPU beside them
        raise ValueError(
            f"a replica with tp={tp_size} needs {tp_size} {resource}(s) and {num_extra_cpus} "
            f"CPU(s) on one node, but no node of this cluster has both (nodes' {resource}s: "
            f"{', '.join(f'{s:g}' for s in sizes)})")
    max_tp = int(largest) - (need - tp_size)
    fix = f"Lower tp to at most {max_tp}, or add" if max_tp >= 1 else "Add"
    raise ValueError(
        f"tp={tp_size} needs {need} {resource}s on one node (a replica's ranks are packed onto "
        f"one node), but the largest node of this cluster has {largest:g} {resource}(s) "
        f"({len(nodes)} node(s) with {', '.join(f'{s:g}' for s in sizes)}). {fix} nodes with "
        f"at least {need} {resource}s.")
