"""One path of the CPU engine against the one it replaces, in one process and the same minutes:
one engine with the decode graphs, whose steps take the path or not in alternating runs of
`engine_bench.py --against`'s prompt-heavy workloads (new random prompts each run, so that no
run finds another's prefixes in the cache). Prints each side's values per round and the ratio
with / without (TTFT: lower is better). The paths (`--path`):

- `step-graph`: prompt steps through the CPU step graph (workers/cpu_step_graph.py) or eagerly
  (the runner's `step_graph` set or cleared);
- `row-blocks`: bf16 extend attention as row blocks of products (workers/attention/
  block_causal.py) or torch's flash kernel (the backend's `block_causal` set or cleared; the
  AMX kernel off on both sides);
- `extend-kernel`: extend attention in its kernel (workers/attention/extend_kernel.py: bf16 on
  the AMX tiles, else AVX-512-BF16 dot products; float32 as AVX-512 multiply-adds) or the path
  the CPU takes without it (torch's flash kernel with AMX or in float32, the bf16 row blocks
  without AMX) (the backend's `extend_kernel` set or cleared);
- `packed-gemv`: bf16 products of a few rows (1-32 with AMX tiles, else 1-2) on the packed
  weights read in place (workers/layers/packed_gemv.py) or by oneDNN (`packed_gemv.ENABLED`).

On a machine whose pace moves between processes and hours (this project's 2-core VMs: a third
and more), runs in one process alternated side by side compare the two paths more steadily
than `engine_bench.py --against`, which starts a process a run.

    python benchmarks/path_bench.py [--path step-graph|row-blocks|extend-kernel|packed-gemv]
                                    [--dtype bfloat16|float32]
                                    [--rounds 3] [--threads 2]

"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
from _against import drive, requests

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.attention import block_causal, extend_kernel
from raydix.workers.config import WorkerConfig
from raydix.workers.gguf_convert import default_model_folder
from raydix.workers.layers import packed_gemv

WORKLOADS = ("one stream", "four streams", "lone prompt", "shared prefix", "mixed")
PATHS = ("step-graph", "row-blocks", "extend-kernel", "packed-gemv")
DEFAULT_WORKLOADS = {"step-graph": ("lone prompt", "shared prefix", "mixed"),
                     "row-blocks": ("lone prompt", "shared prefix", "mixed"),
                     "extend-kernel": ("lone prompt", "shared prefix", "mixed"),
                     "packed-gemv": ("one stream", "four streams", "shared prefix", "mixed")}


def run(engine: Engine, workload: str, vocab: int, seed: int) -> float:
    """TTFT in seconds (lone prompt) or output tokens/s (the others)."""
    prompts, outputs = requests(workload, vocab, np.random.default_rng(seed))
    first, num_tokens, seconds, _ = drive(engine, GenerationParams, prompts, outputs)
    if workload == "lone prompt":
        assert first is not None
        return first[0]
    return num_tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", default="step-graph", choices=PATHS)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS,
                        help="default: the path's (DEFAULT_WORKLOADS)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = default_model_folder()
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    worker = WorkerConfig(model_path=str(folder), dtype=args.dtype, max_total_tokens=40_000,
                          cpu_memory_budget_bytes=8 << 30, cpu_decode_graph=True,
                          cpu_step_graph=True)
    engine = Engine(EngineConfig.build(worker, SchedulerConfig(
        max_running_requests=64, max_context_len=2048, enable_prefix_cache=True)))
    runner = engine.executor.worker.runner
    graph = runner.step_graph
    if args.path == "step-graph" and graph is None:
        raise SystemExit("no CPU step graph for this model and config")
    if args.path in ("row-blocks", "packed-gemv") and args.dtype != "bfloat16":
        raise SystemExit(f"{args.path} runs in bf16 only")
    if args.path == "packed-gemv" and not packed_gemv.warm_up():
        raise SystemExit("no packed-weight kernel on this CPU (AVX-512-BF16)")
    if args.path == "extend-kernel" and not extend_kernel.available(dtype=getattr(torch,
                                                                                   args.dtype)):
        raise SystemExit(f"no {args.dtype} extend kernel here (bf16: no AMX tiles granted, no "
                         f"AVX-512-BF16; float32: no AVX-512)")
    block_causal.warm_up()
    served_kernel = runner.backend.extend_kernel
    if args.path == "row-blocks":
        runner.backend.extend_kernel = False  # the row blocks against torch's flash kernel

    def take(side: str) -> None:
        if args.path == "step-graph":
            runner.step_graph = graph if side == "with" else None
        elif args.path == "row-blocks":
            runner.backend.block_causal = side == "with"
        elif args.path == "extend-kernel":
            runner.backend.extend_kernel = side == "with"
        else:
            packed_gemv.ENABLED = side == "with"

    served = runner.backend.block_causal
    run(engine, "lone prompt", vocab, seed=1)  # first-call costs out of the timing
    print(f"{args.path}, {args.dtype}, {args.threads} threads, {args.rounds} rounds; each round "
          f"runs every workload with and without it, alternating which goes first")
    seed = 100
    for workload in args.workloads or DEFAULT_WORKLOADS[args.path]:
        sides: dict[str, list[float]] = {"without": [], "with": []}
        for r in range(args.rounds):
            order = ("without", "with") if r % 2 == 0 else ("with", "without")
            for side in order:
                take(side)
                seed += 1
                sides[side].append(run(engine, workload, vocab, seed))
        runner.step_graph, runner.backend.block_causal = graph, served
        runner.backend.extend_kernel = served_kernel and args.path != "row-blocks"
        packed_gemv.ENABLED = True
        ratios = np.array(sides["with"]) / np.array(sides["without"])
        unit = "s" if workload == "lone prompt" else "tok/s"
        better = "lower is better" if workload == "lone prompt" else "higher is better"
        print(f"  {workload:<14} without {'/'.join(f'{v:.4g}' for v in sides['without'])} {unit}"
              f"   with {'/'.join(f'{v:.4g}' for v in sides['with'])} {unit}   with/without "
              f"{ratios.min():.2f}-{ratios.max():.2f}x, median "
              f"{statistics.median(ratios):.2f}x ({better})", flush=True)


if __name__ == "__main__":
    main()
