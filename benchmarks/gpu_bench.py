"""The engine as `raydix serve` builds it on this machine, beside transformers in the same run.

The engine comes from the app config's defaults (`AppConfig()` through `engine_config`, the one
translation serve uses): on CUDA that is flashinfer attention, CUDA-graph decode over
`max_running_requests`, bf16 and the `mem_fraction_static` pool, with the warm-up before ready.
Nothing is set by hand but the model and the context length.

Workloads (random token ids; every request runs to its length, `ignore_eos`):
- decode-heavy: 1, 16 and 64 streams of 128-token prompts, 256 output tokens each;
- shared prefix: 8 groups x 8 prompts, a 512-token prefix + a 64-token question, 32 out;
- mixed: 64 prompts of 32-512 tokens, 16-128 out.
Each also runs through transformers `generate` (static batches, same dtype and device).

Then the decode step's time split at batch 1 and 64 (medians over the decode steps): the whole
`engine.step`, the scheduler (the step outside the executor), the rank's host work (the executor
call outside the forward's device time), and the forward on the device (CUDA: one captured
graph replayed alone, timed with CUDA events; CPU: the forward's wall time); and the share of
the memory-bandwidth floor at batch 1 (decode weight bytes / peak bandwidth over the step).

    python benchmarks/gpu_bench.py [--model FOLDER | --synthetic llama-1b] [--device cuda]
                                   [--quick] [--skip-transformers] [--json out.json]

`--device cpu --quick` runs the same code on a CPU in about a minute (to check the script).
`benchmarks/gpu_check.sh` runs it on a CUDA machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from engine_bench import Workload, mixed, run_engine, run_transformers, shared_prefix
from worker_bench import BANDWIDTH_GBS, SYNTHETIC, decode_weight_bytes, synthetic_model

from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.gguf_convert import default_model_folder
from raydix.workers.runner import ModelRunner


def decode_heavy(vocab: int, streams: int, prompt_len: int, output_len: int) -> Workload:
    work = mixed(vocab, streams, (prompt_len, prompt_len + 1), (output_len, output_len),
                 seed=streams)
    work.name = f"decode-heavy x{streams}"
    return work


def build_engine(folder: Path, device: str, max_context_len: int) -> tuple[Engine, float]:
    """The engine of `raydix serve`'s defaults; returns it and its start-up seconds."""
    app = AppConfig(model=str(folder), device=device, max_context_len=max_context_len)  # type: ignore[arg-type]
    config = engine_config(app, str(folder), device)
    start = time.perf_counter()
    engine = Engine(config)
    return engine, time.perf_counter() - start


def runner_of(engine: Engine) -> ModelRunner:
    return engine.executor.worker.runner  # type: ignore[attr-defined, no-any-return]


class StepClock:
    """Wall time of every `engine.step`, of the rank's launch of each step (on its own thread
    when the loop is overlapped; on CUDA the host work that queues the step, on a CPU the whole
    step), of the forward inside it, and of the engine's waits for the rank (the executor call;
    overlapped: the wait for the launched step's result)."""

    def __init__(self, engine: Engine) -> None:
        self.steps: list[float] = []
        self.rank: list[float] = []
        self.forward: list[float] = []
        self.wait: list[float] = []
        executor, runner = engine.executor, runner_of(engine)
        self._wrap(executor.worker, "launch", self.rank)  # type: ignore[attr-defined]
        self._wrap(runner, "forward", self.forward)
        self._wrap(engine, "step", self.steps)
        if engine.config.scheduler.overlap_schedule:
            launch, wait = executor.launch, self.wait

            def timed_launch(plan: object) -> object:
                handle = launch(plan)  # type: ignore[arg-type]
                result = handle.result

                def timed_result() -> object:
                    start = time.perf_counter()
                    out = result()
                    wait.append(time.perf_counter() - start)
                    return out

                handle.result = timed_result  # type: ignore[method-assign]
                return handle

            executor.launch = timed_launch  # type: ignore[method-assign]
        else:
            self._wrap(executor, "step", self.wait)

    @staticmethod
    def _wrap(obj: object, name: str, sink: list[float]) -> None:
        inner: Callable[..., object] = getattr(obj, name)

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            sink.append(time.perf_counter() - start)
            return out

        setattr(obj, name, timed)


def device_forward_ms(runner: ModelRunner, batch: int, cpu_forward_s: list[float]) -> float:
    """The forward alone: one captured graph replayed (CUDA), else the measured forward."""
    graphs = runner.graph_runner
    if graphs is None or runner.device.type != "cuda":
        return 1e3 * statistics.median(cpu_forward_s)
    bs = next(s for s in graphs.batch_sizes if s >= batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(50):
        start.record()
        graphs.graphs[bs].replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_split(engine: Engine, batch: int, vocab: int, steps: int) -> dict[str, float]:
    """Median decode step time and its parts at `batch` streams (ms)."""
    rng = np.random.default_rng(batch)
    for _ in range(batch):
        engine.add_request(rng.integers(100, vocab - 1, size=128).tolist(),
                           GenerationParams(max_new_tokens=steps + 8, ignore_eos=True))
    while engine.scheduler.waiting or not all(r.output_ids for r in engine.scheduler.running):
        engine.step()  # prefill
    clock = StepClock(engine)
    for _ in range(steps):
        engine.step()
    while engine.has_work:
        engine.step()
    for attr in ("step", "forward", "launch"):  # drop the wrappers
        for obj in (engine, engine.executor, engine.executor.worker, runner_of(engine)):
            obj.__dict__.pop(attr, None)
    n = steps
    step = 1e3 * statistics.median(clock.steps[:n])
    wait = 1e3 * statistics.median(clock.wait[:n])
    rank = 1e3 * statistics.median(clock.rank[:n])
    runner = runner_of(engine)
    device = device_forward_ms(runner, batch, clock.forward[:n])
    # the rank's host work: on CUDA its launch (the device runs the step after it), on a CPU
    # its launch less the forward inside it
    host = rank if runner.device.type == "cuda" else rank - device
    # scheduler: the engine's own time in a step (overlapped, it runs while the rank computes)
    return {"batch": batch, "step_ms": step, "scheduler_ms": max(step - wait, 0.0),
            "rank_launch_ms": rank, "rank_host_ms": max(host, 0.0),
            "device_forward_ms": device, "host_share": max(step - device, 0.0) / step,
            "overlapped": float(engine.config.scheduler.overlap_schedule)}


def bandwidth_gbs(device: str, given: float | None) -> float | None:
    if given or device != "cuda":
        return given
    name = torch.cuda.get_device_name()
    return next((v for k, v in BANDWIDTH_GBS.items() if k in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--synthetic", choices=sorted(SYNTHETIC), default=None)
    parser.add_argument("--synthetic-root", type=Path, default=Path("/tmp/raydix-bench"))
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bandwidth-gbs", type=float, default=None)
    parser.add_argument("--quick", action="store_true", help="small workloads (a smoke run)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    folder = (synthetic_model(args.synthetic, args.synthetic_root) if args.synthetic
              else args.model or default_model_folder())
    engine, startup_s = build_engine(folder, args.device, 2048)
    runner = runner_of(engine)
    vocab = runner.model_config.vocab_size
    facts = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
             "model": str(folder), "dtype": str(runner.dtype).removeprefix("torch."),
             "attention_backend": engine.config.worker.attention_backend,
             "cuda_graph_batches": runner.graph_runner.batch_sizes if runner.graph_runner else [],
             "kv_pool_tokens": runner.max_num_tokens, "startup_s": round(startup_s, 1),
             "warm_up_s": round(runner.warm_up.seconds, 2) if runner.warm_up else None}
    print(json.dumps(facts), flush=True)
    q = args.quick
    out_len = 16 if q else 256
    works = [decode_heavy(vocab, s, 128, out_len) for s in ((1, 4) if q else (1, 16, 64))]
    works += [shared_prefix(vocab, 2 if q else 8, 2 if q else 8, 512, 64, 8 if q else 32),
              mixed(vocab, 8 if q else 64, (32, 512), (8, 16) if q else (16, 128))]
    hf = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=runner.dtype).to(args.device)
        hf.eval()
    rows = []
    for work in works:
        ours = run_engine(engine, work)
        row = {"workload": work.name, "raydix_tok_s": round(ours.throughput, 1),
               "raydix_ttft_mean_s": round(ours.ttft_mean, 4)}
        if hf is not None:
            theirs = run_transformers(hf, work, min(len(work.prompts), 64))
            row |= {"transformers_tok_s": round(theirs.throughput, 1),
                    "ratio": round(ours.throughput / theirs.throughput, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    splits = [step_split(engine, b, vocab, 16 if q else 64) for b in (1, 4 if q else 64)]
    for s in splits:
        print(json.dumps({k: round(v, 3) for k, v in s.items()}), flush=True)
    gbs = bandwidth_gbs(args.device, args.bandwidth_gbs)
    floor = None
    if gbs:
        floor_ms = 1e3 * decode_weight_bytes(runner) / (gbs * 1e9)
        floor = {"floor_ms": round(floor_ms, 3), "step_ms": round(splits[0]["step_ms"], 3),
                 "share_of_floor": round(floor_ms / splits[0]["step_ms"], 3)}
        print(json.dumps(floor), flush=True)
    print(table(facts, rows, splits, floor))
    if args.json:
        args.json.write_text(json.dumps({"facts": facts, "workloads": rows, "step_split": splits,
                                         "floor": floor}, indent=2) + "\n")


def table(facts: dict[str, object], rows: list[dict[str, object]],
          splits: list[dict[str, float]], floor: dict[str, float] | None) -> str:
    """The README's markdown tables."""
    lines = [f"{facts['device']}, {facts['model']}, {facts['dtype']}, "
             f"{facts['attention_backend']}, graphs {facts['cuda_graph_batches'] or 'off'}, "
             f"{facts['kv_pool_tokens']} KV tokens, ready in {facts['startup_s']} s", "",
             "| workload | raydix tok/s | transformers tok/s | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['raydix_tok_s']} | {r.get('transformers_tok_s', '-')} | "
              f"{r.get('ratio', '-')} |" for r in rows]
    lines += ["", "| batch | step ms | scheduler ms | rank launch ms | rank host ms | "
              "device forward ms | host share |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {s['batch']} | {s['step_ms']:.3f} | {s['scheduler_ms']:.3f} | "
              f"{s['rank_launch_ms']:.3f} | {s['rank_host_ms']:.3f} | "
              f"{s['device_forward_ms']:.3f} | {s['host_share']:.0%} |" for s in splits]
    if floor:
        lines += ["", f"batch-1 decode: {floor['step_ms']} ms per token against a floor of "
                  f"{floor['floor_ms']} ms: {floor['share_of_floor']:.0%} of the floor"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
