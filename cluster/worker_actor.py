"""One rank of a replica inside a Ray actor.

The actor is threaded (`RayTPGroup` starts it with `max_concurrency=MAX_CONCURRENCY`), so that
health calls still answer while a long call runs:

- rank 0 answers `step` calls from the engine (one at a time, under a lock);
- every other rank runs `TPWorker.follow()` in a background thread, started by `start`, and takes
  each step plan from rank 0's broadcast over the CPU (gloo) group. Ray sees no call per step on
  these ranks.

`health` reports a follower loop that ended with an error, which Ray alone would not notice.
A step plan that fails validation fails on every rank alike; the followers then keep following,
as rank 0 keeps serving (see `_follow`).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import traceback
from typing import TYPE_CHECKING

import ray

from raydix.workers.config import WorkerConfig
from raydix.workers.step import StepPlan, StepResult

if TYPE_CHECKING:
    from raydix.workers.worker import TPWorker

MAX_CONCURRENCY = 4  # start or step, health, plus headroom for shutdown


def free_port() -> int:
    """A TCP port that is free on this node right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class WorkerActor:
    """Holds one rank's `TPWorker`; `RayTPGroup` starts it as a Ray actor in the rank's bundle."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self._worker: TPWorker | None = None
        self._step_lock = threading.Lock()
        self._follow_thread: threading.Thread | None = None
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

        self._worker = TPWorker(config, rendezvous=rendezvous)
        if self.tp_rank != 0:
            self._follow_thread = threading.Thread(target=self._follow, daemon=True,
                                                   name=f"raydix-follow-rank{self.tp_rank}")
            self._follow_thread.start()
        return self._worker.max_num_tokens

    def _follow(self) -> None:
        """Follow until the shutdown plan. A plan that fails validation (ValueError, raised
        before any collective, on every rank alike) fails the step on rank 0 too, which keeps
        serving; so does the follower. Any other error ends the loop and is kept for `health`."""
        worker = self._started()
        while True:
            try:
                worker.follow()
                return
            except ValueError:
                continue
            except BaseException:
                self._follow_error = traceback.format_exc()
                return

    def step(self, plan: StepPlan) -> StepResult:
        """Rank 0: broadcast `plan` to the followers and run it."""
        with self._step_lock:
            return self._started().step(plan)

    def stop_followers(self) -> None:
        """Rank 0: send the shutdown plan that ends every follower's loop."""
        with self._step_lock:
            self._started().stop_followers()

    def health(self) -> str | None:
        """None when this rank is fine; otherwise why not (e.g. its follow loop failed)."""
        if self._follow_error is not None:
            return f"its follow loop failed:\n{self._follow_error}"
        return None

    def _started(self) -> TPWorker:
        if self._worker is None:
            raise RuntimeError(f"rank {self.tp_rank} is not started")
        return self._worker
