"""Router state: loads with in-flight requests, event gaps, replicas leaving, approximate mode."""

from __future__ import annotations

from raydix.cache import EventBuffer, RadixCache
from raydix.router.state import RouterState

PROMPT = list(range(100, 164))


def test_routed_but_unreported_requests_count_as_load() -> None:
    state = RouterState()
    state.set_replicas(["a", "b"])
    chosen = [state.route(list(range(i * 10, i * 10 + 8))).replica for i in range(4)]
    assert sorted(chosen) == ["a", "a", "b", "b"]  # cold prompts alternate
    state.report_load("a", 1, 0, 0.1, num_received=2)
    state.report_load("b", 30, 10, 0.9, num_received=2)
    assert state.route([999] * 8).replica == "a"


def test_exact_mode_follows_events_and_a_gap_resets_the_replica() -> None:
    state = RouterState(page_size=4)
    state.set_replicas(["a", "b"])
    buffer = EventBuffer()
    cache = RadixCache(page_size=4, event_sink=buffer)
    cache.insert(PROMPT, list(range(4, 68)))
    events = buffer.drain()
    state.publish("a", events)
    assert state.route(PROMPT + [1]).replica == "a"
    cache.insert(list(range(500, 508)), list(range(70, 78)))
    cache.insert(list(range(600, 608)), list(range(80, 88)))
    later = buffer.drain()
    state.publish("a", later[1:])  # the first of these was lost
    assert state.tree.match(PROMPT) == {}  # dropped, then rebuilt from what followed
    assert state.tree.match(list(range(600, 608))) == {"a": 8}


def test_replicas_that_leave_are_dropped_from_the_tree() -> None:
    state = RouterState(exact=False)
    state.set_replicas(["a", "b"])
    first = state.route(PROMPT).replica
    assert state.tree.match(PROMPT) == {first: 64}  # approximate mode records the decision
    assert state.route(PROMPT).replica == first  # and affinity follows it
    state.set_replicas(["a", "b", "c"][:1] if first == "b" else ["b"])
    assert state.tree.match(PROMPT) == {}


def test_approximate_mode_is_capped() -> None:
    state = RouterState(exact=False, max_approx_tokens=100)
    state.set_replicas(["a"])
    for i in range(10):
        state.route(list(range(i * 1000, i * 1000 + 40)))
    assert state.tree.num_tokens <= 100
    assert state.stats.percentile_us(99) > 0
