"""Runs step plans on a replica's ranks. The engine sees only this interface.

An executor steps the ranks, says where each rank runs (`ranks`), and checks that every rank is
still there (`check_health`, `check_health_async`): the Serve layer asks the engine, never the
executor's own type.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from raydix.workers.step import GrammarSpec, StepPlan, StepResult

from .config import EngineConfig

if TYPE_CHECKING:  # the core loads without torch: the rank's module comes with the rank
    from raydix.workers.pending_step import PendingStep


class RankLocation(NamedTuple):
    """Where one rank of a replica runs."""

    tp_rank: int
    node_id: str | None  # its Ray node; None: inside the engine's own process
    # its worker actor's handle (a Ray executor's `ActorHandle[WorkerActor]`, the core does not
    # import Ray); None: inside the engine's own process
    worker: Any


class UnhealthyRanksError(RuntimeError):
    """Some ranks failed their health check. `permanent`: one of them died or its follow loop
    ended, so the group can't step again (rather than a rank that is slow or unreachable)."""

    def __init__(self, message: str, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


class StepHandle(Protocol):
    """A launched step; `result` waits for it (and raises what the step raised)."""

    def result(self) -> StepResult: ...


class Executor(Protocol):
    @property
    def max_num_tokens(self) -> int:
        """Usable KV slots on every rank (the pool is sized from the smallest rank)."""
        ...

    @property
    def max_host_tokens(self) -> int:
        """Usable host KV slots on every rank (0 without a host tier)."""
        ...

    def step(self, plan: StepPlan) -> StepResult: ...

    def launch(self, plan: StepPlan) -> StepHandle:
        """Start a step and return at once (the overlapped loop forms the next step meanwhile).
        Launched steps run one at a time, in launch order."""
        ...

    def ranks(self) -> tuple[RankLocation, ...]:
        """Every rank, in rank order."""
        ...

    def check_health(self) -> None:
        """Raise `UnhealthyRanksError` naming every rank that died, hangs or failed (blocks)."""
        ...

    async def check_health_async(self) -> None:
        """`check_health` for an event loop: waits without blocking it."""
        ...

    def prepare_grammar(self, spec: GrammarSpec) -> None:
        """Start compiling `spec` on the driving rank, off the step (returns at once)."""
        ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One rank in this process (tp_size 1): no Ray, no process group. A failure of that rank
    raises from `step` itself, so there is nothing else to watch."""

    def __init__(self, config: EngineConfig) -> None:
        if config.worker.tp_size != 1:
            raise ValueError(
                f"LocalExecutor runs tp_size 1 only, got {config.worker.tp_size}; "
                "use the Ray executor for more ranks"
            )
        from raydix.workers.worker import TPWorker  # the model stack loads with the rank only

        self.worker = TPWorker(config.rank_config(0))
        # the rank's own thread for launched steps; torch releases the GIL in its kernels, so
        # the engine forms the next step while this one computes
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raydix-rank0")

    @property
    def max_num_tokens(self) -> int:
        return self.worker.max_num_tokens

    @property
    def max_host_tokens(self) -> int:
        return self.worker.max_host_tokens

    def step(self, plan: StepPlan) -> StepResult:
        return self.worker.step(plan)

    def launch(self, plan: StepPlan) -> StepHandle:
        # the rank's thread queues the step (on CUDA without waiting for the device) and is
        # free for the next one; `result` waits for this step's tokens
        return _LaunchedStep(self._thread.submit(self.worker.launch, plan))

    def ranks(self) -> tuple[RankLocation, ...]:
        return (RankLocation(0, None, None),)

    def check_health(self) -> None:
        return None

    async def check_health_async(self) -> None:
        return None

    def prepare_grammar(self, spec: GrammarSpec) -> None:
        self.worker.prepare_grammar(spec)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)


class _LaunchedStep:
    """A step the rank's thread launched: `result` waits for the launch, then for the step."""

    def __init__(self, launched: concurrent.futures.Future[PendingStep]) -> None:
        self._launched = launched

    def result(self) -> StepResult:
        return self._launched.result().result()
