"""The tensor-parallel group of one replica, and the two collectives the model uses.

Collectives are called only from the row-parallel linear layer, the vocab-parallel embedding and
the vocab-parallel LM head. With `tp_size == 1` every collective is a no-op and no process group
is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the replica.

    `device_group` carries the model's collectives (NCCL on CUDA, gloo on CPU). `cpu_group` is a
    gloo group that carries the step plan from the driving rank to the others.
    """

    tp_rank: int
    tp_size: int
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = TPGroup(tp_rank=0, tp_size=1)


def init_tp_group(rendezvous: str, tp_rank: int, tp_size: int, device: str = "cpu",
                  timeout_s: float = 300.0) -> TPGroup:
    """Join the replica's process group at `rendezvous` (e.g. "tcp://10.0.0.1:29500").

    Uses NCCL when `device` is CUDA and gloo otherwise, plus a second gloo group for step plans.
    With `tp_size == 1` no process group is made.
    """
    if tp_size == 1:
        return SINGLE_RANK
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} must be in [0, {tp_size})")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=rendezvous, rank=tp_rank,
                                world_size=tp_size, timeout=timedelta(seconds=timeout_s))
    ranks = list(range(tp_size))
    device_group = dist.new_group(ranks, backend=backend)
    cpu_group = device_group if backend == "gloo" else dist.new_group(ranks, backend="gloo")
    return TPGroup(tp_rank=tp_rank, tp_size=tp_size, device_group=device_group,
                   cpu_group=cpu_group)


def all_reduce_min(value: int, group: TPGroup) -> int:
    """The minimum of an integer over the ranks (used for free-memory readings)."""
    if group.tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())


def all_gather_ints(value: int, group: TPGroup) -> list[int]:
    """Every rank's integer, in rank order (used to name ranks in memory warnings)."""
    if group.tp_size == 1:
        return [value]
    parts = [torch.zeros(1, dtype=torch.int64) for _ in range(group.tp_size)]
    dist.all_gather(parts, torch.tensor([value], dtype=torch.int64), group=group.cpu_group)
    return [int(p.item()) for p in parts]


def shard_range(total: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The [start, end) of rank `tp_rank`'s equal share of `total` items."""
    if total % tp_size:
        raise ValueError(f"{total} is not divisible by tp_size={tp_size}")
    size = total // tp_size
    return tp_rank * size, (tp_rank + 1) * size


@dataclass(frozen=True)
class HeadShard:
    """Which attention heads one rank owns.

    KV heads are split in contiguous runs over the ranks (the first ranks take one more when the
    split is uneven, e.g. 3 KV heads over 2 ranks gives 2 + 1). Each rank takes the query heads of
    its KV heads. When `tp_size > num_kv_heads` each KV head is replicated over
    `tp_size // num_kv_heads` ranks, and those ranks split the KV head's query heads.
    """

    q_head_start: int
    num_q_heads: int
    kv_head_start: int
    num_kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp_rank: int, tp_size: int) -> HeadShard:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads  # query heads per KV head
    if tp_size > num_kv_heads:
        if tp_size % num_kv_heads:
            raise ValueError(f"tp_size={tp_size} must be a multiple of num_kv_heads="
                             f"{num_kv_heads} when it is larger")
        replicas = tp_size // num_kv_heads
        if group % replicas:
            raise ValueError(f"{group} query heads per KV head cannot be split over {replicas} "
                             f"ranks (tp_size={tp_size}, num_kv_heads={num_kv_heads})")
        kv_head = tp_rank // replicas
        q_per_rank = group // replicas
        q_start = kv_head * group + (tp_rank % replicas) * q_per_rank
        return HeadShard(q_start, q_per_rank, kv_head, 1)
    base, extra = divmod(num_kv_heads, tp_size)
    kv_start = tp_rank * base + min(tp_rank, extra)
    kv_count = base + (1 if tp_rank < extra else 0)
    return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
