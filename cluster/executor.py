"""Runs step plans on a replica's ranks. The engine sees only this interface."""

from __future__ import annotations

from typing import Protocol

from raydix.workers.step import StepPlan, StepResult

from .config import EngineConfig


class Executor(Protocol):
    @property
    def max_num_tokens(self) -> int:
        """Usable KV slots on every rank (the pool is sized from the smallest rank)."""
        ...

    def step(self, plan: StepPlan) -> StepResult: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One rank in this process (tp_size 1): no Ray, no process group."""

    def __init__(self, config: EngineConfig) -> None:
        if config.worker.tp_size != 1:
            raise ValueError(
                f"LocalExecutor runs tp_size 1 only, got {config.worker.tp_size}; "
                "use the Ray TP group for more ranks"
            )
        from raydix.workers.worker import TPWorker  # the model stack loads with the rank only

        self.worker = TPWorker(config.rank_config(0))

    @property
    def max_num_tokens(self) -> int:
        return self.worker.max_num_tokens

    def step(self, plan: StepPlan) -> StepResult:
        return self.worker.step(plan)

    def shutdown(self) -> None:
        return None


def make_executor(
    config: EngineConfig, startup_timeout_s: float = 120.0, use_gpu: bool | None = None
) -> Executor:
    """In-process for one rank; a Ray TP group (one actor per rank) for more.

    ``use_gpu``: each rank takes one (possibly fake) GPU; None decides from the device.
    """
    if config.worker.tp_size == 1:
        return LocalExecutor(config)
    from .tp_group import RayTPGroup

    configs = [config.rank_config(r) for r in range(config.worker.tp_size)]
    return RayTPGroup(configs, startup_timeout_s=startup_timeout_s, use_gpu=use_gpu)
