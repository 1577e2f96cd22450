"""One rank of a replica: joins the TP group, runs plans in SPMD with the other ranks.

Rank 0 drives: `launch(plan)` broadcasts the plan over the CPU group, queues it, and returns its
pending `StepResult` (`step(plan)` also waits for it). Every other rank sits in `follow()`,
running each broadcast plan until a shutdown plan arrives. The engine calls only rank 0 per
step, so there is no per-rank round trip.
"""

from __future__ import annotations

import numpy as np

from .broadcast import broadcast_plan
from .config import WorkerConfig
from .device import bind_device
from .parallel import TPGroup, init_tp_group
from .pending_step import PendingStep
from .runner import ModelRunner
from .step import GrammarSpec, StepPlan, StepResult, resolve_pending


class TPWorker:
    def __init__(self, config: WorkerConfig, rendezvous: str | None = None,
                 group: TPGroup | None = None) -> None:
        """Join the group at `rendezvous` (e.g. "tcp://10.0.0.1:29500"), or use `group`."""
        bind_device(config.device)  # NCCL and every kernel launch bind to this device
        if group is None:
            if config.tp_size > 1 and rendezvous is None:
                raise ValueError("tp_size > 1 needs a rendezvous address or a group")
            group = init_tp_group(rendezvous or "", config.tp_rank, config.tp_size,
                                  config.device)
        self.group = group
        self.runner = ModelRunner(config, group)
        self._last_step_id = -1  # driving rank: the last step launched, and its result
        self._last: PendingStep | None = None

    @property
    def max_num_tokens(self) -> int:
        return self.runner.max_num_tokens

    @property
    def max_host_tokens(self) -> int:
        return self.runner.max_host_tokens

    @property
    def cpu_threads(self) -> int:
        """torch's threads in this process (the rank's CPU work)."""
        import torch

        return torch.get_num_threads()

    def step(self, plan: StepPlan) -> StepResult:
        """Driving rank only: share `plan` with the followers, run it and wait for it."""
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> PendingStep:
        """Driving rank only: share `plan` with the followers and queue it; the result comes
        through the returned `PendingStep`. Launched steps run in launch order."""
        if self.group.tp_rank != 0:
            raise RuntimeError("only rank 0 drives steps; other ranks call follow()")
        if not self.runner.takes_pending_on_device(plan):
            # the host needs the step before done (its tokens, its grammars' state): wait for
            # it, and put its tokens in the placeholders
            last = np.zeros(0, np.int64)
            if self._last is not None:
                last = self._last.result().next_token_ids
            plan = resolve_pending(plan, self._last_step_id, last)
        self.runner.check_plan(plan)  # before the broadcast: followers only get valid plans
        pending = self.runner.launch(broadcast_plan(plan, self.group), checked=True)
        if pending is None:
            raise RuntimeError("rank 0 produced no step result")
        self._last_step_id, self._last = plan.step_id, pending
        return pending

    def prepare_grammar(self, spec: GrammarSpec) -> None:
        """Driving rank only: start compiling `spec` in the background (grammar/compiler.py)."""
        self.runner.grammars.compiler.prefetch(spec)

    def follow(self) -> int:
        """Non-driving ranks: run broadcast plans until shutdown; returns the steps run."""
        if self.group.tp_rank == 0:
            raise RuntimeError("rank 0 drives; it does not follow")
        num_steps = 0
        while True:
            plan = broadcast_plan(None, self.group)
            if plan.shutdown:
                return num_steps
            self.runner.step(plan, checked=True)  # the driving rank checked it
            num_steps += 1

    def stop_followers(self) -> None:
        """Driving rank: release the followers from `follow()`."""
        if self.group.tp_size > 1:
            broadcast_plan(StepPlan.shutdown_plan(), self.group)
