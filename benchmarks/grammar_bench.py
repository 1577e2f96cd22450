"""Grammar overhead in the decode step, on the CPU, in one run.

16 requests decode together on the default model (greedy, the same prompts), once free and once
each under a JSON schema (an array of at least 40 small objects, so no request can end within
the measured steps), and once more under the schema with every row masked before sampling
("masked": the masks made on the mask thread beside the forward, a GPU's way and the CPU's way
before rows drew first). Runs alternate (free, schema, masked, free, ...). Reported: each
round's mean decode step time at batch 16 and its ratio to the round's free one, the ratio of
the bests and the median of the rounds' ratios (target: the schema adds <= 10% per step, wall
time), the same for CPU time (a mask thread's work shows in CPU time whatever it overlaps), how
many grammar rows were masked after their draw, and the schema's compile time (once; later
requests hit the cache).

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
    grammars = engine.executor.worker.runner.grammars  # type: ignore[attr-defined]
    rejected = {"steps": 0, "rows": 0}  # of the schema runs: rows masked after their draw
    check = grammars.rejected

    def counted(token_ids: torch.Tensor) -> list[int]:
        rows = check(token_ids)
        rejected["steps"] += 1
        rejected["rows"] += len(rows)
        return rows

    grammars.rejected = counted
    decode_step_time(engine, prompts, free, 4)  # warm-up
    names = ("free", "schema", "masked")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            grammars.check_first = name != "masked"
            params = free if name == "free" else constrained
            results[name].append(decode_step_time(engine, prompts, params, args.steps))
    print(f"model {folder}, batch {BATCH}, {args.steps} decode steps x {args.rounds} rounds, "
          f"{args.threads} thread(s); schema: rows draw first, masked when the grammar rejects the "
          "draw (the engine's way on a CPU); masked: every row masked before sampling")
    print(f"schema compile (first time, with the vocabulary scan): {compile_s * 1e3:.0f} ms")
    print(f"schema: {rejected['rows'] / max(rejected['steps'], 1):.1f} of {BATCH} rows a step "
          "masked after their draw (the grammar rejected it; prefill steps included)")
    for k in range(args.rounds):
        f, c, v = (results[name][k] for name in names)
        print(f"round {k}: wall free {f[0] * 1e3:6.1f} ms, schema {c[0] * 1e3:6.1f} "
              f"({c[0] / f[0]:.3f}), masked {v[0] * 1e3:6.1f} ({v[0] / f[0]:.3f}); "
              f"CPU free {f[1] * 1e3:6.1f}, schema {c[1] * 1e3:6.1f} ({c[1] / f[1]:.3f}), "
              f"masked {v[1] * 1e3:6.1f} ({v[1] / f[1]:.3f})")
    best = {name: min(r[0] for r in rs) for name, rs in results.items()}
    best_cpu = {name: min(r[1] for r in rs) for name, rs in results.items()}
    for name in names:
        print(f"{name:>6}: best decode step {best[name] * 1e3:7.2f} ms wall, "
              f"{best_cpu[name] * 1e3:7.2f} ms CPU, {BATCH / best[name]:7.1f} tokens/s")
    for name in ("schema", "masked"):
        median = statistics.median(c[0] / f[0] for f, c in zip(results["free"], results[name],
                                                               strict=True))
        ratio = best[name] / best["free"]
        print(f"{name} / free step time: best {ratio:.3f} wall (rounds' median {median:.3f}), "
              f"{best_cpu[name] / best_cpu['free']:.3f} CPU"
              + (f" (target <= 1.10 wall): {'ok' if ratio <= 1.10 else 'MISSED'}"
                 if name == "schema" else ""))

if __name__ == "__main__":
    main()
