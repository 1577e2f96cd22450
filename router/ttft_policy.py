"""The routing decision by expected time to first token (the cache-aware router's default).

A request's first token waits for the prompt tokens its replica must compute: the part of the
prompt the replica does not hold, behind the prompt tokens of the requests already routed there
and not yet computed (the replica's prefill backlog), and a little for each request the replica
runs (their decode steps share its steps). The tokens it computes also delay every request
that comes after it there, so a token to compute counts ``miss_cost`` (default 2) against a
token of another request's queue; and they take pool space from the prefixes the replica
holds, which the requests that would hit them must compute again, a cost that grows as its
pool fills: the weight is ``miss_cost * (1 + fill)``, where ``fill`` is the share of the
replica's KV pool that its cache and backlog hold (0 while its capacity is not reported).
Each replica's cost, in prompt tokens, is

    miss_cost * (1 + fill) * (prompt_len - matched) + backlog_tokens + request_cost_tokens * load

and the cheapest replica gets the request. No hit threshold: a holder's cached length is
weighed against its queue. What follows from it:

- a holder keeps its group's requests while its backlog is shorter than about ``miss_cost``
  times the prefix a cold replica would compute (a burst of one group's cold requests stays
  together: the first one's prefix, queued, costs the others less than computing it again);
- new prefixes go where the pool is least full, so under cache pressure each replica keeps
  about its share of them instead of evicting its own;
- a hot prefix whose holder falls behind by more than the prefix spills to the replica that is
  cheapest with the prefix computed again: it becomes a second holder, and from then on the
  group's requests go to whichever holder is cheaper (the prefix is replicated where load needs
  it, and only there);
- a conversation's next turn goes where its earlier turns are cached (a prompt's cached prefix
  is its session) unless that replica is far behind;
- a prefix held only in a replica's host tier counts ``host_hit_weight`` per token
  (``RouterState`` folds that into ``matched``).

Equal costs go to the longer match, then the lesser load, then a rotating start (in replica-name order), so a run of
cold prompts spreads over idle replicas. The rotation advances only when such a tie is broken.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from .policy import RoutingDecision

ReplicaId = Hashable


class ExpectedTTFTPolicy:
    def __init__(self, request_cost_tokens: float = 32.0, miss_cost: float = 2.0) -> None:
        if request_cost_tokens < 0:
            raise ValueError(f"request_cost_tokens must be >= 0, got {request_cost_tokens}")
        if miss_cost < 1:
            raise ValueError(f"miss_cost must be >= 1, got {miss_cost}")
        self.request_cost_tokens = request_cost_tokens
        self.miss_cost = miss_cost
        self._turn = 0

    def cost(self, prompt_len: int, matched: int, backlog: float, load: float,
             fill: float = 0.0) -> float:
        """A replica's expected wait for this prompt's first token, in prompt tokens, with the
        tokens it must compute weighed ``miss_cost * (1 + fill)``."""
        weight = self.miss_cost * (1.0 + fill)
        return weight * (prompt_len - matched) + backlog + self.request_cost_tokens * load

    def choose(
        self,
        replicas: Sequence[ReplicaId],
        prompt_len: int,
        matched: Mapping[ReplicaId, int],
        loads: Mapping[ReplicaId, float],
        backlog: Mapping[ReplicaId, float],
        fill: Mapping[ReplicaId, float] | None = None,
    ) -> RoutingDecision:
        """``backlog``: per replica, prompt tokens routed there and not yet computed; ``fill``:
        the share of its KV pool its cache and backlog hold (none given: 0)."""
        if not replicas:
            raise ValueError("no replica to route to")
        # one pass, no per-replica tuples or calls (64 replicas: this loop is most of a
        # decision); the same order as ranking by (cost, -matched, load)
        fill_of = (fill or {}).get
        matched_of, load_of, backlog_of = matched.get, loads.get, backlog.get
        miss_cost, request_cost = self.miss_cost, self.request_cost_tokens
        best: list[ReplicaId] = []
        best_cost, best_m, best_load, best_len = float("inf"), 0, 0.0, 0
        for r in replicas:
            m, load = matched_of(r, 0), load_of(r, 0.0)
            if m > best_len:
                best_len = m
            c = (miss_cost * (1.0 + fill_of(r, 0.0)) * (prompt_len - m) + backlog_of(r, 0.0)
                 + request_cost * load)
            if c > best_cost:
                continue
            if c < best_cost or m > best_m or (m == best_m and load < best_load):
                best, best_cost, best_m, best_load = [r], c, m, load
            elif m == best_m and load == best_load:
                best.append(r)
        chosen = best[0]
        if len(best) > 1:
            self._turn += 1
            best.sort(key=str)  # the same turn order whatever order the replicas came in
            chosen = best[self._turn % len(best)]
        chosen_len = best_m
        if best_len == 0:
            reason = "least_loaded"
        elif chosen_len == best_len:
            reason = "cache"
        else:
            reason = "balance"
        return RoutingDecision(chosen, chosen_len, reason)
