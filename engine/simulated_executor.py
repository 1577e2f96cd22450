"""A replica whose device is simulated: the real scheduler and radix cache, steps that only take
time (for router benchmarks).

Routing is decided by what each replica's cache holds, how long its queue is and how a step's
time grows with its batch. On one CPU, replicas that share cores are none of that: they slow
each other, so piling requests on one replica costs nothing there, while on a cluster each
replica has a GPU of its own. `SimulatedExecutor` keeps everything of a replica but the model:
the engine schedules, admits, caches and evicts as it would, and publishes its cache events;
each step takes `StepCost.seconds(plan)`, sleeping (so it uses no CPU), and every row samples the
same token. The simulated device runs one step at a time: a step launched while another runs
starts when it ends, as on a GPU's stream. (Dynamo's "mocker" engine and llm-d's
inference-sim serve routers the same way.)

The tokens mean nothing: a request that asks for logprobs or a grammar is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from raydix.workers.step import GrammarSpec, StepPlan, StepResult

from .executor import RankLocation


@dataclass(frozen=True)
class StepCost:
    """A step's time: a fixed part (the weights read once a step), a part per new token (prompt
    tokens and decode rows alike: the linear layers) and a part per context token attended (K/V
    read), all times `scale`.

    The defaults are estimates for an 8B Llama in bf16 on one H100: a decode step about 7 ms
    (16 GB of weights at 3.35 TB/s, 5 ms, and the rest of the step), 60 us a new token (16 GFLOP
    at about 270 TFLOP/s achieved), 0.04 us a context token (128 KiB of K/V at 3.35 TB/s).
    `scale` slows the device evenly (the ratios between the parts stay), so that a small host
    keeps up with the token stream."""

    base_s: float = 7e-3
    token_s: float = 6e-5
    kv_token_s: float = 4e-8
    scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("base_s", "token_s", "kv_token_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepCost.{name} must be >= 0, got {getattr(self, name)}")
        if self.scale <= 0:
            raise ValueError(f"StepCost.scale must be > 0, got {self.scale}")

    def seconds(self, plan: StepPlan) -> float:
        num_new = int(plan.extend_lens.sum())
        num_attended = num_new + int(plan.prefix_lens.sum())
        return self.scale * (self.base_s + self.token_s * num_new
                             + self.kv_token_s * num_attended)


class SimulatedExecutor:
    """One simulated rank (see the module's docstring): `max_num_tokens` KV slots, steps timed
    by `cost`, `token_id` sampled by every row."""

    def __init__(self, max_num_tokens: int, cost: StepCost, token_id: int,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        self._max_num_tokens = max_num_tokens
        self.cost = cost
        self.token_id = token_id
        self._clock, self._sleep = clock, sleep
        self._free_at = 0.0  # when the simulated device ends the last launched step
        self._stops: dict[int, tuple[int, ...]] = {}  # row -> its stop token ids
        self.num_steps = 0
        self.busy_s = 0.0  # simulated device time of every step launched

    @property
    def max_num_tokens(self) -> int:
        return self._max_num_tokens

    @property
    def max_host_tokens(self) -> int:
        return 0

    def step(self, plan: StepPlan) -> StepResult:
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> _SimulatedStep:
        for row in plan.freed_rows:
            self._stops.pop(row, None)
        for new in plan.new_sampling:
            if new.sampling.return_logprob or new.sampling.top_logprobs:
                raise ValueError("the simulated executor samples no distribution: logprobs "
                                 "can't be asked of it")
            self._stops[new.row_idx] = new.sampling.stop_token_ids
        if plan.grammar_starts:
            raise ValueError("the simulated executor has no grammars")
        seconds = self.cost.seconds(plan)
        self._free_at = max(self._clock(), self._free_at) + seconds
        self.num_steps += 1
        self.busy_s += seconds
        batch = plan.batch_size
        stopped = np.array([self.token_id in self._stops.get(int(r), ()) for r in plan.row_idx],
                           dtype=bool)
        result = StepResult(plan.step_id, np.full(batch, self.token_id, dtype=np.int64), None,
                            stopped)
        return _SimulatedStep(result, self._free_at, self._clock, self._sleep)

    def ranks(self) -> tuple[RankLocation, ...]:
        return (RankLocation(0, None, None),)

    def check_health(self) -> None:
        return None

    async def check_health_async(self) -> None:
        return None

    def prepare_grammar(self, spec: GrammarSpec) -> None:
        raise ValueError("the simulated executor has no grammars")

    def prefault_kv(self, in_use: int) -> bool:
        return False  # no pool

    def shutdown(self) -> None:
        return None


class _SimulatedStep:
    """A launched simulated step: `result` waits until the simulated device has run it."""

    def __init__(self, result: StepResult, done_at: float, clock: Callable[[], float],
                 sleep: Callable[[float], None]) -> None:
        self._result, self._done_at = result, done_at
        self._clock, self._sleep = clock, sleep

    def result(self) -> StepResult:
        left = self._done_at - self._clock()
        if left > 0:
            self._sleep(left)
        return self._result
