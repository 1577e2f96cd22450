"""The routing decision by expected time to first token (the cache-aware router's default).

A request's first token waits for the prompt tokens its replica must compute: the part of the
prompt the replica does not hold, behind the prompt tokens of the requests already routed there
and not yet computed (the replica's prefill backlog), and a little for each request the replica
runs (their decode steps share its steps). The tokens it computes also delay every request
that comes after it there, so a token to compute counts ``miss_cost`` (default 2) against a
token of another request's queue; and where they do not fit in the pool's free space (what
the replica's cache and backlog leave of its reported capacity) the replica evicts prefixes
that the requests which would hit them must compute again, so each token evicted counts
``miss_cost`` as well (nothing while the capacity is not reported). Each replica's cost, in
prompt tokens, is

    miss_cost * (to_compute + evicted) + backlog_tokens + request_cost_tokens * load
    to_compute = prompt_len - matched;  evicted = min(max(to_compute - free, 0), to_compute)

and the cheapest replica gets the request. No hit threshold: a holder's cached length is
weighed against its queue. What follows from it:

- a holder keeps its group's requests while its backlog is shorter than about ``miss_cost``
  times the prefix a cold replica would compute (a burst of one group's cold requests stays
  together: the first one's prefix, queued, costs the others less than computing it again);
- under cache pressure new prefixes go where they evict least, so each replica keeps about its
  share of them instead of evicting its own; while pools have room, free space decides nothing
  (a new replica beside full ones is not sent every new prefix);
- a hot prefix whose holder falls behind by more than the prefix spills to the replica that is
  cheapest with the prefix computed again: it becomes a second holder, and from then on the
  group's requests go to whichever holder is cheaper (the prefix is replicated where load needs
  it, and only there);
- a conversation's next turn goes where its earlier turns are cached (a prompt's cached prefix
  is its session) unless that replica is far behind;
- a prefix held only in a replica's host tier counts ``host_hit_weight`` per token
  (``RouterState`` folds that into ``matched``).

Costs less than one request's cost (``request_cost_tokens``) apart are a tie, the model being
no finer than that: among them the longest match (matches that close counting as equal), then
the least load, then a rotating start (in replica-name order), so a run of cold prompts spreads
over idle replicas though a few of their first tokens happen to be cached on some (a one-token
match must not draw every cold prompt). The rotation advances only when such a tie is broken.
A replica with a longer match than those, at a cost within ``tie_share`` of the lowest (default
15%), wins over them: the cost model is no finer than that (the load is a guess per request,
the evictions a count of tokens whatever their worth), and a copy of a prefix made elsewhere to
save one request a few percent of its wait takes pool space that later prefixes need.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from .policy import RoutingDecision

ReplicaId = Hashable


class ExpectedTTFTPolicy:
    def __init__(self, request_cost_tokens: float = 32.0, miss_cost: float = 2.0,
                 tie_share: float = 0.15) -> None:
        if request_cost_tokens < 0:
            raise ValueError(f"request_cost_tokens must be >= 0, got {request_cost_tokens}")
        if miss_cost < 1:
            raise ValueError(f"miss_cost must be >= 1, got {miss_cost}")
        if not 0.0 <= tie_share < 1.0:
            raise ValueError(f"tie_share must be in [0, 1), got {tie_share}")
        self.request_cost_tokens = request_cost_tokens
        self.miss_cost = miss_cost
        self.tie_share = tie_share
        self._turn = 0

    def cost(self, prompt_len: int, matched: int, backlog: float, load: float,
             free: float = float("inf")) -> float:
        """A replica's expected wait for this prompt's first token, in prompt tokens: the
        tokens it must compute and those it must evict for them weigh ``miss_cost`` each."""
        to_compute = prompt_len - matched
        evicted = min(max(to_compute - free, 0.0), to_compute)
        return (self.miss_cost * (to_compute + evicted) + backlog
                + self.request_cost_tokens * load)

    def choose(
        self,
        replicas: Sequence[ReplicaId],
        prompt_len: int,
        matched: Mapping[ReplicaId, int],
        loads: Mapping[ReplicaId, float],
        backlog: Mapping[ReplicaId, float],
        free: Mapping[ReplicaId, float] | None = None,
    ) -> RoutingDecision:
        """``backlog``: per replica, prompt tokens routed there and not yet computed; ``free``:
        the KV tokens its cache and backlog leave free in its pool (none given: no eviction)."""
        if not replicas:
            raise ValueError("no replica to route to")
        # one pass, no per-replica calls (64 replicas: this loop is most of a decision)
        free_of = (free or {}).get
        matched_of, load_of, backlog_of = matched.get, loads.get, backlog.get
        miss_cost, request_cost, share = self.miss_cost, self.request_cost_tokens, self.tie_share
        scored: list[tuple[float, int, float, ReplicaId]] = []
        low, best_len = float("inf"), 0
        for r in replicas:
            m, load = matched_of(r, 0), load_of(r, 0.0)
            if m > best_len:
                best_len = m
            to_compute = prompt_len - m
            c = miss_cost * to_compute + backlog_of(r, 0.0) + request_cost * load
            room = free_of(r)
            if room is not None and to_compute > room:  # it evicts
                c += miss_cost * min(to_compute - room, to_compute)
            if c <= low + request_cost or (m and c <= low + max(request_cost, share * low)):
                scored.append((c, m, load, r))
                if c < low:
                    low = c
        # costs less than one request's apart are a tie: among them the longest match (matches
        # as close), then the least load, then in turn; a longer match than theirs within
        # tie_share of the lowest cost wins over them (a copy would save a few percent)
        near = [e for e in scored if e[0] <= low + request_cost]
        top_m = max(e[1] for e in near)
        if share and best_len > top_m + request_cost:
            band = low + max(request_cost, share * low)
            longer = [e for e in scored if e[0] <= band and e[1] > top_m + request_cost]
            if longer:
                near, top_m = longer, max(e[1] for e in longer)
        near = [e for e in near if e[1] >= top_m - request_cost]
        least = min(e[2] for e in near)
        best = [e[3] for e in near if e[2] == least]
        chosen = best[0]
        if len(best) > 1:
            self._turn += 1
            best.sort(key=str)  # the same turn order whatever order the replicas came in
            chosen = best[self._turn % len(best)]
        chosen_len = next(e[1] for e in near if e[3] is chosen)
        if best_len == 0:
            reason = "least_loaded"
        elif chosen_len == best_len:
            reason = "cache"
        else:
            reason = "balance"
        return RoutingDecision(chosen, chosen_len, reason)
