"""Moves a step plan from the driving rank to the other ranks of a replica (CPU group)."""

from __future__ import annotations

import torch.distributed as dist

from .parallel import TPGroup
from .step import StepPlan


def broadcast_plan(plan: StepPlan | None, group: TPGroup, src: int = 0) -> StepPlan:
    """Send `plan` from rank `src` to every rank of `group` (over its CPU group); every rank
    returns the plan. Other ranks pass None."""
    if group.tp_size == 1:
        if plan is None:
            raise ValueError("a single rank must pass its own plan")
        return plan
    box: list[StepPlan | None] = [plan if group.tp_rank == src else None]
    dist.broadcast_object_list(box, src=src, group=group.cpu_group)
    if box[0] is None:
        raise RuntimeError(f"rank {src} broadcast no plan")
    return box[0]
