"""Two spawned processes that form a TP group over gloo, reused for several test cases.

Each case names a model folder and the scenarios to run; both ranks build a `TPWorker` for it.
Rank 0 drives the scenarios (broadcasting every plan) and sends back the generated tokens and,
when asked, the last-token logits of probe sequences; rank 1 follows.
"""

from __future__ import annotations

import queue
import socket
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.multiprocessing as mp

from raydix.workers.broadcast import broadcast_plan
from raydix.workers.config import WorkerConfig
from raydix.workers.kv_pool import MLAKVPool
from raydix.workers.parallel import init_tp_group
from raydix.workers.step import GREEDY, ScheduledRequest, StepPlan
from raydix.workers.worker import TPWorker

from .driver import run_greedy, scenario


@dataclass(frozen=True)
class TPCase:
    model_path: str
    prompts: list[list[int]]
    max_new_tokens: int
    modes: tuple[str, ...] = ("whole", "chunked", "prefix")
    probes: list[list[int]] = field(default_factory=list)  # sequences to return logits for
    max_context_len: int = 256
    page_size: int = 1
    worker_options: tuple[tuple[str, object], ...] = ()  # more WorkerConfig fields


@dataclass
class TPCaseResult:
    outputs: dict[str, list[list[int]]]
    probe_logits: list[np.ndarray]
    max_num_tokens: int
    shard_shapes: dict[str, tuple[int, ...]]  # rank 0's local parameter shapes (layer 0)
    bad_plan_error: str  # what rank 0 said to a plan with an out-of-range row
    pool_bytes_per_rank: list[int] = field(default_factory=list)  # every rank's KV pool bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probe_plan(probes: list[list[int]], first_slot: int) -> StepPlan:
    """One extend step with each probe sequence as a fresh request (rows 0.., fresh slots)."""
    reqs, slot = [], first_slot
    for i, seq in enumerate(probes):
        reqs.append(ScheduledRequest(i, 0, seq, list(range(slot, slot + len(seq))), GREEDY))
        slot += len(seq)
    return StepPlan.build(10_000, reqs)


def run_case(worker: TPWorker, case: TPCase) -> TPCaseResult:
    """Rank 0's part of a case (also used directly at TP=1)."""
    bad = StepPlan.build(0, [ScheduledRequest(10_000, 0, [1], [1])])
    try:
        worker.step(bad)  # rejected before the broadcast: the followers never see it
        bad_plan_error = ""
    except ValueError as e:
        bad_plan_error = str(e)
    outputs = {m: run_greedy(worker.step, scenario(m, case.prompts, case.max_new_tokens),
                             page_size=case.page_size) for m in case.modes}
    logits = []
    if case.probes:
        plan = broadcast_plan(probe_plan(case.probes, case.page_size), worker.group)
        logits = list(worker.runner.forward(plan).float().cpu().numpy())
    model = worker.runner.model
    weights = dict(model.named_parameters())
    weights.update({f"{name}.weight": mod.packed_weight for name, mod in model.named_modules()
                    if getattr(mod, "packed_weight", None) is not None})  # packed on CPU
    shapes = {name: tuple(p.shape) for name, p in weights.items()
              if ".layers.0." in name or ".experts.0." in name or "embed" in name
              or "lm_head" in name}
    pool = worker.runner.kv_pool
    buffers = pool.kv_buffers if isinstance(pool, MLAKVPool) else pool.k_buffers
    shapes["kv_pool"] = tuple(buffers[0].shape)
    shapes["kv_pool_bytes"] = (pool.num_bytes,)
    return TPCaseResult(outputs, logits, worker.max_num_tokens, shapes, bad_plan_error)


def _config(case: TPCase, rank: int, tp_size: int) -> WorkerConfig:
    return WorkerConfig(case.model_path, tp_rank=rank, tp_size=tp_size, dtype="float32",
                        max_running_requests=8, max_context_len=case.max_context_len,
                        max_total_tokens=4096, page_size=case.page_size,
                        **dict(case.worker_options))  # type: ignore[arg-type]


def _rank_main(rank: int, tp_size: int, address: str, cases: mp.Queue, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    try:
        group = init_tp_group(address, rank, tp_size, "cpu", timeout_s=120)
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
        return
    while (case := cases.get()) is not None:
        try:
            worker = TPWorker(_config(case, rank, tp_size), group=group)
            if rank == 0:
                result = run_case(worker, case)
                worker.stop_followers()
                results.put((rank, "ok", result))
            else:
                worker.follow()  # probe plans arrive through the same loop
                results.put((rank, "follower", worker.runner.kv_pool.num_bytes))
        except Exception:
            results.put((rank, "error", traceback.format_exc()))
            return


class SpawnedTPGroup:
    def __init__(self, tp_size: int = 2) -> None:
        ctx = mp.get_context("spawn")
        address = f"tcp://127.0.0.1:{_free_port()}"
        self.tp_size = tp_size
        self._cases = [ctx.Queue() for _ in range(tp_size)]
        self._results: mp.Queue = ctx.Queue()
        self._procs = [ctx.Process(target=_rank_main, daemon=True,
                                   args=(r, tp_size, address, self._cases[r], self._results))
                       for r in range(tp_size)]
        for p in self._procs:
            p.start()

    def run(self, case: TPCase, timeout_s: float = 240.0) -> TPCaseResult:
        for q in self._cases:
            q.put(case)
        result: TPCaseResult | None = None
        follower_bytes: dict[int, int] = {}
        while result is None or len(follower_bytes) < self.tp_size - 1:
            try:
                rank, status, payload = self._results.get(timeout=timeout_s)
            except queue.Empty as e:
                raise TimeoutError(f"TP group gave no answer in {timeout_s} s") from e
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            if status == "ok":
                result = payload
            else:  # a follower's pool, sent when rank 0 released it
                follower_bytes[rank] = payload
        result.pool_bytes_per_rank = [result.shard_shapes["kv_pool_bytes"][0],
                                      *(follower_bytes[r] for r in sorted(follower_bytes))]
        return result

    def close(self) -> None:
        for q in self._cases:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
