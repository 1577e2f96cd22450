"""Routing decisions for scripted cases, with exact expected replicas."""

from __future__ import annotations

from raydix.cache import EventBuffer, RadixCache
from raydix.router.policy import CacheAwarePolicy, Fullness, RoutingPolicyConfig
from raydix.router.tree import GlobalPrefixTree

REPLICAS = ["r0", "r1", "r2"]
PROMPT = list(range(100, 164))  # 64 tokens
FULL = Fullness(num_waiting=2, kv_usage=0.95)  # saturated at the default 0.9
ROOM = Fullness(num_waiting=0, kv_usage=0.3)


def test_prefix_held_by_one_replica_wins() -> None:
    tree = GlobalPrefixTree()
    tree.insert("r1", PROMPT[:48])
    tree.insert("r2", PROMPT[:8])
    decision = CacheAwarePolicy().choose(REPLICAS, 64, tree.match(PROMPT), {r: 1 for r in REPLICAS})
    assert decision == ("r1", 48, "cache")


def test_imbalanced_load_overrides_affinity() -> None:
    tree = GlobalPrefixTree()
    tree.insert("r1", PROMPT)
    policy = CacheAwarePolicy(RoutingPolicyConfig(balance_abs_threshold=8, balance_rel_threshold=2))
    loads = {"r0": 2, "r1": 40, "r2": 5}
    assert policy.choose(REPLICAS, 64, tree.match(PROMPT), loads).replica == "r0"
    # a gap over the absolute threshold alone is not imbalance
    loads = {"r0": 30, "r1": 40, "r2": 35}
    assert policy.choose(REPLICAS, 64, tree.match(PROMPT), loads).replica == "r1"


def test_only_the_holders_overload_moves_a_request() -> None:
    """A holder with room keeps its hit though another replica is overloaded."""
    tree = GlobalPrefixTree()
    tree.insert("r1", PROMPT)
    policy = CacheAwarePolicy(RoutingPolicyConfig(balance_abs_threshold=8, balance_rel_threshold=2))
    loads = {"r0": 2, "r1": 3, "r2": 40}
    assert policy.choose(REPLICAS, 64, tree.match(PROMPT), loads) == ("r1", 64, "cache")
    full = {"r0": ROOM, "r1": ROOM, "r2": FULL}
    assert policy.choose(REPLICAS, 64, tree.match(PROMPT), loads, full) == (
        "r1",
        64,
        "cache",
    )


def test_a_saturated_holder_sends_its_hits_to_the_idlest() -> None:
    """A holder whose pool is full of running requests, with requests waiting, cannot take
    another in now: the idlest replica computes the prompt instead, whatever the thresholds."""
    tree = GlobalPrefixTree()
    tree.insert("r1", PROMPT)
    loads = {"r0": 3, "r1": 9, "r2": 1}  # a gap far below the default thresholds
    policy = CacheAwarePolicy()
    assert policy.choose(REPLICAS, 64, tree.match(PROMPT), loads) == ("r1", 64, "cache")
    full = {"r0": ROOM, "r1": FULL, "r2": ROOM}
    assert policy.choose(REPLICAS, 64, tree.match(PROMPT), loads, full) == ("r2", 0, "balance")
    # a full pool with nothing waiting, or requests waiting with room in the pool: not saturated
    for fullness in (Fullness(0, 0.95), Fullness(3, 0.85)):
        choice = policy.choose(REPLICAS, 64, tree.match(PROMPT), loads, {**full, "r1": fullness})
        assert choice == ("r1", 64, "cache")
    # every replica is as full: the hit stays where it is cached
    every = dict.fromkeys(REPLICAS, FULL)
    assert policy.choose(REPLICAS, 64, tree.match(PROMPT), loads, every) == ("r1", 64, "cache")
    # a saturated holder keeps it when the others are about as busy (9 <= 1.5 * 7)
    busy = {"r0": 8, "r1": 9, "r2": 7}
    assert policy.choose(REPLICAS, 64, tree.match(PROMPT), busy, full) == ("r1", 64, "cache")


def test_below_cache_threshold_goes_to_least_loaded() -> None:
    tree = GlobalPrefixTree()
    tree.insert("r1", PROMPT[:16])  # a quarter of the prompt
    loads = {"r0": 3, "r1": 1, "r2": 0}
    assert CacheAwarePolicy().choose(REPLICAS, 64, tree.match(PROMPT), loads) == (
        "r2",
        0,
        "least_loaded",
    )


def test_cold_start_spreads_the_load() -> None:
    policy = CacheAwarePolicy()
    loads = dict.fromkeys(REPLICAS, 0)
    for _ in range(6):
        chosen = policy.choose(REPLICAS, 64, {}, loads).replica
        loads[chosen] += 1  # routed but not yet seen by the replica: it counts
    assert loads == dict.fromkeys(REPLICAS, 2)


def test_cold_prompts_spread_between_cache_hits_on_idle_replicas() -> None:
    """Requests one at a time (every load back to 0): each new prefix goes to another replica,
    though cache hits on the earlier ones come in between."""
    policy = CacheAwarePolicy()
    tree = GlobalPrefixTree()
    idle = dict.fromkeys(REPLICAS, 0)
    homes = []
    for group in range(3):
        prompt = [1000 * (group + 1) + i for i in range(64)]
        home = policy.choose(REPLICAS, 64, tree.match(prompt), idle).replica
        tree.insert(home, prompt)
        homes.append(home)
        for _ in range(group + 1):  # hits on this group's prefix: one holder, no tie to break
            assert policy.choose(REPLICAS, 64, tree.match(prompt), idle) == (home, 64, "cache")
    assert sorted(homes) == REPLICAS


def test_eviction_events_move_the_choice() -> None:
    buffers = {r: EventBuffer() for r in REPLICAS}
    caches = {r: RadixCache(event_sink=buffers[r]) for r in REPLICAS}
    tree = GlobalPrefixTree()
    caches["r0"].insert(PROMPT[:60], list(range(1, 61)))
    caches["r2"].insert(PROMPT[:40], list(range(1, 41)))

    def sync() -> None:
        for r in REPLICAS:
            for event in buffers[r].drain():
                tree.apply_event(r, event)

    sync()
    loads = dict.fromkeys(REPLICAS, 1)
    policy = CacheAwarePolicy()
    assert policy.choose(REPLICAS, 64, tree.match(PROMPT), loads).replica == "r0"
    caches["r0"].evict(60)
    sync()
    assert policy.choose(REPLICAS, 64, tree.match(PROMPT), loads) == ("r2", 40, "cache")
