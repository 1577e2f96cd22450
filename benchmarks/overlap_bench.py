"""The overlapped step loop against the synchronous one, in one run: how much of a step the
host adds beside the rank's own work.

A tiny random Llama (2 layers, hidden 64, a small vocabulary) keeps the rank's step under a
millisecond, so the step is mostly host work: the CPU's stand-in for a GPU step. Each loop
decodes `--batch` streams of 64-token prompts for `--steps` steps. Reported per loop: steps per
second, the rank's busy time per step (its `TPWorker.launch`, the whole step on a CPU), and the
share of the wall time the rank sat idle (the host work the loop did not hide). With overlap the engine forms step N+1
and reads step N while the rank runs, so that share should fall.

`--split` adds the overlapped loop as it ran before its rank was built on the rank's own thread:
built on the engine's thread and stepped on another one, so with more than one torch thread
two OpenMP teams throttle each other (workers/torch_thread.py).

    python benchmarks/overlap_bench.py [--batch 16] [--steps 400] [--threads N] [--split]
        [--model FOLDER]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers import torch_thread
from raydix.workers.config import WorkerConfig

T = TypeVar("T")


class _SplitRank(torch_thread.TorchThread):
    """The overlapped loop's rank before: built on the caller's thread, launched on its own."""

    def call(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        return fn(*args, **kwargs)


def tiny_model(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = root / "tiny"
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=4096)
                     ).save_pretrained(folder)
    return folder


def run(folder: Path, overlap: bool, batch: int, steps: int,
        split: bool = False) -> dict[str, float]:
    config = EngineConfig.build(
        WorkerConfig(str(folder), max_total_tokens=batch * (64 + steps + 8) + 64),
        SchedulerConfig(max_running_requests=batch, max_context_len=64 + steps + 8,
                        overlap_schedule=overlap))
    own = torch_thread.TorchThread
    torch_thread.TorchThread = _SplitRank if split else own  # type: ignore[misc]
    try:
        engine = Engine(config)
    finally:
        torch_thread.TorchThread = own  # type: ignore[misc]
    worker = engine.executor.worker  # type: ignore[attr-defined]
    busy: list[float] = []
    inner = worker.launch  # both loops: on the CPU the launch runs the whole step

    def timed(plan: object) -> object:
        start = time.perf_counter()
        out = inner(plan)
        busy.append(time.perf_counter() - start)
        return out

    worker.launch = timed
    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add_request(rng.integers(2, 500, size=64).tolist(),
                           GenerationParams(max_new_tokens=steps, ignore_eos=True))
    while not all(r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill
    busy.clear()
    start = time.perf_counter()
    num_steps = 0
    while engine.has_work:
        engine.step()
        num_steps += 1
    wall = time.perf_counter() - start
    engine.shutdown()
    return {"steps_per_s": num_steps / wall, "rank_ms": 1e3 * statistics.median(busy),
            "idle_share": max(0.0, 1 - sum(busy) / wall)}


def on_own_thread(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on a thread that ends after it: the OpenMP team its torch work starts ends
    with it, so no loop runs beside a team an earlier one left (workers/torch_thread.py)."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError(f"{fn.__name__} failed (its traceback is above)")
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--split", action="store_true",
                        help="also run the overlapped loop with its rank split over two threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loops = [("sync", False, False), ("overlap", True, False)]
    if args.split:
        loops.append(("overlap split", True, True))
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or on_own_thread(tiny_model, Path(tmp))
        for r in range(args.rounds):
            got = {name: on_own_thread(run, folder, overlap, args.batch, args.steps, split)
                   for name, overlap, split in loops}
            base = got["sync"]["steps_per_s"]
            print(f"round {r}: " + " | ".join(
                f"{name} {m['steps_per_s']:.0f} steps/s {m['steps_per_s'] / base:.2f}x (rank "
                f"{m['rank_ms']:.2f} ms, idle {m['idle_share']:.0%})" for name, m in got.items()),
                flush=True)

if __name__ == "__main__":
    main()
