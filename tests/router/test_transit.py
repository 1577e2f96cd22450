"""Requests routed by id stay in their replica's load, and keep their group together, until a
replica reports receiving them (router/transit.py)."""

from __future__ import annotations

import numpy as np
import pytest

from raydix.router.state import IDLE_GRACE_S, TRANSIT_TTL_S, RouterState
from raydix.router.transit import RequestsInTransit

PREFIX = list(range(100, 164))


def _state() -> tuple[RouterState, list[float]]:
    clock = [0.0]
    state = RouterState(clock=lambda: clock[0])
    state.set_replicas(["a", "b"])
    return state, clock


def test_a_request_slow_to_arrive_keeps_its_load_and_its_group_together() -> None:
    # On a loaded host a request can take longer to reach its replica than a report period;
    # the replica's reports until then say it is idle.
    state, clock = _state()
    first = state.route(PREFIX + [1], request_id="r1").replica
    clock[0] += 3 * IDLE_GRACE_S
    state.report_load(first, 0, 0, 0.0)  # idle, without r1: r1 is still on its way
    state.report_load(first, 0, 0, 0.0)
    assert state.load(first) == 1
    second = state.route(PREFIX + [2], request_id="r2")
    assert second.replica == first and second.matched_len == len(PREFIX)  # the group follows
    state.report_load(first, 0, 2, 0.0, received=["r1", "r2"])  # both arrived: now its own count
    assert state.load(first) == 2
    state.report_load(first, 0, 0, 0.0)
    assert state.load(first) == 0


def test_a_request_received_by_another_replica_leaves_the_chosen_one_at_once() -> None:
    state, _ = _state()
    chosen = state.route(PREFIX + [1], request_id="r1").replica
    other = "b" if chosen == "a" else "a"
    state.report_load(other, 1, 0, 0.1, received=["r1"])  # Serve sent it to the other one
    assert state.load(chosen) == 0 and state.load(other) == 1
    assert state.in_flight.match(np.asarray(PREFIX, np.int32)) == {}


def test_a_request_routed_again_leaves_its_first_choice() -> None:
    state, _ = _state()
    first = state.route(PREFIX + [1], request_id="r1").replica
    other = "b" if first == "a" else "a"
    again = state.route(PREFIX + [1], candidates=[other], request_id="r1")  # Serve chose anew
    assert again.replica == other
    assert state.load(first) == 0 and state.load(other) == 1
    assert state.route(PREFIX + [3], request_id="r3").replica == other  # it holds the group


def test_a_request_never_received_stops_counting_after_the_transit_ttl() -> None:
    state, clock = _state()  # its client left while Serve held it: no replica will name it
    chosen = state.route(PREFIX + [1], request_id="r1").replica
    clock[0] += TRANSIT_TTL_S - 0.1
    state.report_load(chosen, 0, 0, 0.0)
    assert state.load(chosen) == 1
    clock[0] += 0.1
    state.route(list(range(900, 940)), candidates=["a"], request_id="r2")  # expiry runs here
    assert state.load(chosen) == (1 if chosen == "a" else 0)


def test_without_an_id_a_request_counts_until_the_next_report() -> None:
    state, _ = _state()
    chosen = state.route(PREFIX + [1]).replica
    assert state.load(chosen) == 1
    state.report_load(chosen, 0, 0, 0.0)
    assert state.load(chosen) == 0


def test_a_request_never_received_is_forgotten_after_the_ttl() -> None:
    clock = [0.0]
    transit = RequestsInTransit(ttl_s=5.0, clock=lambda: clock[0])
    transit.add("r1", "a", ("a", 1))
    clock[0] = 4.9
    transit.add("r2", "a", None)
    assert transit.count("a") == 2 and transit.holds(("a", 1))
    clock[0] = 5.0
    transit.expire()
    assert transit.count("a") == 1 and not transit.holds(("a", 1))
    assert transit.received("b", ["r2", "unknown"]) == []  # r2 recorded no prefix
    assert transit.count("a") == 0 and len(transit) == 0


def test_a_newer_decision_for_an_id_outlives_the_older_ones_deadline() -> None:
    clock = [0.0]
    transit = RequestsInTransit(ttl_s=5.0, clock=lambda: clock[0])
    transit.add("r1", "a", ("a", 1))
    clock[0] = 3.0
    assert transit.add("r1", "b", ("b", 2)) == ("a", 1)  # the older choice's prefix
    clock[0] = 6.0  # the first deadline passed, not the second
    transit.expire()
    assert transit.count("b") == 1 and transit.count("a") == 0
    assert transit.received("b", ["r1"]) == []  # received where it was routed


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        RequestsInTransit(ttl_s=0)


def test_a_decision_made_after_its_request_arrived_records_nothing() -> None:
    # Serve stopped waiting for the router (decision timeout) and routed by load; the router
    # actor decided later, after the replica had reported receiving the request.
    state, clock = _state()
    state.report_load("b", 0, 1, 0.0, received=["r1"])
    late = state.route(PREFIX + [1], request_id="r1")
    assert state.load(late.replica) == (1 if late.replica == "b" else 0)  # b's own count only
    assert state.in_flight.match(np.asarray(PREFIX, np.int32)) == {}
    assert len(state.in_transit) == 0
    state.report_load("b", 0, 1, 0.0, received=["r2", "r3"])  # r2 and r3 decided by load
    assert state.in_transit.arrived("r2")
    clock[0] += TRANSIT_TTL_S  # ids received without a decision are kept for the ttl only
    state.in_transit.expire()
    assert not state.in_transit.arrived("r3")


def test_ids_received_without_a_decision_are_capped() -> None:
    transit = RequestsInTransit(max_early=2)
    transit.received("a", ["x", "y", "z"])
    assert not transit.arrived("x") and transit.arrived("y") and transit.arrived("z")
