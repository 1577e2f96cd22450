"""Mixture of experts: routing (`select_experts`) and the sparse MLP block (`SparseMoE`).

Tensor parallelism: every rank holds every expert, each expert's intermediate dimension split
over the ranks (its gate/up rows and its down columns), as a dense MLP is split. The router is
replicated, so every rank picks the same experts. Each rank's routed and shared experts add up
partial sums of the output, and the block all-reduces them once: like a row-parallel linear
layer, the block is where its collective lives.

Computation on the CPU (and the CUDA fallback) is a grouped loop: the (token, expert) pairs are
sorted by expert, each expert runs once on its contiguous run of tokens, and one `index_add_`
scatters the weighted outputs back. Experts that got no token are skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MoEConfig
from ..parallel import SINGLE_RANK, TPGroup, shard_range
from .fused import UsesFusedOps
from .linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from .source import CheckpointTensor, copy_checked


def select_experts(router_logits: torch.Tensor, config: MoEConfig,
                   correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) for router logits [T, E].

    softmax: top-k of the probabilities, optionally over the best `topk_group` of `num_groups`
    groups (a group scores its best expert: DeepSeek-V2's group-limited greedy);
    sigmoid: top-k of `sigmoid + correction_bias` over the best groups (a group scores the sum
    of its two best), weighted by the sigmoid alone (DeepSeek-V3's noaux_tc).
    Then optional renormalization and `routed_scaling_factor`.
    """
    logits = router_logits.float()
    if config.scoring == "softmax":
        scores = logits.softmax(dim=-1)
        choice = scores
    else:
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.num_groups > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, config.num_groups, num_experts // config.num_groups)
        if config.scoring == "softmax":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=config.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        # a dropped expert must lose to every kept one: 0 below softmax probabilities, -inf
        # below the biased sigmoid scores (which may be negative)
        choice = choice.masked_fill(~keep, 0.0 if config.scoring == "softmax" else float("-inf"))
    weights, ids = torch.topk(choice, k=config.top_k, dim=-1, sorted=False)
    if choice is not scores:  # weights are the unbiased scores of the chosen experts
        weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids


class ReplicatedLinear(ColumnParallelLinear):
    """Every rank holds the whole weight (Qwen2-MoE's shared expert gate, DeepSeek's latent
    projections)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, SINGLE_RANK, out_shard=(0, out_features))


class ExpertMLP(nn.Module, UsesFusedOps):
    """One expert (or the shared experts): `down(act(gate(x)) * up(x))`, this rank's slice of
    the intermediate dimension. The output is this rank's partial sum: the caller reduces."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str,
                 group: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       group=group)
        start, end = shard_range(intermediate_size, group.tp_rank, group.tp_size)
        # a single-rank group: no all-reduce here, the block does one for all its experts
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, group=SINGLE_RANK,
                                           in_shard=(start, end - start))
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_and_mul(self.act, self.gate_up_proj(x)))


class Router(nn.Module):
    """The gate: logits [T, E] over the experts, replicated on every rank and never packed (it
    is small, and its logits may be wanted in float32). DeepSeek-V3's correction bias
    (`gate.e_score_correction_bias`) rides along."""

    def __init__(self, hidden_size: int, config: MoEConfig) -> None:
        super().__init__()
        self.fp32 = config.router_fp32
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size),
                                   requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts),
                                                        requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor,
                      shard_id: str | int | None = None) -> None:
        if param is self.e_score_correction_bias and param.dtype != torch.float32:
            # kept in float32 whatever the model dtype, as transformers keeps it: rounding it
            # to bf16 would change which experts win close calls
            bias = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            copy_checked(bias, loaded.read().float())
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
            return
        copy_checked(param, loaded.read())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:  # as transformers computes DeepSeek's router
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    """The routed experts, the shared experts (DeepSeek: always added; Qwen2-MoE: scaled by
    `sigmoid(shared_expert_gate(x))`), and one all-reduce of their sum.

    Module names follow the checkpoints: `gate`, `experts.{i}.{gate,up,down}_proj`,
    `shared_experts` (DeepSeek) or `shared_expert` + `shared_expert_gate` (Qwen2-MoE).
    """

    def __init__(self, hidden_size: int, config: MoEConfig, act: str,
                 group: TPGroup) -> None:
        super().__init__()
        self.config = config
        self.group = group
        self.gate = Router(hidden_size, config)
        self.experts = nn.ModuleList(
            ExpertMLP(hidden_size, config.intermediate_size, act, group)
            for _ in range(config.num_experts))
        self.shared_experts: ExpertMLP | None = None
        self.shared_expert: ExpertMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if config.shared_intermediate_size:
            shared = ExpertMLP(hidden_size, config.shared_intermediate_size, act, group)
            if config.shared_expert_gate:
                self.shared_expert = shared
                self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
            else:
                self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.config,
                                      self.gate.e_score_correction_bias)
        out = grouped_experts(x, weights, ids, self.experts)
        if self.shared_experts is not None:
            out += self.shared_experts(x)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.group.all_reduce(out)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: nn.ModuleList) -> torch.Tensor:
    """sum over k of weights[t, k] * experts[ids[t, k]](x[t]), one expert call per expert that
    has tokens (this rank's partial sums)."""
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=len(experts)).tolist()  # one host read a layer
    token_idx = order // top_k
    sorted_x = x.index_select(0, token_idx)
    sorted_w = weights.reshape(-1).index_select(0, order).unsqueeze(1)
    outs = torch.empty_like(sorted_x)
    start = 0
    for expert, count in zip(experts, counts, strict=True):
        if count:
            end = start + count
            outs[start:end] = expert(sorted_x[start:end])
            start = end
    out = torch.zeros_like(x)
    return out.index_add_(0, token_idx, (outs.float() * sorted_w).to(x.dtype))
