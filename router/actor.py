"""The router actor: one named Ray actor per application holds the ``RouterState``.

Every ingress replica's request router asks this one actor, so they all agree. Engine replicas
push their cache events and load to it in batches, off the request path.

It is a plain (synchronous, single-threaded) actor on purpose: Ray runs the calls of one caller
in the order they were sent only for such actors, and a replica's events, its load reports and a
`configure` must be applied in order. Each method is a few microseconds of CPU work that never
waits on anything, so serial execution costs no concurrency.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import cast

import numpy as np
import numpy.typing as npt
import ray
from ray.actor import ActorHandle

from raydix.cache import CacheEvent

from .lifetime import AppWatch, RouterLifetimeConfig
from .policy import RoutingDecision, RoutingPolicyConfig
from .priority import take_normal_priority
from .state import MAX_APPROX_TOKENS, RouterState

ROUTER_ACTOR_PREFIX = "raydix-router"
ROUTER_NAMESPACE = "raydix"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node 1 of it  # one namespace, so the replicas, proxies and drivers all find it


def router_actor_name(app_name: str) -> str:
    return f"{ROUTER_ACTOR_PREFIX}-{app_name}"


def get_router(app_name: str) -> ActorHandle[RouterActor]:
    """The application's router actor; ValueError if there is none. A blocking GCS lookup."""
    return cast("ActorHandle[RouterActor]",
                ray.get_actor(router_actor_name(app_name), namespace=ROUTER_NAMESPACE))


class RouterActor:
    def __init__(
        self,
        page_size: int,
        policy: RoutingPolicyConfig | None = None,
        exact: bool = True,
        max_approx_tokens: int = MAX_APPROX_TOKENS,
        app_name: str | None = None,
        lifetime: RouterLifetimeConfig | None = None,
    ) -> None:
        """With `app_name` (as a Ray actor only), the actor ends itself once that Serve
        application is gone (lifetime.py)."""
        take_normal_priority("the router actor")  # every request waits on it (priority.py)
        self._settings: tuple[object, ...] = ()
        self._watch: AppWatch | None = None
        self.configure(page_size, policy, exact, max_approx_tokens)
        if app_name is not None:
            self._me = ray.get_runtime_context().current_actor
            self._watch = AppWatch(app_name, lifetime or RouterLifetimeConfig(), end=self._end)

    def _heard(self) -> None:
        if self._watch is not None:
            self._watch.heard()

    def _end(self, last_heard: float) -> None:
        """On the watch thread: end the actor for good (no restart, the name is freed), unless
        a replica reported or the app was configured again since the watch decided."""
        if self._watch is not None and self._watch.last_heard == last_heard:
            ray.kill(self._me, no_restart=True)

    def configure(
        self,
        page_size: int,
        policy: RoutingPolicyConfig | None = None,
        exact: bool = True,
        max_approx_tokens: int = MAX_APPROX_TOKENS,
    ) -> bool:
        """Start over with these settings if they differ (an application deployed again under
        the same name finds the old actor); returns whether the state was reset."""
        self._heard()
        settings = (page_size, policy or RoutingPolicyConfig(), exact, max_approx_tokens)
        if settings == self._settings:
            return False
        self._settings = settings
        self.state = RouterState(page_size, policy, exact, max_approx_tokens)
        return True

    def route(
        self,
        token_ids: npt.NDArray[np.int32],
        extra_key: Hashable,
        candidates: Sequence[str],
        request_id: str | None = None,
    ) -> RoutingDecision:
        return self.state.route(token_ids, extra_key, candidates, request_id)

    def set_replicas(self, replicas: Sequence[str]) -> None:
        self.state.set_replicas(replicas)

    def publish(self, replica: str, events: Sequence[CacheEvent]) -> bool:
        """Apply the events; True asks the replica for its snapshot (`RouterState.publish`)."""
        self._heard()
        return self.state.publish(replica, events)

    def report_load(
        self, replica: str, num_running: int, num_waiting: int, kv_usage: float,
        kv_capacity: int = 0, received: Sequence[str] = (),
    ) -> None:
        self._heard()
        self.state.report_load(replica, num_running, num_waiting, kv_usage, kv_capacity,
                               received)

    def replica_ids(self) -> list[str]:
        """The replicas the router knows, in id order."""
        return sorted(str(r) for r in self.state.replicas)

    def stats(self) -> dict[str, float]:
        """Decision latency, tree size, requests routed and not yet received anywhere, and
        per replica its decisions and hit rate, for /metrics."""
        out = {
            "decision_p50_us": self.state.stats.percentile_us(50),
            "decision_p99_us": self.state.stats.percentile_us(99),
            "tree_tokens": float(self.state.tree.num_tokens),
            "in_transit": float(len(self.state.in_transit)),
        }
        for name, load in self.state.replicas.items():
            out[f"decisions:{name}"] = float(load.decisions)
            if load.prompt_tokens:
                out[f"hit_rate:{name}"] = load.hit_tokens / load.prompt_tokens
        return out


def get_or_create_router(
    app_name: str,
    page_size: int,
    policy: RoutingPolicyConfig | None = None,
    exact: bool = True,
    max_approx_tokens: int = MAX_APPROX_TOKENS,
    lifetime: RouterLifetimeConfig | None = None,
) -> ActorHandle[RouterActor]:
    """The application's router actor, made on first use (detached from its creator), on the
    head node: a worker node's loss must not take the router with it. It ends itself once the
    Serve application `app_name` is gone (`lifetime`, kept from the call that made it). An
    actor left by an earlier deployment of the app with other settings is reset to these."""
    remote = ray.remote(num_cpus=0, max_restarts=-1)(RouterActor)
    actor = cast("ActorHandle[RouterActor]", remote.options(
        name=router_actor_name(app_name),
        namespace=ROUTER_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        scheduling_strategy="DEFAULT",  # never inside the caller's placement group
        resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote(page_size, policy, exact, max_approx_tokens, app_name, lifetime))
    # ordered before this caller's next calls
    actor.configure.remote(page_size, policy, exact, max_approx_tokens)
    return actor
