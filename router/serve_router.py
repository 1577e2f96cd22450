"""Cache-aware routing inside Ray Serve's request-router interface.

Set on the engine deployment with ``RequestRouterConfig(request_router_class=...)``. For each
request it asks the application's router actor which replica holds the longest prefix of the
prompt's token ids (the first argument of ``EngineServer.generate``). If the actor does not
answer within ``decision_timeout_s`` (or is gone), the least loaded of two random replicas gets
the request, so routing never waits on the router. The chosen replica is offered first (and
again, `HOLDER_TRIES` times in all, if it misses Serve's queue-length deadline), then the others,
so a full replica never holds a request back. Serve keeps health checks, retries and autoscaling.
The replica chosen for a request goes to that request (`request_matching.py`).

A deployment of one replica that can't grow (`sole_replica`: no autoscaling) has no choice to
make and no router actor (`deploy/app.py`): its requests go to that replica without a round
trip (3-4 ms of a lone request's time to first token on 2 cores), and the replica set is not
sent anywhere. Were a second replica up (a rolling update), the missing actor sends its requests
by load.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import numpy as np
import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from .actor import RouterActor, get_router
from .policy import RoutingDecision
from .request_matching import OwnRequestRouter

logger = logging.getLogger(__name__)

LOOKUP_RETRY_S = 1.0
# Serve asks a replica for its queue length (0.1 s deadline, doubling on each try) when it has
# none cached, as after start-up or an idle spell. The chosen replica gets this many tries before
# the others are considered: on a busy host one missed deadline must not split a group.
HOLDER_TRIES = 3


class CacheAwareRequestRouter(OwnRequestRouter):
    def initialize_state(  # type: ignore[override]
        self, app_name: str | None = None, decision_timeout_s: float = 0.05,
        sole_replica: bool = False,
    ) -> None:
        """`app_name` names the router actor; default: the deployment's application.
        `sole_replica`: the deployment is one replica that can't grow (no router actor)."""
        self._app_name = app_name
        self._decision_timeout_s = decision_timeout_s
        self._sole_replica = sole_replica
        self.num_sole = 0  # requests sent to the one replica without a decision
        self._actor: ActorHandle[RouterActor] | None = None
        self._lookup_failed_at = -LOOKUP_RETRY_S
        self.num_fallbacks = 0

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._sync_replicas()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sync_replicas()

    def _sync_replicas(self) -> None:
        """Tell the router actor the live replicas, without waiting (it may not exist yet:
        the first replica creates it, and `route` registers the candidates it is given)."""
        if self._sole_replica:
            return  # no router actor to tell
        names = sorted(r.unique_id for r in self.curr_replicas)
        try:
            self._router_actor().set_replicas.remote(names)
        except (ValueError, ray.exceptions.RayError) as exc:
            logger.debug("router actor not reachable for the replica set (%s)", exc)
            self._actor = None

    def _router_actor(self) -> ActorHandle[RouterActor]:
        """The router actor's handle. Looking it up is a blocking GCS call: after a failed
        lookup the next is tried only `LOOKUP_RETRY_S` later (routing by load meanwhile)."""
        if self._actor is None:
            if time.monotonic() - self._lookup_failed_at < LOOKUP_RETRY_S:
                raise ValueError("the router actor was not found a moment ago")
            try:
                self._actor = get_router(self._app_name or self.app_name)
            except ValueError:
                self._lookup_failed_at = time.monotonic()
                raise
        return self._actor

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if self._sole_replica and len(candidate_replicas) == 1:
            self.num_sole += 1
            return [candidate_replicas]
        prompt = _prompt_ids(pending_request)
        if prompt is not None:
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            chosen = await self._ask_router(prompt, _extra_key(pending_request), list(by_id),
                                            _request_id(pending_request))
            if chosen is not None and chosen in by_id:
                first = by_id[chosen]
                others = [r for r in candidate_replicas if r is not first]
                return [[first]] * HOLDER_TRIES + [others]
        self.num_fallbacks += 1
        return [self._power_of_two(candidate_replicas)]

    async def _ask_router(
        self, prompt: np.ndarray, extra_key: object, candidates: list[str],
        request_id: str | None = None,
    ) -> str | None:
        try:
            ref: ObjectRef[RoutingDecision] = self._router_actor().route.remote(
                prompt, extra_key, candidates, request_id)
            decision = await asyncio.wait_for(ref, self._decision_timeout_s)
        except (asyncio.TimeoutError, ValueError, ray.exceptions.RayError) as exc:
            logger.debug("router actor unavailable (%s); routing by load", exc)
            self._actor = (
                None if isinstance(exc, (ValueError, ray.exceptions.RayActorError)) else self._actor
            )
            return None
        return str(decision.replica)

    def _power_of_two(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        pair = random.sample(replicas, min(2, len(replicas)))
        cache = self.replica_queue_len_cache
        return sorted(pair, key=lambda r: cache.get(r.replica_id) or 0)


class RoundRobinRequestRouter(FIFOMixin, RequestRouter):
    """Each request goes to the next replica in replica-id order; a full one passes its turn."""

    def initialize_state(self) -> None:  # type: ignore[override]
        self._turn = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        start = self._turn % len(ordered)
        self._turn += 1
        rotated = ordered[start:] + ordered[:start]
        return [[r] for r in rotated]


def _prompt_ids(pending: PendingRequest | None) -> np.ndarray | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    if isinstance(first, (list, tuple, np.ndarray)) and len(first):
        return np.asarray(first, dtype=np.int32)
    return None


def _request_id(pending: PendingRequest | None) -> str | None:
    """The engine request's id (`EngineServer.generate`'s third argument), which the replica
    that receives it reports back to the router."""
    if pending is None or len(pending.args) < 3 or not isinstance(pending.args[2], str):
        return None
    return pending.args[2]


def _extra_key(pending: PendingRequest | None) -> object:
    if pending is None or len(pending.args) < 2:
        return None
    return getattr(pending.args[1], "extra_key", None)
