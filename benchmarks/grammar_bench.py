"""Grammar overhead in the decode step, on the CPU, in one run.

16 requests decode together on the default model (greedy, the same prompts) in three engines in
one process: free; each request under a JSON schema (an array of at least 40 small objects, so
no request can end within the measured steps), the engine's way on a CPU (rows draw first and
are masked only when their grammar rejects the draw); and "masked", the same with every row
masked before sampling (the masks made on the mask thread beside the forward: a GPU's way, and
the CPU's way before rows drew first). The engines take decode steps in turn (the order rotates
each step), so a change in the shared machine's load falls on all three alike. Reported per
round: each engine's mean decode step time at batch 16 and its ratio to the free one; over all
rounds: the ratio of the means and the median of the per-step ratios (target: the schema adds
<= 10% per step, wall time), the same for CPU time (a mask thread's work shows in CPU time
whatever it overlaps), how many grammar rows were masked after their draw, and the schema's
compile time (once; later requests hit the cache).

    python benchmarks/grammar_bench.py [--model PATH] [--steps 48] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.config import WorkerConfig
from raydix.workers.gguf_convert import default_model_folder
from raydix.workers.step import GrammarSpec, SamplingParams

BATCH = 16
NAMES = ("free", "schema", "masked")
SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"}},
    "required": ["id", "name", "kind", "ok"]}}


def start(engine: Engine, prompts: list[list[int]], params: GenerationParams) -> list[str]:
    """Add the batch and prefill it; the request ids."""
    rids = [engine.add_request(p, params) for p in prompts]
    while len(engine.scheduler.running) < BATCH or any(
            r.fill_len - r.kv_len > 1 for r in engine.scheduler.running):
        engine.step()
    return rids


def decode_steps(engines: dict[str, Engine], params: dict[str, GenerationParams],
                 prompts: list[list[int]], steps: int) -> dict[str, list[tuple[float, float]]]:
    """Each engine's (wall, CPU) seconds per decode step at batch BATCH, the engines in turn."""
    rids = {name: start(engine, prompts, params[name]) for name, engine in engines.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    names = list(engines)
    for k in range(steps):
        for name in names[k % len(names):] + names[:k % len(names)]:
            engine = engines[name]
            w, c = time.perf_counter(), time.process_time()
            engine.step()
            times[name].append((time.perf_counter() - w, time.process_time() - c))
            if len(engine.scheduler.running) != BATCH:
                raise RuntimeError(f"a {name} request ended inside the measured steps")
    for name, engine in engines.items():
        for rid in rids[name]:
            engine.abort(rid)
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the default model)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model or str(default_model_folder())
    config = EngineConfig.build(WorkerConfig(model_path=folder, max_total_tokens=4096),
                                SchedulerConfig(max_running_requests=BATCH, max_context_len=1024))
    engines = {name: Engine(config) for name in NAMES}
    runners = {name: e.executor.worker.runner for name, e in engines.items()}  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    vocab = runners["free"].model_config.vocab_size
    prompts = [rng.integers(100, vocab, size=64).tolist() for _ in range(BATCH)]
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    begin = time.perf_counter()
    runners["schema"].grammars.compiler.get(spec)
    compile_s = time.perf_counter() - begin  # includes the tokenizer's one-off vocabulary scan
    runners["masked"].grammars.compiler.get(spec)
    runners["masked"].grammars.check_first = False
    grammars = runners["schema"].grammars
    assert grammars.check_first
    rejected = {"steps": 0, "rows": 0}  # of the schema engine: rows masked after their draw
    check = grammars.rejected

    def counted(token_ids: torch.Tensor) -> list[int]:
        rows = check(token_ids)
        rejected["steps"] += 1
        rejected["rows"] += len(rows)
        return rows

    grammars.rejected = counted
    free = GenerationParams(sampling=SamplingParams(temperature=0.0),
                            max_new_tokens=args.steps + 8, ignore_eos=True)
    constrained = GenerationParams(sampling=SamplingParams(temperature=0.0, grammar=spec),
                                   max_new_tokens=args.steps + 8)
    params = {"free": free, "schema": constrained, "masked": constrained}
    decode_steps(engines, params, prompts, 4)  # warm-up
    rejected.update(steps=0, rows=0)
    rounds = [decode_steps(engines, params, prompts, args.steps) for _ in range(args.rounds)]
    print(f"model {folder}, batch {BATCH}, {args.steps} decode steps x {args.rounds} rounds, "
          f"{args.threads} thread(s), three engines stepping in turn; schema: rows draw first, "
          "masked when the grammar rejects the draw (the engine's way on a CPU); masked: every "
          "row masked before sampling")
    print(f"schema compile (first time, with the vocabulary scan): {compile_s * 1e3:.0f} ms")
    print(f"schema: {rejected['rows'] / max(rejected['steps'], 1):.1f} of {BATCH} rows a step "
          "masked after their draw (the grammar rejected it; prefill steps included)")
    for k, times in enumerate(rounds):
        mean = {n: (statistics.mean(t[0] for t in ts), statistics.mean(t[1] for t in ts))
                for n, ts in times.items()}
        f = mean["free"]
        print(f"round {k}: wall free {f[0] * 1e3:6.1f} ms, " + ", ".join(
            f"{n} {mean[n][0] * 1e3:6.1f} ({mean[n][0] / f[0]:.3f})" for n in NAMES[1:])
            + f"; CPU free {f[1] * 1e3:6.1f}, " + ", ".join(
            f"{n} {mean[n][1] * 1e3:6.1f} ({mean[n][1] / f[1]:.3f})" for n in NAMES[1:]))
    every = {n: [t for times in rounds for t in times[n]] for n in NAMES}
    for n in NAMES:
        wall = statistics.mean(t[0] for t in every[n])
        print(f"{n:>6}: mean decode step {wall * 1e3:7.2f} ms wall, "
              f"{statistics.mean(t[1] for t in every[n]) * 1e3:7.2f} ms CPU, "
              f"{BATCH / wall:7.1f} tokens/s")
    for n in NAMES[1:]:
        ratio = statistics.mean(t[0] for t in every[n]) / statistics.mean(
            t[0] for t in every["free"])
        cpu = statistics.mean(t[1] for t in every[n]) / statistics.mean(
            t[1] for t in every["free"])
        median = statistics.median(a[0] / b[0] for a, b in zip(every[n], every["free"],
                                                              strict=True))
        print(f"{n} / free step time: {ratio:.3f} wall (per-step median {median:.3f}), "
              f"{cpu:.3f} CPU" + (f" (target <= 1.10 wall): {'ok' if ratio <= 1.10 else 'MISSED'}"
                                  if n == "schema" else ""))


if __name__ == "__main__":
    main()
