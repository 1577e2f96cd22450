"""What the router knows: the global prefix tree, and each replica's load.

Exact mode mirrors the replicas' own cache events, and holds each routing decision aside
(``InFlightPrefixes``) until the chosen replica's events confirm it, so the requests of one group
that arrive together follow the first one. Approximate mode (events off) records each routing
decision in the tree instead, capped at ``max_approx_tokens`` with LRU eviction.

A replica's load is its running plus waiting requests as of its last load report, plus the
requests routed to it that it has not reported receiving (``RequestsInTransit``: decisions made
with the request's id, until a replica reports that id), plus those routed without an id since
its last report. So a burst routed between two reports is not invisible, nor is a request that
takes longer than a report period to arrive; and a request that Serve sent elsewhere than the
router chose (the chosen replica was full or slow to answer) leaves the chosen one's count as
soon as the replica that got it reports it. Without an id that takes until the chosen one's next
report, which replicas send at least every second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from raydix.cache import CacheEvent, EventKind

from .in_flight import InFlightPrefixes
from .policy import CacheAwarePolicy, Fullness, RoutingDecision, RoutingPolicyConfig
from .tier_tree import TierTree
from .transit import RequestsInTransit
from .tree import GlobalPrefixTree
from .ttft_policy import ExpectedTTFTPolicy

ReplicaId = Hashable
NOT_FULL = Fullness(num_waiting=0, kv_usage=0.0)
_HOST_EVENTS = (EventKind.HOST_INSERTED, EventKind.HOST_EVICTED)


@dataclass
class ReplicaLoad:
    num_running: int = 0
    fullness: Fullness = NOT_FULL  # waiting requests and KV usage, as last reported
    num_unreported: int = 0  # requests routed to it without an id since its last report
    last_event_seq: int = -1
    needs_snapshot: bool = False  # its events stopped following on; see `RouterState.publish`
    kv_capacity: int = 0  # its KV pool's tokens, as last reported (0: not known)
    decisions: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0

    def load(self, in_transit: int) -> float:
        """With `in_transit` requests routed to it by id and not received yet."""
        return self.num_running + self.fullness.num_waiting + self.num_unreported + in_transit


@dataclass
class RouterStats:
    decision_ns: list[int] = field(default_factory=list)

    def record(self, ns: int) -> None:
        self.decision_ns.append(ns)
        if len(self.decision_ns) > 10_000:
            del self.decision_ns[:5_000]

    def percentile_us(self, q: float) -> float:
        return float(np.percentile(self.decision_ns, q)) / 1e3 if self.decision_ns else 0.0


MAX_APPROX_TOKENS = 4_000_000  # approximate mode: the tree's default cap, in tokens
# a replica reporting nothing running or waiting drops its decisions in flight older than this
# (the request went elsewhere); younger ones may still be on their way to it
IDLE_GRACE_S = 1.0
# a request routed by id counts as on its way this long at most: long enough for a loaded host,
# short enough that one Serve never sent (its client left while it waited) soon stops counting
TRANSIT_TTL_S = 10.0


class RouterState:
    def __init__(
        self,
        page_size: int = 1,
        policy: RoutingPolicyConfig | None = None,
        exact: bool = True,
        max_approx_tokens: int = MAX_APPROX_TOKENS,
        in_flight_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tree = GlobalPrefixTree(page_size)
        self.tier_tree = TierTree(page_size)  # device or host tier (tier_tree.py)
        self._host_tier_replicas: set[ReplicaId] = set()  # those that sent host-tier events
        self.in_flight = InFlightPrefixes(page_size, in_flight_ttl_s, clock=clock)
        self.in_transit = RequestsInTransit(min(TRANSIT_TTL_S, in_flight_ttl_s), clock=clock)
        self.policy = CacheAwarePolicy(policy)  # its config: the settings of either mode
        self.ttft_policy = ExpectedTTFTPolicy(self.policy.config.request_cost_tokens,
                                              self.policy.config.miss_cost,
                                              self.policy.config.tie_share)
        self._by_ttft = self.policy.config.mode == "ttft"
        self.exact = exact
        self.max_approx_tokens = max_approx_tokens
        self.replicas: dict[ReplicaId, ReplicaLoad] = {}
        self.stats = RouterStats()

    def set_replicas(self, replicas: Iterable[ReplicaId]) -> None:
        """The live replicas; ones that left are dropped from the tree."""
        live = set(replicas)
        for gone in set(self.replicas) - live:
            self.tree.drop_replica(gone)
            self.tier_tree.drop_replica(gone)
            self._host_tier_replicas.discard(gone)
            self.in_flight.drop_replica(gone)
            self.in_transit.drop_replica(gone)
            del self.replicas[gone]
        for new in live - set(self.replicas):
            self.replicas[new] = self._new_replica()

    def _new_replica(self) -> ReplicaLoad:
        """A replica the router lists from now on. In exact mode the router knows nothing of
        its cache until its events arrive from the first one (seq 0), so it asks for the
        snapshot at the replica's next report: one that was registered after its first events
        (dropped while it was not listed) and stays idle would otherwise stay unknown."""
        return ReplicaLoad(needs_snapshot=self.exact)

    def route(
        self,
        token_ids: npt.ArrayLike,
        extra_key: Hashable = None,
        candidates: Sequence[ReplicaId] | None = None,
        request_id: str | None = None,
    ) -> RoutingDecision:
        """`request_id`: the request's own id, which the replica that receives it reports
        (`RequestsInTransit`); None: counted until the chosen replica's next load report."""
        start = time.perf_counter_ns()
        self.in_transit.expire()
        names = list(candidates) if candidates is not None else list(self.replicas)
        for name in names:
            if name not in self.replicas:
                self.replicas[name] = self._new_replica()
        tokens = np.asarray(token_ids, dtype=np.int32)
        matched = self.tree.match(tokens, extra_key)
        if self._host_tier_replicas:
            self._add_host_hits(matched, tokens, extra_key)
        if self.exact:
            for name, length in self.in_flight.match(tokens, extra_key).items():
                if length > matched.get(name, 0):
                    matched[name] = length
        if self._by_ttft:
            loads, backlog, free = self._ttft_inputs(names)
            decision = self.ttft_policy.choose(names, len(tokens), matched, loads, backlog, free)
        else:
            count = self.in_transit.count
            loads = {name: self.replicas[name].load(count(name)) for name in names}
            fullness = {name: self.replicas[name].fullness for name in names}
            decision = self.policy.choose(names, len(tokens), matched, loads, fullness)
        chosen = self.replicas[decision.replica]
        chosen.decisions += 1
        chosen.prompt_tokens += len(tokens)
        chosen.hit_tokens += decision.matched_len
        # decided after the request reached a replica (Serve stopped waiting): nothing to hold
        late = request_id is not None and self.in_transit.arrived(request_id)
        entry = None
        if self.exact and not late:
            entry = self.in_flight.add(decision.replica, tokens, extra_key,
                                       cost=len(tokens) - decision.matched_len)
        if request_id is None:
            chosen.num_unreported += 1
        elif not late:
            replaced = self.in_transit.add(request_id, decision.replica, entry)
            if replaced is not None:  # routed again: the earlier choice will not see it
                self.in_flight.remove(replaced)
        if not self.exact:
            aligned = len(tokens) // self.tree.page_size * self.tree.page_size
            self.tree.insert(decision.replica, tokens[:aligned], extra_key)
            self.tree.evict_lru(self.max_approx_tokens)
        self.stats.record(time.perf_counter_ns() - start)
        return decision

    def load(self, replica: ReplicaId) -> float:
        """Its running and waiting requests as reported, and those routed to it since."""
        return self.replicas[replica].load(self.in_transit.count(replica))

    def _ttft_inputs(self, names: Sequence[ReplicaId]
                     ) -> tuple[dict[ReplicaId, float], dict[ReplicaId, float],
                                dict[ReplicaId, float]]:
        """Per replica: its load, its prefill backlog, and the KV tokens its cache and backlog
        leave free in its pool (none while its capacity is not known), in one pass."""
        loads: dict[ReplicaId, float] = {}
        backlogs: dict[ReplicaId, float] = {}
        free: dict[ReplicaId, float] = {}
        backlog_of, held_of = self.in_flight.backlog, self.tree.held_tokens
        in_transit = self.in_transit.counts().get  # one dict read per replica
        for name in names:
            state = self.replicas[name]
            loads[name] = (state.num_running + state.fullness.num_waiting + state.num_unreported
                           + in_transit(name, 0))
            b = backlogs[name] = backlog_of(name)
            if state.kv_capacity:
                free[name] = state.kv_capacity - held_of(name) - b
        return loads, backlogs, free

    def _add_host_hits(self, matched: dict[ReplicaId, int], tokens: npt.NDArray[np.int32],
                       extra_key: Hashable) -> None:
        """A replica's prefix beyond its device hit that it holds in its host tier counts
        ``host_hit_weight`` per token: a cheaper miss (a load instead of a prefill)."""
        weight = self.policy.config.host_hit_weight
        for name, held_len in self.tier_tree.match(tokens, extra_key).items():
            device_len = matched.get(name, 0)
            if held_len > device_len:
                matched[name] = device_len + int(weight * (held_len - device_len))

    def publish(self, replica: ReplicaId, events: Sequence[CacheEvent]) -> bool:
        """Apply a batch of a replica's cache events; returns whether the router needs the
        replica's snapshot (its whole cache sent again, starting with ``CLEARED``).

        Events that do not follow on from the last one seen (the router restarted, the replica
        was registered after it began, or events were lost) drop the replica's entries; what
        follows is applied, and the snapshot is asked for until its ``CLEARED`` arrives.
        Events of a replica the router does not list are ignored; once listed, it is asked for
        the snapshot unless its events begin at the first one (`_new_replica`)."""
        if not self.exact or replica not in self.replicas:
            return False
        state = self.replicas[replica]
        for event in events:
            if event.seq <= state.last_event_seq:
                continue
            if event.kind is EventKind.CLEARED or event.seq == 0 == state.last_event_seq + 1:
                state.needs_snapshot = False  # the whole cache, or its history from the start
            elif event.seq != state.last_event_seq + 1:
                self.tree.drop_replica(replica)
                self.tier_tree.drop_replica(replica)
                state.needs_snapshot = True
            state.last_event_seq = event.seq
            self.tree.apply_event(replica, event)
            self.tier_tree.apply_event(replica, event)
            if event.kind is EventKind.INSERTED:
                self.in_flight.confirm_path(replica, event.token_ids, event.extra_key)
            if event.kind in _HOST_EVENTS:
                self._host_tier_replicas.add(replica)
        if events:
            self.in_flight.confirm(
                replica, lambda tokens, key: self.tree.match(tokens, key).get(replica, 0)
            )
        return state.needs_snapshot

    def report_load(
        self,
        replica: ReplicaId,
        num_running: int,
        num_waiting: int,
        kv_usage: float,
        kv_capacity: int = 0,
        received: Sequence[str] = (),
    ) -> None:
        """The replica's counts, and the ids of the requests it received since its last
        report (they count in its running and waiting requests from now on)."""
        for entry in self.in_transit.received(replica, received):
            self.in_flight.remove(entry)  # routed to another replica, which never saw it
        state = self.replicas.get(replica)
        if state is None:
            return
        if kv_capacity:
            state.kv_capacity = kv_capacity
        state.num_running = num_running
        state.fullness = Fullness(num_waiting, kv_usage)
        state.num_unreported = 0
        if self.exact and num_running == 0 and num_waiting == 0:
            self.in_flight.drop_stale(replica, IDLE_GRACE_S, self.in_transit.holds)
