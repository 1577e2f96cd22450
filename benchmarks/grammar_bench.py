"""Grammar overhead in the decode step, on the CPU, in one run.

16 requests decode together on the default model (greedy, the same prompts), once free and once
each under a JSON schema (an array of at least 40 small objects, so no request can end within
the measured steps). Runs alternate (free, schema, free, schema, ...) and the best of each is
kept. Reported: mean decode step time at batch 16 for both, the overhead ratio (target: the
schema adds <= 10% per step), and the schema's compile time (once; later requests hit the
cache).

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
SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"}},
    "required": ["id", "name", "kind", "ok"]}}


def decode_step_time(engine: Engine, prompts: list[list[int]], params: GenerationParams,
                     steps: int) -> tuple[float, float]:
    """(mean wall seconds, mean CPU seconds) of a decode step at batch BATCH."""
    rids = [engine.add_request(p, params) for p in prompts]
    while len(engine.scheduler.running) < BATCH or any(
            r.fill_len - r.kv_len > 1 for r in engine.scheduler.running):
        engine.step()  # prefill
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
        if len(engine.scheduler.running) != BATCH:
            raise RuntimeError("a request ended inside the measured steps")
    for rid in rids:
        engine.abort(rid)
    engine.step()
    return statistics.mean(wall), statistics.mean(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the default model)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model or str(default_model_folder())
    config = EngineConfig.build(WorkerConfig(model_path=folder, max_total_tokens=32768),
                                SchedulerConfig(max_running_requests=BATCH, max_context_len=1024))
    engine = Engine(config)
    rng = np.random.default_rng(0)
    vocab = engine.executor.worker.runner.model_config.vocab_size  # type: ignore[attr-defined]
    prompts = [rng.integers(100, vocab, size=64).tolist() for _ in range(BATCH)]
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    compiler = engine.executor.worker.runner.grammars.compiler  # type: ignore[attr-defined]
    start = time.perf_counter()
    compiler.get(spec)
    compile_s = time.perf_counter() - start  # includes the tokenizer's one-off vocabulary scan
    free = GenerationParams(sampling=SamplingParams(temperature=0.0),
                            max_new_tokens=args.steps + 8, ignore_eos=True)
    constrained = GenerationParams(sampling=SamplingParams(temperature=0.0, grammar=spec),
                                   max_new_tokens=args.steps + 8)
    decode_step_time(engine, prompts, free, 4)  # warm-up
    results: dict[str, list[tuple[float, float]]] = {"free": [], "schema": []}
    for _ in range(args.rounds):
        for name, params in (("free", free), ("schema", constrained)):
            results[name].append(decode_step_time(engine, prompts, params, args.steps))
    best = {name: min(r[0] for r in rs) for name, rs in results.items()}
    best_cpu = {name: min(r[1] for r in rs) for name, rs in results.items()}
    print(f"model {folder}, batch {BATCH}, {args.steps} decode steps x {args.rounds} rounds, "
          f"{args.threads} thread(s)")
    print(f"schema compile (first time, with the vocabulary scan): {compile_s * 1e3:.0f} ms")
    for name in ("free", "schema"):
        print(f"{name:>6}: decode step {best[name] * 1e3:7.2f} ms wall, "
              f"{best_cpu[name] * 1e3:7.2f} ms CPU, {BATCH / best[name]:7.1f} tokens/s")
    ratio = best["schema"] / best["free"]
    cpu_ratio = best_cpu["schema"] / best_cpu["free"]
    print(f"schema / free step time: {ratio:.3f} wall, {cpu_ratio:.3f} CPU "
          f"(target <= 1.10): {'ok' if ratio <= 1.10 else 'MISSED'}")


if __name__ == "__main__":
    main()
