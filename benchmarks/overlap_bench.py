"""The overlapped step loop against the synchronous one, in one run: how much of a step the
host adds beside the rank's own work.

A tiny random Llama (2 layers, hidden 64, a small vocabulary) keeps the rank's step under a
millisecond, so the step is mostly host work: the CPU's stand-in for a GPU step. Each loop
decodes `--batch` streams of 64-token prompts for `--steps` steps. Reported per loop: steps per
second, the rank's busy time per step (its `TPWorker.launch`, the whole step on a CPU), and the
share of the wall time the rank sat idle (the host work the loop did not hide). With overlap the engine forms step N+1
and reads step N while the rank runs, so that share should fall.

    python benchmarks/overlap_bench.py [--batch 16] [--steps 400] [--threads N] [--model FOLDER]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.config import WorkerConfig


def tiny_model(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = root / "tiny"
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=4096)
                     ).save_pretrained(folder)
    return folder


def run(folder: Path, overlap: bool, batch: int, steps: int) -> dict[str, float]:
    config = EngineConfig.build(
        WorkerConfig(str(folder), max_total_tokens=batch * (64 + steps + 8) + 64),
        SchedulerConfig(max_running_requests=batch, max_context_len=64 + steps + 8,
                        overlap_schedule=overlap))
    engine = Engine(config)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or tiny_model(Path(tmp))
        for r in range(args.rounds):
            sync = run(folder, False, args.batch, args.steps)
            over = run(folder, True, args.batch, args.steps)
            print(f"round {r}: sync {sync['steps_per_s']:.0f} steps/s (rank {sync['rank_ms']:.2f} "
                  f"ms, idle {sync['idle_share']:.0%}) | overlap {over['steps_per_s']:.0f} "
                  f"steps/s (rank {over['rank_ms']:.2f} ms, idle {over['idle_share']:.0%}) | "
                  f"speed {over['steps_per_s'] / sync['steps_per_s']:.2f}x, idle share "
                  f"{over['idle_share'] / max(sync['idle_share'], 1e-9):.2f}x", flush=True)


if __name__ == "__main__":
    main()
