"""The routing decision: cache affinity unless the load is imbalanced.

Given, for one prompt, how many of its tokens each replica holds and each replica's load:

- if the load is imbalanced (the gap between the busiest and the idlest replica exceeds both
  ``balance_abs_threshold`` and ``balance_rel_threshold`` times the idlest load), the least
  loaded replica gets the request;
- else, if the best match covers at least ``cache_threshold`` of the prompt, the replica with
  the longest match gets it (equal matches: the least loaded);
- else the least loaded replica gets it.

Equal loads are broken by a rotating start, so a run of cold prompts spreads over the replicas
instead of piling onto one. The rotation advances only when a tie is broken, so cache hits in
between (one holder, nothing to break) do not bring the next cold prompt back to the same one.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

ReplicaId = Hashable


@dataclass(frozen=True)
class RoutingPolicyConfig:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")


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
    ) -> RoutingDecision:
        if not replicas:
            raise ValueError("no replica to route to")
        load = {r: loads.get(r, 0.0) for r in replicas}
        busiest, idlest = max(load.values()), min(load.values())
        cfg = self.config
        if (
            busiest - idlest > cfg.balance_abs_threshold
            and busiest > idlest * cfg.balance_rel_threshold
        ):
            least = self._least_loaded(replicas, load)
            return RoutingDecision(least, matched.get(least, 0), "balance")
        best_len = max((matched.get(r, 0) for r in replicas), default=0)
        if prompt_len and best_len and best_len / prompt_len >= cfg.cache_threshold:
            holders = [r for r in replicas if matched.get(r, 0) == best_len]
            chosen = self._least_loaded(holders, load)
            return RoutingDecision(chosen, best_len, "cache")
        least = self._least_loaded(replicas, load)
        return RoutingDecision(least, matched.get(least, 0), "least_loaded")

    def _least_loaded(
        self, candidates: Sequence[ReplicaId], load: Mapping[ReplicaId, float]
    ) -> ReplicaId:
        low = min(load[r] for r in candidates)
        tied = [r for r in candidates if load[r] == low]
        if len(tied) == 1:
            return tied[0]
        self._turn += 1
        return tied[self._turn % len(tied)]
