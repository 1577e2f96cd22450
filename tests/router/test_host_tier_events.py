"""The router's tree follows a replica with a host KV tier: the host tier's events never touch
what the tree records for the device tier."""

from __future__ import annotations

import numpy as np
import pytest

from raydix.cache import CacheEvent, EventBuffer, EventKind, HiRadixCache
from raydix.router.policy import RoutingPolicyConfig
from raydix.router.state import RouterState
from raydix.router.tier_tree import TierTree
from raydix.router.tree import GlobalPrefixTree


def _device_paths(cache: HiRadixCache) -> set[tuple[None, tuple[int, ...]]]:
    out = set()
    for prefix in cache.iter_prefixes():
        above = prefix.prefix_ids.tolist()
        for end in range(1, len(prefix.token_ids) + 1):
            out.add((None, tuple(above + prefix.token_ids[:end].tolist())))
    return out


def test_host_events_leave_the_device_holdings_exact() -> None:
    buffer = EventBuffer()
    cache = HiRadixCache(page_size=1, num_host_pages=6, event_sink=buffer,
                         write_policy="write_through")
    tree = GlobalPrefixTree(page_size=1)
    kinds = set()

    def sync() -> None:
        for event in buffer.drain():
            kinds.add(event.kind)
            tree.apply_event("r1", event)
        assert tree.holdings("r1") == _device_paths(cache)
        tree.check_integrity()

    cache.insert([1, 2, 3], [11, 12, 13])
    cache.insert([1, 2, 7], [11, 12, 17])
    sync()
    cache.evict(1)  # [7] goes to the host
    sync()
    cache.insert([4, 5, 6], [14, 15, 16])  # the host tier is full: its LRU leaves go
    cache.evict(4)
    sync()
    assert cache.insert([1, 2, 3, 9], [21, 22, 23, 29]) == 0  # back from the host
    sync()
    assert {EventKind.HOST_INSERTED, EventKind.HOST_EVICTED} <= kinds
    assert tree.match([1, 2, 3, 9]) == {"r1": 4}


def _any_tier_paths(cache: HiRadixCache) -> set[tuple[None, tuple[int, ...]]]:
    out = set()
    for node in cache.iter_nodes():
        path = cache.node_tokens(node).tolist()
        start = len(path) - len(node.key) // 4
        out.update((None, tuple(path[:end])) for end in range(start + 1, len(path) + 1))
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_tier_tree_follows_both_tiers(page_size: int) -> None:
    rng = np.random.default_rng(page_size)
    buffer = EventBuffer()
    cache = HiRadixCache(page_size=page_size, num_host_pages=10, event_sink=buffer,
                         write_policy="write_through_selective")
    tree = TierTree(page_size)
    slots = iter(range(page_size, 10**6))
    for _ in range(300):
        op = rng.integers(0, 4)
        key = [int(t) for t in rng.integers(0, 3, size=int(rng.integers(1, 5)) * page_size)]
        if op < 2:
            cache.insert(key, [next(slots) for _ in key])
        elif op == 2:
            match = cache.match_prefix(key)
            if match.host_len:  # as the manager does: hold, then load into new slots
                cache.lock(match.handle)
                assert cache.hold_host_path(match.handle)
                cache.load_back(match.handle, np.array([next(slots) for _ in
                                                        range(match.handle.host_len)]))
                cache.unlock(match.handle)
        else:
            cache.evict(int(rng.integers(1, 4)) * page_size)
        cache.drain_copies()
        for event in buffer.drain():
            tree.apply_event("r1", event)
        assert tree.holdings("r1") == _any_tier_paths(cache)
        tree.check_integrity()


def test_router_weighs_a_host_hit_between_a_device_hit_and_a_miss() -> None:
    prompt = np.arange(2, 42, dtype=np.int32)

    def state_with(events: dict[str, list[tuple[EventKind, int, int]]]) -> RouterState:
        state = RouterState(page_size=1, policy=RoutingPolicyConfig(mode="threshold",
                                                                    cache_threshold=0.3))
        state.set_replicas(["device", "host", "cold"])
        for replica, kinds in events.items():
            state.publish(replica, [CacheEvent(0, EventKind.CLEARED, None, prompt[:0], 0)] + [
                CacheEvent(i + 1, kind, None, prompt[:end], num)
                for i, (kind, end, num) in enumerate(kinds)])
        return state

    # "host" holds 30 tokens in its host tier only (worth 15), "device" 20 on its device
    state = state_with({"device": [(EventKind.INSERTED, 20, 20)],
                        "host": [(EventKind.INSERTED, 30, 30), (EventKind.HOST_INSERTED, 30, 30),
                                 (EventKind.EVICTED, 30, 30)]})
    assert state.route(prompt).replica == "device"
    # 10 on the device + 20 in the host tier (worth 10): 20 beats a cold miss
    state = state_with({"host": [(EventKind.INSERTED, 30, 30), (EventKind.HOST_INSERTED, 30, 20),
                                 (EventKind.EVICTED, 30, 20)]})
    decision = state.route(prompt)
    assert (decision.replica, decision.matched_len) == ("host", 20)
    # the host copy gone too: nothing beyond the device's 10 (under the 0.3 threshold)
    state = state_with({"host": [(EventKind.INSERTED, 30, 30), (EventKind.HOST_INSERTED, 30, 20),
                                 (EventKind.EVICTED, 30, 20), (EventKind.HOST_EVICTED, 30, 20)]})
    assert state.route(prompt).reason == "least_loaded"


def test_expected_ttft_counts_a_host_hit_as_a_cheaper_miss() -> None:
    """The default policy: a prefix held in a host tier only saves ``host_hit_weight`` of its
    computation, so it is weighed against queues as that many tokens."""
    prompt = np.arange(2, 202, dtype=np.int32)  # 200 tokens

    def route(backlog_host: int) -> str:
        state = RouterState(page_size=1, policy=RoutingPolicyConfig(request_cost_tokens=0, tie_share=0))
        state.set_replicas(["host", "cold"])
        state.publish("host", [CacheEvent(0, EventKind.CLEARED, None, prompt[:0], 0),
                               CacheEvent(1, EventKind.INSERTED, None, prompt[:160], 160),
                               CacheEvent(2, EventKind.HOST_INSERTED, None, prompt[:160], 160),
                               CacheEvent(3, EventKind.EVICTED, None, prompt[:160], 160)])
        if backlog_host:  # requests routed to it and not yet computed
            state.in_flight.add("host", np.arange(5000, 5000 + backlog_host, dtype=np.int32),
                                cost=backlog_host)
            # as much of something else held on "cold": the same footprint (the same weight)
            state.publish("cold", [CacheEvent(0, EventKind.CLEARED, None, prompt[:0], 0),
                                   CacheEvent(1, EventKind.INSERTED, None,
                                              np.arange(9000, 9000 + backlog_host,
                                                        dtype=np.int32), backlog_host)])
        decision = state.route(prompt)
        assert decision.matched_len in (80, 0)  # 160 host tokens count as 80
        return str(decision.replica)

    # host: 2 * (200 - 80) = 240 + backlog; cold: 2 * 200 = 400
    assert route(0) == "host" and route(150) == "host"
    assert route(170) == "cold"  # a device hit of 160 would have kept it (80 + 170 < 400)
