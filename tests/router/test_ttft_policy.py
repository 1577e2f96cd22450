"""The expected-time-to-first-token policy: scripted cases, and the router's decisions against a
plain reference that reads each replica's own cache and a list of the prompts routed to it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from raydix.cache import EventBuffer, RadixCache
from raydix.router.state import IDLE_GRACE_S, RouterState
from raydix.router.ttft_policy import ExpectedTTFTPolicy

R = ["r0", "r1", "r2"]


def test_a_holder_keeps_its_prefix_until_its_backlog_outweighs_it() -> None:
    policy = ExpectedTTFTPolicy(request_cost_tokens=0, miss_cost=1, tie_share=0)
    matched = {"r1": 900}
    # r1 holds 900 of 1,000 tokens: 100 to compute behind 800 queued beats 1,000 on an idle one
    assert policy.choose(R, 1000, matched, {}, {"r1": 800}) == ("r1", 900, "cache")
    # behind 950 queued, computing the whole prompt on an idle replica is sooner: it overflows
    assert policy.choose(R, 1000, matched, {}, {"r1": 950}).reason == "balance"
    # a miss counted twice: the holder keeps it up to 1,800 queued
    policy = ExpectedTTFTPolicy(request_cost_tokens=0, miss_cost=2, tie_share=0)
    assert policy.choose(R, 1000, matched, {}, {"r1": 1750}) == ("r1", 900, "cache")
    assert policy.choose(R, 1000, matched, {}, {"r1": 1850}).reason == "balance"


def test_costs_within_the_tie_share_are_a_tie_that_the_holder_wins() -> None:
    """The default tie share: a holder keeps its prefix while its expected wait is within 15%
    of the best other's (a copy made elsewhere for a few percent of one request's wait takes
    pool space every later prefix needs); beyond that it spills as before."""
    policy = ExpectedTTFTPolicy(request_cost_tokens=0, miss_cost=1)
    matched = {"r1": 900}
    # 100 + 950 = 1,050 against 1,000 on an idle replica: within 15%
    assert policy.choose(R, 1000, matched, {}, {"r1": 950}) == ("r1", 900, "cache")
    assert policy.choose(R, 1000, matched, {}, {"r1": 1050}) == ("r1", 900, "cache")
    assert policy.choose(R, 1000, matched, {}, {"r1": 1100}).reason == "balance"  # 1,200
    # as the simulated cluster met it (router_bench http --simulate, workload 1): a tenant's
    # holder 2,336 tokens behind with a full pool, an idle replica with room:
    # 2 * 64 + 2 * 64 + 2,336 + 320 = 2,912 against 2 * 1,088 + 160 + 288 = 2,624 (11% apart)
    policy = ExpectedTTFTPolicy()
    d = policy.choose(R, 1088, {"r0": 1024}, {"r0": 10, "r1": 9, "r2": 11},
                      {"r0": 2336, "r1": 160, "r2": 2336}, {"r0": 0, "r1": 1744, "r2": 0})
    assert d == ("r0", 1024, "cache")
    assert ExpectedTTFTPolicy(tie_share=0).choose(
        R, 1088, {"r0": 1024}, {"r0": 10, "r1": 9, "r2": 11},
        {"r0": 2336, "r1": 160, "r2": 2336}, {"r0": 0, "r1": 1744, "r2": 0}).replica == "r1"
    with pytest.raises(ValueError, match="tie_share"):
        ExpectedTTFTPolicy(tie_share=1.0)


def test_a_burst_of_one_cold_group_stays_together() -> None:
    """Nothing computed yet: the first request's prefix is queued on its replica, and the
    group's next requests follow it there rather than computing the prefix again."""
    policy = ExpectedTTFTPolicy()
    backlog = dict.fromkeys(R, 0.0)
    matched: dict[str, int] = {}
    homes = []
    for _ in range(4):
        d = policy.choose(R, 576, matched, {}, backlog)
        homes.append(d.replica)
        backlog[d.replica] += 576 - d.matched_len
        matched[d.replica] = 512  # in flight: the router counts it held
    assert len(set(homes)) == 1


def test_overflow_makes_a_second_holder_then_alternates_between_them() -> None:
    """A hot prefix brings 40 new tokens a request while a replica computes 25 meanwhile: its
    holder falls behind until computing the whole prompt elsewhere is sooner, once; from then
    on the two holders keep up together, and the third replica is left alone."""
    policy = ExpectedTTFTPolicy(request_cost_tokens=0)
    prompt, prefix = 1000, 960
    matched = {"r0": prefix}
    backlog = dict.fromkeys(R, 0.0)
    homes = []
    for _ in range(300):
        d = policy.choose(R, prompt, matched, {}, backlog)
        homes.append(d.replica)
        backlog[d.replica] += prompt - d.matched_len
        matched[d.replica] = prefix  # the replica computes it (events confirm the prefix)
        backlog = {r: max(b - 25, 0.0) for r, b in backlog.items()}
    second = next(r for r in homes if r != "r0")
    spill = homes.index(second)
    assert spill > 30 and set(homes[:spill]) == {"r0"}
    assert set(homes) == {"r0", second}  # one copy only
    assert homes[spill:].count("r0") > 50 and homes[spill:].count(second) > 50
    assert max(backlog.values()) < 1000


def test_load_counts_per_request() -> None:
    policy = ExpectedTTFTPolicy(request_cost_tokens=50, miss_cost=1)
    loads = {"r0": 4, "r1": 1, "r2": 0}
    assert policy.choose(R, 100, {"r0": 100}, loads, {}) == ("r2", 0, "balance")  # 200 > 100
    assert policy.choose(R, 400, {"r0": 400}, loads, {}) == ("r0", 400, "cache")  # 200 < 400


def test_new_prefixes_go_where_they_evict_least() -> None:
    """Equal queues: a cold prompt goes to the replica that must evict least for it, though
    another is a little less busy; with room in every pool, the less busy one."""
    policy = ExpectedTTFTPolicy(request_cost_tokens=32)
    loads = {"r0": 0, "r1": 2, "r2": 1}
    free = {"r0": 0.0, "r1": 3000.0, "r2": 500.0}
    assert policy.choose(R, 1000, {}, loads, {}, free).replica == "r1"
    assert policy.choose(R, 1000, {}, loads, {}, dict.fromkeys(R, 1000.0)).replica == "r0"
    # a pool over-full by its backlog evicts no more than the prompt
    assert policy.cost(1000, 0, 0.0, 0.0, free=-5000.0) == 2 * 2000


def test_a_few_cached_first_tokens_do_not_draw_every_cold_prompt() -> None:
    """Unrelated cold prompts on idle replicas, with one or two of their first tokens cached
    on some: they spread over all of them (costs one request's apart are a tie)."""
    policy = ExpectedTTFTPolicy()
    chosen = [policy.choose(R, 80, {"r0": 2, "r1": 1}, {}, {}).replica for _ in range(6)]
    assert sorted(chosen) == sorted(R * 2)
    # a real hit still wins: a holder of 40 of the 80 tokens
    assert policy.choose(R, 80, {"r0": 40, "r1": 1}, {}, {}) == ("r0", 40, "cache")


def test_a_new_replica_shares_cold_prompts_with_running_ones() -> None:
    """Two replicas that served earlier groups and an empty one that replaces a third, pools
    with room: unrelated cold prompts, one at a time, reach all three (not only the empty one,
    and not only the holders of a few of their first tokens)."""
    rng = np.random.default_rng(3)
    state = RouterState(page_size=1)
    state.set_replicas(["a", "b"])
    buffers = {r: EventBuffer() for r in "abn"}
    caches = {r: RadixCache(event_sink=buffers[r]) for r in "abn"}
    slots = itertools.count(1)

    def serve(prompt: list[int]) -> str:
        r = str(state.route(prompt).replica)
        caches[r].insert(prompt + [7, 7], [next(slots) for _ in range(len(prompt) + 2)])
        state.publish(r, buffers[r].drain())
        state.report_load(r, 0, 0, 0.0, kv_capacity=4096)
        return r

    for r in "ab":
        state.report_load(r, 0, 0, 0.0, kv_capacity=4096)
    groups = [rng.integers(2, 256, 64).tolist() for _ in range(9)]
    for _ in range(60):  # the running replicas fill a third of their pools
        serve(groups[int(rng.integers(9))] + rng.integers(2, 256, 16).tolist())
    state.set_replicas(["a", "b", "n"])
    state.report_load("n", 0, 0, 0.0, kv_capacity=4096)
    homes = [serve(rng.integers(2, 256, 80).tolist()) for _ in range(9)]
    assert set(homes) == {"a", "b", "n"} and max(homes.count(r) for r in "abn") <= 4, homes


def test_sequential_groups_keep_one_home() -> None:
    """Requests one at a time (each computed and reported before the next): every group stays
    on the replica that computed its prefix first, and the groups spread."""
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(2, 500, 64).tolist() for _ in range(3)]
    items = [(g, prefixes[g] + rng.integers(2, 500, int(rng.integers(8, 25))).tolist())
             for g in range(3) for _ in range(8)]
    state = RouterState(page_size=1)
    state.set_replicas(R)
    buffers = {r: EventBuffer() for r in R}
    caches = {r: RadixCache(event_sink=buffers[r]) for r in R}
    slots = itertools.count(1)
    homes: dict[int, set[str]] = {}
    for i in rng.permutation(len(items)):
        group, prompt = items[i]
        r = str(state.route(prompt).replica)
        homes.setdefault(group, set()).add(r)
        caches[r].insert(prompt + [7] * 4, [next(slots) for _ in range(len(prompt) + 4)])
        state.publish(r, buffers[r].drain())
        state.report_load(r, 0, 0, 0.0, kv_capacity=4096)
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set().union(*homes.values())) == 3


def test_cold_prompts_spread_over_idle_replicas() -> None:
    policy = ExpectedTTFTPolicy()
    chosen = [policy.choose(R, 64, {}, {}, {}).replica for _ in range(6)]
    assert sorted(chosen) == sorted(R * 2) and chosen[:3] != chosen[3:4] * 3


def test_refuses_a_negative_request_cost() -> None:
    with pytest.raises(ValueError, match="request_cost_tokens"):
        ExpectedTTFTPolicy(-1)
    with pytest.raises(ValueError, match="miss_cost"):
        ExpectedTTFTPolicy(miss_cost=0.5)


# ---------------------------------------------------------------- against a plain reference
def _lcp(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


class Reference:
    """The rule in plain terms: matched = what the replica's cache holds, or the longest
    prefix shared with a prompt routed there and not yet in its cache; backlog = the prompt
    tokens those routed prompts brought that their replica did not hold; free = its reported
    capacity less the tokens its cache holds (its own count) and its backlog. A
    replica reporting nothing running or waiting forgets the prompts routed to it at least
    ``IDLE_GRACE_S`` before (they went elsewhere)."""

    def __init__(self, request_cost: float, miss_cost: float, tie_share: float) -> None:
        self.request_cost = request_cost
        self.miss_cost = miss_cost
        self.tie_share = tie_share
        self.capacity: dict[str, int] = {}
        self.pending: dict[str, list[tuple[list[int], int, float]]] = {r: [] for r in R}
        self.turn = 0
        self.now = 0.0

    def route(self, prompt: list[int], caches: dict[str, RadixCache],
              loads: dict[str, int]) -> tuple[str, int]:
        costs, matched = {}, {}
        backlog = {r: sum(c for _, c, _ in self.pending[r]) for r in R}
        for r in R:
            held = caches[r].match_prefix(np.asarray(prompt, dtype=np.int32)).cached_len
            matched[r] = max([held] + [_lcp(prompt, p) for p, _, _ in self.pending[r]])
            to_compute = len(prompt) - matched[r]
            free = (self.capacity[r] - sum(caches[r].size_info) - backlog[r]
                    if r in self.capacity else float("inf"))
            evicted = min(max(to_compute - free, 0), to_compute)
            costs[r] = (self.miss_cost * (to_compute + evicted) + backlog[r]
                        + self.request_cost * loads[r])
        # within one request's cost: a tie; a longer match within the tie share of the lowest
        # cost wins over them; then the longest match (as close), least load
        low = min(costs.values())
        near = [r for r in R if costs[r] <= low + self.request_cost]
        top = max(matched[r] for r in near)
        longer = [r for r in R if matched[r] > top + self.request_cost and self.tie_share
                  and costs[r] <= low + max(self.request_cost, self.tie_share * low)]
        if longer:
            near, top = longer, max(matched[r] for r in longer)
        near = [r for r in near if matched[r] >= top - self.request_cost]
        tied = sorted(r for r in near if loads[r] == min(loads[q] for q in near))
        chosen = tied[0]
        if len(tied) > 1:
            self.turn += 1
            chosen = tied[self.turn % len(tied)]
        self.pending[chosen].append((prompt, len(prompt) - matched[chosen], self.now))
        return chosen, matched[chosen]

    def computed(self, r: str, cache: RadixCache, inserted: list[list[int]]) -> None:
        """r's events arrived: its prompts now held, or prefixes of a path it inserted, end."""
        def done(p: list[int]) -> bool:
            held = cache.match_prefix(np.asarray(p, dtype=np.int32)).cached_len
            return held >= len(p) or any(len(p) <= len(q) and q[: len(p)] == p
                                         for q in inserted)
        self.pending[r] = [e for e in self.pending[r] if not done(e[0])]

    def idle(self, r: str) -> None:
        self.pending[r] = [e for e in self.pending[r] if e[2] > self.now - IDLE_GRACE_S]


@pytest.mark.parametrize("seed", range(6))
def test_router_state_decides_as_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    clock = [0.0]
    state = RouterState(page_size=1, clock=lambda: clock[0])
    state.set_replicas(R)
    reference = Reference(state.ttft_policy.request_cost_tokens, state.ttft_policy.miss_cost,
                          state.ttft_policy.tie_share)
    buffers = {r: EventBuffer() for r in R}
    caches = {r: RadixCache(event_sink=buffers[r]) for r in R}
    slots = itertools.count(1)
    groups = [rng.integers(100, 1000, int(rng.integers(20, 120))).tolist() for _ in range(5)]
    routed: dict[str, list[list[int]]] = {r: [] for r in R}
    for _ in range(150):
        clock[0] = reference.now = reference.now + 0.15  # 22 s in all: none reaches the ttl
        prompt = groups[int(rng.integers(5))] + rng.integers(100, 1000, 8).tolist()
        loads_now = {r: int(state.load(r)) for r in R}
        decision = state.route(prompt)
        expected = reference.route(prompt, caches, loads_now)
        assert (decision.replica, decision.matched_len) == expected
        routed[str(decision.replica)].append(prompt)
        if rng.random() < 0.4:  # a replica computes what it was sent, and may evict
            r = R[int(rng.integers(3))]
            inserted = routed[r][: int(rng.integers(0, len(routed[r]) + 1))]
            del routed[r][: len(inserted)]
            for p in inserted:
                caches[r].insert(p, [next(slots) for _ in p])
            if rng.random() < 0.3:
                caches[r].evict(int(rng.integers(1, 200)))
            state.publish(r, buffers[r].drain())
            reference.computed(r, caches[r], inserted)
        if rng.random() < 0.2:
            r = R[int(rng.integers(3))]
            capacity = int(rng.integers(300, 3000))
            running, waiting = int(rng.integers(0, 3)), int(rng.integers(0, 2))
            state.report_load(r, running, waiting, 0.5, kv_capacity=capacity)
            reference.capacity[r] = capacity
            if running == waiting == 0:
                reference.idle(r)
    state.in_flight.check_integrity()
    for r in R:
        assert state.in_flight.backlog(r) == sum(c for _, c, _ in reference.pending[r])


def test_a_request_sent_elsewhere_stops_counting_once_its_replica_reports_idle() -> None:
    """The router chose a replica but Serve sent the request to another (the chosen one missed
    its queue-length deadline): the chosen one looks busy and holds the prompt only until it
    reports nothing to do, once the request has had time to reach it."""
    clock = [0.0]
    state = RouterState(page_size=1, clock=lambda: clock[0])
    state.set_replicas(R)
    for r in R:
        state.report_load(r, 0, 0, 0.0, kv_capacity=4096)
    homes = [str(state.route(list(range(b, b + 80))).replica) for b in (100, 200, 300)]
    assert sorted(homes) == R  # cold prompts spread
    other, lost = homes[0], homes[2]  # the last never reaches its replica; `other` gets it
    state.report_load(lost, 0, 0, 0.0)  # too soon: the request may be on its way
    assert state.in_flight.backlog(lost) == 80
    clock[0] = IDLE_GRACE_S + 0.1
    state.report_load(other, 1, 0, 0.0)  # busy with what it was sent
    state.report_load(lost, 0, 0, 0.0)
    assert state.in_flight.backlog(lost) == 0 and state.in_flight.backlog(other) == 80
    assert state.in_flight.match(np.arange(300, 380, dtype=np.int32)) == {}
