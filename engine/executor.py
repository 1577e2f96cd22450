"""Runs step plans on a replica's ranks. The engine sees only this interface.

An executor steps the ranks, says where each rank runs (`ranks`), and checks that every rank is
still there (`check_health`, `check_health_async`): the Serve layer asks the engine, never the
executor's own type.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from raydix.workers.step import GrammarSpec, StepPlan, StepResult

from .config import EngineConfig

if TYPE_CHECKING:  # the core loads without torch: the rank's module comes with the rank
    from raydix.workers.pending_step import PendingStep

logger = logging.getLogger(__name__)

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

    def prefault_kv(self, in_use: int) -> bool:
        """Between steps, with no step in flight: populate the next chunk of a CPU KV pool's
        pages ahead of their first use (no slot from `in_use` up was handed out yet); False
        when there is nothing to do (workers/kv_prefault.py)."""
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
        from raydix.workers.torch_thread import TorchThread
        from raydix.workers.worker import TPWorker  # the model stack loads with the rank only

        # One thread does the rank's torch work, so that its OpenMP team is the process's only
        # one (workers/torch_thread.py: a second one slowed the step by about a third). The
        # overlapped loop's rank has a thread of its own, which builds it and runs every step;
        # torch releases the GIL in its kernels, so the engine forms the next step meanwhile.
        # The synchronous loop's rank is the engine's thread, which builds it and must step it
        # (AsyncEngine's loop thread does both): handing each step to another thread and back
        # cost 0.11 ms here, 3% of a tiny model's step (README, the overlapped step loop).
        self._rank = TorchThread("raydix-rank0") if config.scheduler.overlap_schedule else None
        self._builder = threading.get_ident()
        self._warned = False
        try:
            rank_config = config.rank_config(0)
            self.worker = (TPWorker(rank_config) if self._rank is None
                           else self._rank.call(TPWorker, rank_config))
        except BaseException:
            self.shutdown()
            raise

    @property
    def max_num_tokens(self) -> int:
        return self.worker.max_num_tokens

    @property
    def max_host_tokens(self) -> int:
        return self.worker.max_host_tokens

    def step(self, plan: StepPlan) -> StepResult:
        if self._rank is not None:
            return self._rank.call(self.worker.step, plan)
        self._check_thread()
        return self.worker.step(plan)

    def launch(self, plan: StepPlan) -> StepHandle:
        if self._rank is not None:
            # the rank's thread queues the step (on CUDA without waiting for the device) and is
            # free for the next one; `result` waits for this step's tokens
            return _LaunchedStep(self._rank.submit(self.worker.launch, plan))
        self._check_thread()  # the synchronous loop launches nothing; here the step runs now
        launched: concurrent.futures.Future[PendingStep] = concurrent.futures.Future()
        try:
            launched.set_result(self.worker.launch(plan))
        except Exception as e:
            launched.set_exception(e)
        return _LaunchedStep(launched)

    def ranks(self) -> tuple[RankLocation, ...]:
        return (RankLocation(0, None, None),)

    def check_health(self) -> None:
        return None

    async def check_health_async(self) -> None:
        return None

    def prepare_grammar(self, spec: GrammarSpec) -> None:
        self.worker.prepare_grammar(spec)

    def prefault_kv(self, in_use: int) -> bool:
        # on this thread: madvise, no torch op (so no second OpenMP team), and no step runs
        return self.worker.runner.prefault_kv(in_use)

    def shutdown(self) -> None:
        if self._rank is not None:
            self._rank.shutdown(wait=True)

    def _check_thread(self) -> None:
        if threading.get_ident() != self._builder and not self._warned:
            self._warned = True
            logger.warning("the rank is stepped on another thread than the one that built it: "
                           "two OpenMP teams slow its steps (workers/torch_thread.py)")


class _LaunchedStep:
    """A step the rank's thread launched: `result` waits for the launch, then for the step."""

    def __init__(self, launched: concurrent.futures.Future[PendingStep]) -> None:
        self._launched = launched

    def result(self) -> StepResult:
        return self._launched.result().result()
