"""The routing decision: cache affinity unless the load is imbalanced.

Given, for one prompt, how many of its tokens each replica holds and each replica's load:

- if the best match covers at least ``cache_threshold`` of the prompt, the replica with the
  longest match gets it (equal matches: the least loaded), unless that replica is overloaded;
- otherwise, and when it is overloaded, the least loaded replica gets it.

A holder is overloaded against the idlest replica in two ways:

- imbalance: its load exceeds the idlest's by more than ``balance_abs_threshold`` requests and by
  more than ``balance_rel_threshold`` times;
- saturation: it cannot take the request in now (it has requests waiting and its KV pool is at
  least ``saturated_kv_usage`` full of running requests' tokens), and the idlest can. A request
  sent there would queue behind its running ones, while the idlest computes the prefix at once.
  This holds at any scale, where a fixed request gap suits only replicas of one size.

Only the chosen holder is compared: another replica's overload does not move a request away
from a holder with room.

Equal loads are broken by a rotating start, so a run of cold prompts spreads over the replicas
instead of piling onto one. The rotation advances only when a tie is broken, so cache hits in
between (one holder, nothing to break) do not bring the next cold prompt back to the same one.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

ReplicaId = Hashable


@dataclass(frozen=True)
class RoutingPolicyConfig:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    saturated_kv_usage: float = 0.9

    def __post_init__(self) -> None:
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
        saturated: Collection[ReplicaId] = (),
    ) -> RoutingDecision:
        """``saturated``: the replicas that have requests waiting with their KV pool at least
        ``saturated_kv_usage`` full (``RouterState`` reads it from their load reports)."""
        if not replicas:
            raise ValueError("no replica to route to")
        load = {r: loads.get(r, 0.0) for r in replicas}
        best_len = max((matched.get(r, 0) for r in replicas), default=0)
        if prompt_len and best_len and best_len / prompt_len >= self.config.cache_threshold:
            holders = [r for r in replicas if matched.get(r, 0) == best_len]
            chosen = self._least_loaded(holders, load)
            if not self._overloaded(chosen, load, saturated):
                return RoutingDecision(chosen, best_len, "cache")
            least = self._least_loaded(replicas, load)
            return RoutingDecision(least, matched.get(least, 0), "balance")
        least = self._least_loaded(replicas, load)
        return RoutingDecision(least, matched.get(least, 0), "least_loaded")

    def _overloaded(
        self, holder: ReplicaId, load: Mapping[ReplicaId, float], saturated: Collection[ReplicaId]
    ) -> bool:
        cfg = self.config
        idlest = min(load, key=load.__getitem__)
        gap = load[holder] - load[idlest]
        if gap > cfg.balance_abs_threshold and load[holder] > load[idlest] * cfg.balance_rel_threshold:
            return True
        return holder in saturated and idlest not in saturated and gap > 0

    def _least_loaded(
        self, candidates: Sequence[ReplicaId], load: Mapping[ReplicaId, float]
    ) -> ReplicaId:
        low = min(load[r] for r in candidates)
        tied = [r for r in candidates if load[r] == low]
        if len(tied) == 1:
            return tied[0]
        self._turn += 1
        return tied[self._turn % len(tied)]
