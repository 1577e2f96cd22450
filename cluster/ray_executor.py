"""The Ray executor: one replica's ranks as Ray actors (its TP worker group), one executor to the engine.

Start-up, in order, all under one `startup_timeout_s` budget:

1. the placement group: one bundle per rank (`placement.py`), created here or taken from the
   caller (Serve makes one bundle for the engine plus one per rank);
2. one `WorkerActor` per bundle; rank 0 reports `tcp://node_ip:free_port`;
3. every rank builds its `TPWorker` at once (the process-group rendezvous waits for all), and the
   followers enter their follow loops.

Any failure or timeout kills the actors, removes a placement group made here, and raises a
RuntimeError that names the rank and carries its error. After start-up, each `step` is one Ray
call to rank 0, which broadcasts the plan to the other ranks over the CPU group.

`check_health` (blocking, for the engine's loop thread) and `check_health_async` (for an event
loop, e.g. Serve's health check) ask every rank at once and name each rank that died, hangs or
whose follow loop failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Sequence
from typing import cast

import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raydix.engine.config import EngineConfig
from raydix.engine.executor import Executor, LocalExecutor, RankLocation, UnhealthyRanksError
from raydix.workers.config import WorkerConfig
from raydix.workers.huge_pages import malloc_env
from raydix.workers.step import GrammarSpec, StepPlan, StepResult

from .placement import check_bundles, create_replica_placement, wait_placed
from .worker_actor import MAX_CONCURRENCY, WorkerActor

HEALTH_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
_REMOTE_WORKER = ray.remote(WorkerActor)


class RayExecutor:
    """One replica's ranks as Ray actors: `step` drives them, `check_health` watches them."""

    def __init__(self, worker_configs: Sequence[WorkerConfig], *,
                 placement_strategy: str = "STRICT_PACK", startup_timeout_s: float = 120.0,
                 placement_group: PlacementGroup | None = None, bundle_offset: int = 0,
                 use_gpu: bool | None = None) -> None:
        """Start one actor per config (config i is rank i) and wait until all are ready.

        `use_gpu`: reserve one GPU per rank (True) or one CPU (False). None: True when the
        configs' device is CUDA. True with device "cpu" runs on fake GPUs
        (`ray.init(num_gpus=N)`), as the tests do.
        `placement_group`: use its bundles `bundle_offset .. bundle_offset + tp - 1` instead of
        making one; it stays in place at `shutdown`.
        """
        self.tp_size = _check_configs(worker_configs)
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        if use_gpu is None:
            use_gpu = worker_configs[0].device.startswith("cuda")
        deadline = time.monotonic() + startup_timeout_s
        self._owns_placement_group = placement_group is None
        self._actors: list[ActorHandle[WorkerActor]] = []
        self._stopped = False
        self._broken: str | None = None  # why steps can't run any more
        self._num_launches = 0  # steps sent to rank 0, which runs them in this order
        if placement_group is None:
            placement_group = create_replica_placement(self.tp_size, use_gpu, placement_strategy,
                                                       startup_timeout_s)
        else:
            check_bundles(placement_group, bundle_offset, self.tp_size, use_gpu)
        self.placement_group = placement_group
        try:
            if not self._owns_placement_group and not wait_placed(
                    placement_group, deadline - time.monotonic()):
                raise RuntimeError(f"the given placement group was not placed within "
                                   f"{startup_timeout_s:g} s")
            env = (malloc_env() if worker_configs[0].device == "cpu"
                   and worker_configs[0].cpu_huge_pages else None)
            self._actors = [_make_actor(placement_group, bundle_offset + r, r, use_gpu, env)
                            for r in range(self.tp_size)]
            self.max_num_tokens = self._start_ranks(worker_configs, deadline, startup_timeout_s)
            self.max_host_tokens = cast(int, ray.get(self._actors[0].max_host_tokens.remote(),
                                                     timeout=max(deadline - time.monotonic(), 1.0)))
            self.node_ids: tuple[str, ...] = tuple(ray.get(
                [a.node_id.remote() for a in self._actors],
                timeout=max(deadline - time.monotonic(), 1.0)))
            self._locations: tuple[RankLocation, ...] = tuple(
                RankLocation(r, node, actor) for r, (node, actor)
                in enumerate(zip(self.node_ids, self._actors, strict=True)))
        except BaseException:
            self._release()
            raise

    @property
    def workers(self) -> tuple[ActorHandle[WorkerActor], ...]:
        """The worker actors in rank order (for health tools and tests)."""
        return tuple(self._actors)

    def _start_ranks(self, configs: Sequence[WorkerConfig], deadline: float,
                     timeout_s: float) -> int:
        """Rendezvous and build every rank's worker; returns the agreed `max_num_tokens`."""
        try:
            address = cast(str, ray.get(self._actors[0].rendezvous_address.remote(),
                                        timeout=max(deadline - time.monotonic(), 0.0)))
        except (GetTimeoutError, RayError) as e:
            raise RuntimeError(f"rank 0 of the replica did not start within {timeout_s:g} s: "
                               f"{e}") from e
        pending = {a.start.remote(c, address): r
                   for r, (a, c) in enumerate(zip(self._actors, configs, strict=True))}
        num_tokens: dict[int, int] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1,
                               timeout=max(deadline - time.monotonic(), 0.0))
            if not done:
                late = sorted(pending.values())
                raise RuntimeError(f"rank(s) {late} of the replica did not start within "
                                   f"{timeout_s:g} s (model load or TP rendezvous at "
                                   f"{address} hung)")
            rank = pending.pop(done[0])
            try:
                num_tokens[rank] = ray.get(done[0])
            except RayError as e:
                raise RuntimeError(f"rank {rank} of the replica failed to start: "
                                   f"{_error_text(e)}") from e
        if len(set(num_tokens.values())) != 1:
            raise RuntimeError(f"the ranks disagree on the KV pool size: {num_tokens}")
        return num_tokens[0]

    def ranks(self) -> tuple[RankLocation, ...]:
        return self._locations

    def step(self, plan: StepPlan) -> StepResult:
        """Run one step on every rank: one Ray call to rank 0, which broadcasts the plan.

        A plan that fails validation raises its ValueError and leaves the group usable. A step
        that fails because a rank is gone raises a RuntimeError naming the rank, and every later
        step fails at once (rather than wait on the missing rank).
        """
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> _LaunchedStep:
        """Send the step to rank 0 and return at once; rank 0's actor runs steps in the order
        they are sent (one step lock)."""
        if self._stopped:
            raise RuntimeError("the TP group is shut down")
        if self._broken is not None:
            raise RuntimeError(f"the TP group is broken: {self._broken}")
        launch, self._num_launches = self._num_launches, self._num_launches + 1
        return _LaunchedStep(self, plan.step_id, self._actors[0].step.remote(plan, launch))

    def _wait(self, step_id: int, ref: ray.ObjectRef[StepResult]) -> StepResult:
        try:
            return ray.get(ref)
        except RayActorError as e:
            self._broken = f"rank 0 died during step {step_id} ({type(e).__name__})"
            raise RuntimeError(self._broken) from e  # Ray's long text stays in the cause
        except RayError as e:
            try:
                self.check_health()
            except RuntimeError as unhealthy:
                self._broken = f"step {step_id} failed: {unhealthy}"
                raise RuntimeError(self._broken) from e
            raise

    def prepare_grammar(self, spec: GrammarSpec) -> None:
        """Ask rank 0 to start compiling `spec` (no wait: the step that needs it waits)."""
        if not self._stopped and self._broken is None:
            self._actors[0].prepare_grammar.remote(spec)

    def prefault_kv(self, in_use: int) -> bool:
        return False  # the ranks' pools fault their pages in on first use

    def check_health(self) -> None:
        """Raise a RuntimeError naming every rank whose actor died, hangs or failed. Blocks up
        to `HEALTH_TIMEOUT_S`."""
        answers = self._ask_health()
        concurrent.futures.wait(answers, timeout=HEALTH_TIMEOUT_S)
        self._raise_if_unhealthy(answers)

    async def check_health_async(self) -> None:
        """`check_health` for an event loop: waits without blocking it."""
        answers = self._ask_health()
        await asyncio.wait([asyncio.wrap_future(f) for f in answers], timeout=HEALTH_TIMEOUT_S)
        self._raise_if_unhealthy(answers)

    def _ask_health(self) -> list[concurrent.futures.Future[str | None]]:
        if self._stopped:
            raise RuntimeError("the TP group is shut down")
        return [a.health.remote().future() for a in self._actors]

    def _raise_if_unhealthy(self, answers: list[concurrent.futures.Future[str | None]]) -> None:
        problems = []
        permanent = False
        for rank, answer in enumerate(answers):
            error = answer.exception() if answer.done() else None
            if not answer.done():
                answer.cancel()
                reason: str | None = f"no answer within {HEALTH_TIMEOUT_S:g} s"
            elif isinstance(error, ActorUnavailableError):
                reason = f"its actor is unreachable ({type(error).__name__})"
            elif isinstance(error, RayActorError):
                reason = f"its actor died ({type(error).__name__})"
                permanent = True
            elif error is not None:
                reason = f"health check failed: {error}"
            else:
                reason = answer.result()  # the rank's own report: its follow loop failed
                permanent = permanent or reason is not None
            if reason is not None:
                problems.append((rank, reason))
        if problems:
            dead = [r for r, _ in problems]
            details = "; ".join(f"rank {r}: {why}" for r, why in problems)
            raise UnhealthyRanksError(
                f"unhealthy rank(s) {dead} of {self.tp_size}: {details}", permanent)

    def shutdown(self) -> None:
        """Release the followers, kill the actors, and remove a placement group made here.
        Safe to call twice, and after a rank died."""
        if self._stopped:
            return
        if self.tp_size > 1 and self._actors:
            ref: ObjectRef[None] = self._actors[0].stop_followers.remote()
            # a dead rank can't be released gently; killing it below is enough
            with contextlib.suppress(GetTimeoutError, RayError):
                ray.get(ref, timeout=STOP_TIMEOUT_S)
        self._release()

    def _release(self) -> None:
        self._stopped = True
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._owns_placement_group:
            remove_placement_group(self.placement_group)


def make_executor(
    config: EngineConfig, startup_timeout_s: float = 120.0, use_gpu: bool | None = None
) -> Executor:
    """In-process for one rank; a Ray executor (one actor per rank) for more.

    ``use_gpu``: each rank takes one (possibly fake) GPU; None decides from the device.
    """
    if config.worker.tp_size == 1:
        return LocalExecutor(config)
    configs = [config.rank_config(r) for r in range(config.worker.tp_size)]
    return RayExecutor(configs, startup_timeout_s=startup_timeout_s, use_gpu=use_gpu)


def _make_actor(pg: PlacementGroup, bundle_idx: int, tp_rank: int, use_gpu: bool,
                env: dict[str, str] | None = None) -> ActorHandle[WorkerActor]:
    """One rank's actor in its bundle, its process started with `env` added to its environment.
    On GPUs it takes no CPU, so fake GPUs fit on small hosts."""
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                placement_group_bundle_index=bundle_idx)
    options: dict[str, object] = ({"num_gpus": 1, "num_cpus": 0} if use_gpu else {"num_cpus": 1})
    if env:  # a CPU rank's malloc on 2 MiB pages (workers/huge_pages.py)
        options["runtime_env"] = {"env_vars": env}
    actor = _REMOTE_WORKER.options(scheduling_strategy=strategy, max_concurrency=MAX_CONCURRENCY,
                                   **options).remote(tp_rank)
    return cast("ActorHandle[WorkerActor]", actor)


def _error_text(e: RayError) -> str:
    """The actor's own exception (`RayTaskError.cause`) as one line, or Ray's error text."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return str(e)


def _check_configs(configs: Sequence[WorkerConfig]) -> int:
    """The replica's tp_size, after checking that config i is rank i of one TP group."""
    if not configs:
        raise ValueError("a replica needs at least one worker config")
    tp_size = configs[0].tp_size
    if len(configs) != tp_size:
        raise ValueError(f"{len(configs)} worker configs for tp_size={tp_size}")
    for i, c in enumerate(configs):
        if (c.tp_rank, c.tp_size) != (i, tp_size):
            raise ValueError(f"config {i} is rank {c.tp_rank} of {c.tp_size}; expected rank {i} "
                             f"of {tp_size}")
        if (c.model_path, c.device) != (configs[0].model_path, configs[0].device):
            raise ValueError(f"rank {i} has model {c.model_path!r} on {c.device!r}, rank 0 has "
                             f"{configs[0].model_path!r} on {configs[0].device!r}")
    return tp_size


class _LaunchedStep:
    """A step sent to rank 0; `result` waits for its answer."""

    def __init__(self, group: RayExecutor, step_id: int, ref: ray.ObjectRef[StepResult]) -> None:
        self._group, self._step_id, self._ref = group, step_id, ref

    def result(self) -> StepResult:
        return self._group._wait(self._step_id, self._ref)
