"""Column-, row-, merged- and QKV-parallel linear layers.

Weights are stored as `[out_features, in_features]` like the checkpoints. A column-parallel layer
owns a run of output rows; a row-parallel layer owns a run of input columns and sums its partial
output over the ranks (the only all-reduce in a transformer block besides the embedding).
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import SINGLE_RANK, TPGroup, head_shard, shard_range
from .packed import linear
from .source import CheckpointTensor, copy_checked


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b, with this rank holding output rows [out_start, out_start + out_size)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group: TPGroup = SINGLE_RANK, out_shard: tuple[int, int] | None = None) -> None:
        super().__init__()
        if out_shard is None:
            start, end = shard_range(out_features, group.tp_rank, group.tp_size)
            out_shard = (start, end - start)
        self.out_start, self.out_size = out_shard
        # on CPU the packed weight replaces the plain one after loading (layers/packed.py)
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(self.out_size, in_features),
                                                        requires_grad=False)
        self.packed_weight: torch.Tensor | None = None
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor,
                      shard_id: str | int | None = None) -> None:
        copy_checked(param, loaded.narrow(0, self.out_start, self.out_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed_weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj).

    Each part is split evenly over the ranks; the local weight is the parts' shards stacked.
    `shard_id` is the part's index.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 group: TPGroup = SINGLE_RANK) -> None:
        for size in out_sizes:
            if size % group.tp_size:
                raise ValueError(f"output size {size} is not divisible by tp_size={group.tp_size}")
        self.part_sizes = [s // group.tp_size for s in out_sizes]
        self.tp_rank = group.tp_rank
        super().__init__(in_features, sum(out_sizes), bias, group,
                         out_shard=(0, sum(self.part_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor,
                      shard_id: str | int | None = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.part_sizes):
            raise ValueError(f"merged linear needs a part index in [0, {len(self.part_sizes)}), "
                             f"got {shard_id!r}")
        size = self.part_sizes[shard_id]
        offset = sum(self.part_sizes[:shard_id])
        copy_checked(param.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, sharded by attention head (see `head_shard`).

    Output layout on each rank: [q heads | k heads | v heads] of this rank. `shard_id` is
    "q", "k" or "v".
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, group: TPGroup = SINGLE_RANK) -> None:
        self.heads = head_shard(num_heads, num_kv_heads, group.tp_rank, group.tp_size)
        self.head_dim = head_dim
        self.q_size = self.heads.num_q_heads * head_dim
        self.kv_size = self.heads.num_kv_heads * head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, group,
                         out_shard=(0, self.q_size + 2 * self.kv_size))

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor,
                      shard_id: str | int | None = None) -> None:
        d = self.head_dim
        if shard_id == "q":
            dst, src = param.narrow(0, 0, self.q_size), self.heads.q_head_start * d
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            dst, src = param.narrow(0, offset, self.kv_size), self.heads.kv_head_start * d
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        copy_checked(dst, loaded.narrow(0, src, dst.shape[0]))


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T (+ b once), where rank r holds input columns
    [in_start, in_start + in_size) and receives the matching slice of x."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group: TPGroup = SINGLE_RANK, in_shard: tuple[int, int] | None = None) -> None:
        super().__init__()
        if in_shard is None:
            start, end = shard_range(in_features, group.tp_rank, group.tp_size)
            in_shard = (start, end - start)
        self.in_start, self.in_size = in_shard
        self.group = group
        # on CPU the packed weight replaces the plain one after loading (layers/packed.py)
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, self.in_size),
                                                        requires_grad=False)
        self.packed_weight: torch.Tensor | None = None
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor,
                      shard_id: str | int | None = None) -> None:
        if param is self.bias:  # added once, after the all-reduce: every rank keeps all of it
            copy_checked(param, loaded.read())
        else:
            copy_checked(param, loaded.narrow(1, self.in_start, self.in_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.packed_weight)
        y = self.group.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
