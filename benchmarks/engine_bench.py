"""Engine speed offline on the default model (CPU), beside transformers in the same run.

Workloads (token ids drawn at random from the vocabulary, shuffled):
- shared prefix: 8 groups x 8 prompts, a 512-token group prefix + a 64-token question,
  32 output tokens each;
- mixed: 64 prompts of 32-512 tokens with no shared prefix, 16-128 output tokens each.

Each runs through the engine with the radix cache on and off, and through transformers
`generate` in static batches of the same requests. Reported: output tokens/s, mean and p99
time to first token, and the ratios against the targets (cache on/off >= 3x on the shared
prefix; engine/transformers >= 3x shared, >= 1.5x mixed). Then the control overhead of a decode
step at batch 16 (step time minus forward time), and decode throughput against batch size,
plotted to a PNG when matplotlib is installed.

    python benchmarks/engine_bench.py [--quick] [--threads N] [--workloads shared mixed]
                                      [--no-scaling] [--plot PNG] [--json out.json]

With `--against REV` it instead runs one stream, a lone 512-token prompt, the shared-prefix and
mixed workloads (smaller) and the KV pool size on this checkout and on REV, in the same run,
and prints the ratios (benchmarks/_against.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.config import WorkerConfig
from raydix.workers.gguf_convert import default_model_folder


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: list[int]


@dataclass
class Result:
    throughput: float  # output tokens / s
    ttft_mean: float
    ttft_p99: float
    seconds: float
    cpu_seconds: float  # this process's CPU time: steadier than wall time on a shared machine
    num_steps: int = 0  # engine only: forward steps
    num_computed_prompt_tokens: int = 0  # engine only: prompt tokens not served by the cache


def shared_prefix(vocab: int, groups: int, per_group: int, prefix_len: int, question_len: int,
                  output_len: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(groups):
        prefix = rng.integers(100, vocab, size=prefix_len).tolist()
        prompts += [prefix + rng.integers(100, vocab, size=question_len).tolist()
                    for _ in range(per_group)]
    order = rng.permutation(len(prompts))
    return Workload("shared prefix", [prompts[i] for i in order], [output_len] * len(prompts))


def mixed(vocab: int, num: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
          seed: int = 1) -> Workload:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, vocab, size=int(rng.integers(*prompt_range))).tolist()
               for _ in range(num)]
    outputs = [int(rng.integers(output_range[0], output_range[1] + 1)) for _ in range(num)]
    return Workload("mixed", prompts, outputs)


def make_engine(folder: Path, cache: bool, max_running: int = 64) -> Engine:
    # a memory budget that holds every request of the workloads at once: no retraction here
    worker = WorkerConfig(model_path=str(folder), max_total_tokens=80_000,
                          cpu_memory_budget_bytes=8 << 30)
    sched = SchedulerConfig(max_running_requests=max_running, max_context_len=2048,
                            enable_prefix_cache=cache, max_prefill_tokens=2048,
                            chunked_prefill_size=2048)
    return Engine(EngineConfig.build(worker, sched))


def run_engine(engine: Engine, work: Workload) -> Result:
    start, cpu_start = time.perf_counter(), time.process_time()
    first: dict[str, float] = {}
    rids = [engine.add_request(p, GenerationParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(work.prompts, work.max_new_tokens, strict=True)]
    num_tokens = 0
    while engine.has_work:
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if out.new_token_ids and out.rid not in first:
                first[out.rid] = time.perf_counter() - start
    seconds = time.perf_counter() - start
    ttft = np.array([first[r] for r in rids])
    stats = engine.scheduler.stats
    return Result(num_tokens / seconds, float(ttft.mean()), float(np.percentile(ttft, 99)), seconds,
                  time.process_time() - cpu_start, stats.num_steps,
                  stats.num_prompt_tokens - stats.num_cached_tokens)


class _FirstStep(LogitsProcessor):
    """Records when the first token of a batch is being chosen (its prefill is done)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            self.at = time.perf_counter()
        return scores


@torch.inference_mode()
def run_transformers(model: torch.nn.Module, work: Workload, batch_size: int) -> Result:
    """Static batches in arrival order, left-padded; a batch runs to its longest output."""
    start, cpu_start = time.perf_counter(), time.process_time()
    ttft: list[float] = []
    num_tokens = 0
    for lo in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[lo: lo + batch_size]
        wanted = work.max_new_tokens[lo: lo + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        marker = _FirstStep()
        model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                       max_new_tokens=max(wanted),
                       min_new_tokens=max(wanted), do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([marker]))
        assert marker.at is not None
        ttft += [marker.at - start] * len(prompts)
        num_tokens += sum(wanted)  # only the tokens each request asked for count
    seconds = time.perf_counter() - start
    arr = np.array(ttft)
    return Result(num_tokens / seconds, float(arr.mean()), float(np.percentile(arr, 99)), seconds,
                  time.process_time() - cpu_start)


def control_overhead(folder: Path, batch: int, vocab: int, steps: int = 24) -> tuple[float, float]:
    """Mean decode step time and the share of it spent outside the forward, at ``batch``."""
    engine = make_engine(folder, cache=True, max_running=batch)
    rng = np.random.default_rng(3)
    for _ in range(batch):
        engine.add_request(rng.integers(100, vocab, size=64).tolist(),
                           GenerationParams(max_new_tokens=steps + 4, ignore_eos=True))
    while not all(r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill
    engine.forward_time = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    return total / steps, (total - engine.forward_time) / total


def decode_scaling(folder: Path, model: torch.nn.Module, vocab: int,
                   batches: Sequence[int]) -> dict[int, tuple[float, float]]:
    """Decode-heavy throughput (64-token prompts, 48 outputs) at each batch size."""
    out = {}
    for batch in batches:
        work = mixed(vocab, batch * 2, (64, 65), (48, 48), seed=batch)
        ours = run_engine(make_engine(folder, cache=True, max_running=batch), work)
        theirs = run_transformers(model, work, batch)
        out[batch] = (ours.throughput, theirs.throughput)
        print(f"  batch {batch:3d}: raydix {ours.throughput:8.1f} tok/s   "
              f"transformers {theirs.throughput:8.1f} tok/s")
    return out


def plot(scaling: dict[int, tuple[float, float]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; no plot written to {path}")
        return
    batches = sorted(scaling)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [scaling[b][0] for b in batches], "o-", label="raydix engine")
    ax.plot(batches, [scaling[b][1] for b in batches], "s--", label="transformers generate")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (running requests)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Decode throughput, SmolLM2-135M, CPU ({torch.get_num_threads()} torch threads)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a quarter of the workload")
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--plot", default="benchmarks/engine_throughput.png")
    parser.add_argument("--json", default=None)
    parser.add_argument("--workloads", nargs="+", choices=("shared", "mixed"),
                        default=["shared", "mixed"])
    parser.add_argument("--no-scaling", action="store_true", help="skip throughput vs batch size")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both systems (1 is steadier on a busy machine)")
    parser.add_argument("--against", metavar="REV", default=None,
                        help="compare with a checkout of REV in the same run (ratios)")
    parser.add_argument("--rounds", type=int, default=2, help="with --against: runs per side")
    parser.add_argument("--bf16", action="store_true",
                        help="with --against: also bf16 one stream against the new fp32")
    parser.add_argument("--against-workloads", nargs="+", default=None,
                        help="with --against: a subset of the workloads (default: all)")
    parser.add_argument("--no-decode-graph", action="store_true",
                        help="with --against: run the new side without the CPU decode graph")
    parser.add_argument("--new-dtype", default="float32",
                        choices=("float32", "bfloat16", "auto"),
                        help="with --against: the new side's dtype (auto: as `--dtype auto` "
                        "picks on this CPU); the base runs --base-dtype")
    parser.add_argument("--base-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="with --against: the base's dtype (default float32)")
    args = parser.parse_args()
    if args.against:
        from _against import DECODE_GRAPH_ENV, WORKLOADS, compare

        os.environ[DECODE_GRAPH_ENV] = "0" if args.no_decode_graph else "1"
        compare(args.against, args.rounds, args.threads or 2,
                args.against_workloads or list(WORKLOADS), args.bf16, args.new_dtype,
                args.base_dtype)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    torch.manual_seed(0)
    folder = args.model or default_model_folder()
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    scale = 4 if args.quick else 1
    workloads = []
    if "shared" in args.workloads:
        per = 8 // (2 if args.quick else 1)
        workloads.append(shared_prefix(vocab, per, per, 512, 64, 32))
    if "mixed" in args.workloads:
        workloads.append(mixed(vocab, 64 // scale, (32, 513), (16, 128)))
    report: dict[str, object] = {}
    for work in workloads:
        print(f"\n{work.name}: {len(work.prompts)} requests, "
              f"{sum(map(len, work.prompts))} prompt tokens, {sum(work.max_new_tokens)} output")
        runs = {"raydix, cache on": run_engine(make_engine(folder, True), work),
                "raydix, cache off": run_engine(make_engine(folder, False), work),
                f"transformers, batch {args.hf_batch}": run_transformers(model, work, args.hf_batch)}
        for label, r in runs.items():
            steps = (f", {r.num_steps} steps, {r.num_computed_prompt_tokens} prompt tokens "
                     "computed" if r.num_steps else "")
            print(f"  {label:26} {r.throughput:8.1f} tok/s   TTFT mean {r.ttft_mean:6.2f} s"
                  f"   p99 {r.ttft_p99:6.2f} s   ({r.seconds:.1f} s, CPU {r.cpu_seconds:.1f} s"
                  f"{steps})")
        on, off, hf = runs.values()
        target_hf = 3.0 if work.name == "shared prefix" else 1.5
        print(f"  engine / transformers: {on.throughput / hf.throughput:.2f}x (target >= "
              f"{target_hf}x; {hf.cpu_seconds / on.cpu_seconds:.2f}x in CPU time)")
        print(f"  cache on / cache off: {on.throughput / off.throughput:.2f}x"
              f"{' (target >= 3x)' if work.name == 'shared prefix' else ''}; "
              f"{off.cpu_seconds / on.cpu_seconds:.2f}x in CPU time")
        report[work.name] = {k: r.__dict__ for k, r in runs.items()}
    step_s, overhead = control_overhead(folder, 16, vocab)
    print(f"\ndecode step at batch 16: {step_s * 1e3:.1f} ms, control overhead "
          f"{overhead * 100:.1f}% (target < 10%)")
    report["control_overhead_batch16"] = overhead
    if args.no_scaling:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return
    print("\ndecode throughput against batch size:")
    scaling = decode_scaling(folder, model, vocab, [1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32])
    report["scaling"] = scaling
    plot(scaling, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
