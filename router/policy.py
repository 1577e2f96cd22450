"""The threshold routing decision (``mode="threshold"``): cache affinity unless the load is
imbalanced. The default, ``mode="ttft"``, weighs cached length against queues instead
(``ttft_policy.py``); this one is kept for comparison.

Given, for one prompt, how many of its tokens each replica holds and each replica's load:

- if the best match covers at least ``cache_threshold`` of the prompt, the replica with the
  longest match gets it (equal matches: the least loaded), unless that replica is overloaded;
- otherwise, and when it is overloaded, the least loaded replica gets it.

A holder is overloaded when its load exceeds ``balance_rel_threshold`` times the idlest
replica's, and either

- by more than ``balance_abs_threshold`` requests (imbalance), or
- it is saturated and the idlest is not. Saturated: it has requests waiting and its KV pool is
  at least ``saturated_kv_usage`` full of running requests' tokens, so a request sent there
  queues behind its running ones, while the idlest computes the prompt at once. A fixed request
  gap suits replicas of one size only; a full pool means the same at any scale.

The relative gap is needed in both cases: when every replica is about as busy, moving a hit
away only adds the prefix's computation to a busy cluster. Saturation still costs hit rate in
a cluster held at capacity, where some replica is always briefly less busy: with a CPU's slow
prefill, `benchmarks/router_bench.py` measures that cost; ``saturated_kv_usage=1`` all but
turns the rule off.

Only the chosen holder is compared: another replica's overload does not move a request away
from a holder with room.

Equal loads are broken by a rotating start, so a run of cold prompts spreads over the replicas
instead of piling onto one. The rotation advances only when a tie is broken, so cache hits in
between (one holder, nothing to break) do not bring the next cold prompt back to the same one.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

ReplicaId = Hashable


@dataclass(frozen=True)
class RoutingPolicyConfig:
    # ttft: the replica with the least expected time to first token (ttft_policy.py);
    # threshold: the longest match above cache_threshold unless overloaded (this module)
    mode: Literal["ttft", "threshold"] = "ttft"
    # ttft: what each request on a replica (running, waiting or just routed) adds to the wait
    # of a new one, in prompt tokens, beside the prompt tokens it has yet to compute
    request_cost_tokens: float = 32.0
    # ttft: what a prompt token to compute counts against a token of another request's queue,
    # and again for each token it evicts from a full pool (a prefix others would hit)
    miss_cost: float = 2.0
    # ttft: costs within this share of the lowest are a tie, which the longest match wins
    tie_share: float = 0.15
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    saturated_kv_usage: float = 0.9
    # a prefix a replica holds only in its host KV tier counts this much per token beside one
    # on its device (1) and a miss (0): loading it back costs a copy, computing it a prefill
    host_hit_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in ("ttft", "threshold"):
            raise ValueError(f"mode must be ttft or threshold, got {self.mode!r}")
        if self.miss_cost < 1:
            raise ValueError(f"miss_cost must be >= 1, got {self.miss_cost}")
        if self.request_cost_tokens < 0:
            raise ValueError(f"request_cost_tokens must be >= 0, got {self.request_cost_tokens}")
        if not 0.0 <= self.tie_share < 1.0:
            raise ValueError(f"tie_share must be in [0, 1), got {self.tie_share}")
        if not 0.0 <= self.host_hit_weight <= 1.0:
            raise ValueError(f"host_hit_weight must be in [0, 1], got {self.host_hit_weight}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")
        if not 0.0 < self.saturated_kv_usage <= 1.0:
            raise ValueError(
                f"saturated_kv_usage must be in (0, 1], got {self.saturated_kv_usage}"
            )


class Fullness(NamedTuple):
    """From a replica's last load report."""

    num_waiting: int
    kv_usage: float  # share of the KV pool held by running requests


class RoutingDecision(NamedTuple):
    replica: ReplicaId
    matched_len: int  # tokens of the prompt the chosen replica holds
    reason: str  # "cache", "balance" or "least_loaded"


class CacheAwarePolicy:
    def __init__(self, config: RoutingPolicyConfig | None = None) -> None:
        self.config = config or RoutingPolicyConfig()
        self._turn = 0

    def choose(
        self,
        replicas: Sequence[ReplicaId],
        prompt_len: int,
        matched: Mapping[ReplicaId, int],
        loads: Mapping[ReplicaId, float],
        fullness: Mapping[ReplicaId, Fullness] | None = None,
    ) -> RoutingDecision:
        """``fullness``: per replica, from its load reports (none known: empty)."""
        if not replicas:
            raise ValueError("no replica to route to")
        load = {r: loads.get(r, 0.0) for r in replicas}
        best_len = max((matched.get(r, 0) for r in replicas), default=0)
        if prompt_len and best_len and best_len / prompt_len >= self.config.cache_threshold:
            holders = [r for r in replicas if matched.get(r, 0) == best_len]
            chosen = self._least_loaded(holders, load)
            if not self._overloaded(chosen, load, fullness or {}):
                return RoutingDecision(chosen, best_len, "cache")
            least = self._least_loaded(replicas, load)
            return RoutingDecision(least, matched.get(least, 0), "balance")
        least = self._least_loaded(replicas, load)
        return RoutingDecision(least, matched.get(least, 0), "least_loaded")

    def _overloaded(
        self,
        holder: ReplicaId,
        load: Mapping[ReplicaId, float],
        fullness: Mapping[ReplicaId, Fullness],
    ) -> bool:
        cfg = self.config
        idlest = min(load, key=load.__getitem__)
        if load[holder] <= load[idlest] * cfg.balance_rel_threshold:
            return False
        if load[holder] - load[idlest] > cfg.balance_abs_threshold:
            return True
        return self._saturated(fullness.get(holder)) and not self._saturated(fullness.get(idlest))

    def _saturated(self, fullness: Fullness | None) -> bool:
        return (
            fullness is not None
            and fullness.num_waiting > 0
            and fullness.kv_usage >= self.config.saturated_kv_usage
        )

    def _least_loaded(
        self, candidates: Sequence[ReplicaId], load: Mapping[ReplicaId, float]
    ) -> ReplicaId:
        low = min(load[r] for r in candidates)
        tied = [r for r in candidates if load[r] == low]
        if len(tied) == 1:
            return tied[0]
        self._turn += 1
        return tied[self._turn % len(tied)]
