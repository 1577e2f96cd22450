"""One rank of a replica inside a Ray actor.

The actor is threaded (`RayExecutor` starts it with `max_concurrency=MAX_CONCURRENCY`), so that
health calls still answer while a long call runs:

- rank 0 answers `step` calls from the engine (launched one at a time, in launch order);
- every other rank runs `TPWorker.follow()` in the background, started by `start`, and takes
  each step plan from rank 0's broadcast over the CPU (gloo) group. Ray sees no call per step on
  these ranks.

Ray answers each call on one of its pool threads, but the rank's torch work runs on one thread
of its own (`workers/torch_thread.py`: torch's OpenMP runtime slows every step once two threads
have run its kernels): the `TPWorker` is built there, rank 0's launches run there in launch
order, and a follower's loop runs there. `health` and the other calls answer on Ray's threads.

A step plan that fails validation is refused by rank 0 before its broadcast, so followers only
run valid plans. Any error in a follower's loop is therefore fatal to the replica: rank 0 would
wait in the step's next collective forever. The follower logs the error and ends its own process
(`exit_process`), so rank 0's collective fails, the engine's step raises, and the replica
leaves (Serve starts a new one); a health check in between sees the actor gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from raydix.cluster.actor_heap import freeze_actor_heap
from raydix.workers.config import WorkerConfig
from raydix.workers.step import GrammarSpec, StepPlan, StepResult
from raydix.workers.torch_thread import TorchThread

if TYPE_CHECKING:
    from raydix.workers.worker import TPWorker

MAX_CONCURRENCY = 4  # start or step, health, plus headroom for shutdown

logger = logging.getLogger(__name__)


def exit_process() -> None:
    """End this worker process at once (from any thread); Ray reports the actor dead."""
    logging.shutdown()
    os._exit(1)


def free_port() -> int:
    """A TCP port that is free on this node right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class WorkerActor:
    """Holds one rank's `TPWorker`; `RayExecutor` starts it as a Ray actor in the rank's bundle."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self._worker: TPWorker | None = None
        self._torch = TorchThread(f"raydix-rank{tp_rank}")  # the rank's torch work, in order
        self._step_lock = threading.Condition()  # steps reach the rank's thread in launch order
        self._next_launch = 0
        self._follow_error: str | None = None

    def node_id(self) -> str:
        """The Ray node this rank runs on (hex), for placement checks and health tools."""
        return str(ray.get_runtime_context().get_node_id())

    def rendezvous_address(self) -> str:
        """`tcp://node_ip:port` for the group's rendezvous; asked of rank 0 only."""
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, config: WorkerConfig, rendezvous: str) -> int:
        """Join the TP group and load this rank's shard; returns the rank's `max_num_tokens`.

        Blocks until every rank has joined (the process-group rendezvous). A follower then
        starts its follow loop in the background.
        """
        if config.tp_rank != self.tp_rank:
            raise ValueError(f"actor of rank {self.tp_rank} got the config of rank "
                             f"{config.tp_rank}")
        if self._worker is not None:
            raise RuntimeError(f"rank {self.tp_rank} is already started")
        if config.device.startswith("cuda"):
            # Ray shows the actor only its own GPU, which is always cuda:0 here
            config = dataclasses.replace(config, device="cuda")
        from raydix.workers.worker import TPWorker  # the model stack loads in the actor only

        self._worker = self._torch.call(TPWorker, config, rendezvous=rendezvous)
        freeze_actor_heap(f"rank {self.tp_rank}")
        if self.tp_rank != 0:
            self._torch.submit(self._follow)  # holds the rank's thread until the shutdown plan
        return self._worker.max_num_tokens

    def max_host_tokens(self) -> int:
        """Usable host KV slots of this rank (the ranks agree on it when they start)."""
        return self._started().max_host_tokens

    def _follow(self, on_error: Callable[[], None] = exit_process) -> None:
        """Follow until the shutdown plan. Any error ends the loop, is logged and kept for
        `health`, and then `on_error` ends the process (see the module docstring)."""
        try:
            self._started().follow()
        except BaseException:
            self._follow_error = traceback.format_exc()
            logger.error("rank %d: its follow loop failed; the process ends:\n%s",
                         self.tp_rank, self._follow_error)
            on_error()

    def step(self, plan: StepPlan, launch: int | None = None) -> StepResult:
        """Rank 0: broadcast `plan` to the followers and run it. `launch` numbers the steps
        as the engine sent them: this threaded actor may start calls in any order, and a step
        runs only after every earlier one (the overlapped loop sends the next step early)."""
        with self._step_lock:
            if launch is not None:
                self._step_lock.wait_for(lambda: self._next_launch == launch)
            try:
                launched = self._torch.submit(self._started().launch, plan)
            finally:
                if launch is not None:
                    self._next_launch = launch + 1
                    self._step_lock.notify_all()
        # the rank's thread runs the launches in the order queued; the next one may go on
        # there while this call waits for its tokens
        return launched.result().result()

    def prepare_grammar(self, spec: GrammarSpec) -> None:
        """Rank 0: start compiling `spec` in the background; returns at once."""
        self._started().prepare_grammar(spec)

    def stop_followers(self) -> None:
        """Rank 0: send the shutdown plan that ends every follower's loop."""
        with self._step_lock:  # after every launch queued so far
            self._torch.call(self._started().stop_followers)

    def health(self) -> str | None:
        """None when this rank is fine; otherwise why not (e.g. its follow loop failed)."""
        if self._follow_error is not None:
            return f"its follow loop failed:\n{self._follow_error}"
        return None

    def _started(self) -> TPWorker:
        if self._worker is None:
            raise RuntimeError(f"rank {self.tp_rank} is not started")
        return self._worker
