"""The step's prompt-token budget on CPU: how long running streams stall while prompts arrive.

Every step computes at most `max_prefill_tokens` prompt tokens (chunks of at most
`chunked_prefill_size` per prompt) beside the decodes. On a GPU 8,192 prompt tokens take tens of
milliseconds; on a CPU they take seconds, and every running stream waits that long for its next
token. This runs the default model through the engine in-process, configured as `raydix serve`
configures it on a CPU (its dtype, `auto` unless `--dtype`; its compiled graphs) but for the
budget: 8 streams decoding (32-token
prompts, 160 output tokens), and once they run, a burst of 12 cold 1,024-token prompts (16 output
tokens each). For each budget: the gap between tokens of the 8 streams (p50, p99, max), the
burst's time to first token, and the wall time of the whole, beside the first budget given.

    python benchmarks/step_budget_bench.py [--budgets 8192:2048 2048:1024 1024:512] [--threads N]
        [--dtype auto|float32|bfloat16] [--rounds N]

With `--rounds N` the budgets run N times in turn (the machine's pace drifts), each row beside
the same round's baseline.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.gguf_convert import default_model_folder

STREAMS, STREAM_PROMPT, STREAM_OUT = 8, 32, 160
BURST, BURST_PROMPT, BURST_OUT = 12, 1024, 16


def run(folder: str, max_prefill: int, chunk: int, dtype: str) -> dict[str, float]:
    app = AppConfig(dtype=dtype, max_total_tokens=32_768, max_running_requests=32,  # type: ignore[arg-type]
                    max_context_len=2048, max_prefill_tokens=max_prefill,
                    chunked_prefill_size=chunk)
    engine = Engine(engine_config(app, folder, "cpu"))
    rng = np.random.default_rng(0)
    vocab = engine.executor.worker.runner.model_config.vocab_size  # type: ignore[attr-defined]
    streams = [engine.add_request(rng.integers(100, vocab - 1, STREAM_PROMPT).tolist(),
                                  GenerationParams(max_new_tokens=STREAM_OUT, ignore_eos=True))
               for _ in range(STREAMS)]
    last: dict[str, float] = {}
    gaps: list[float] = []
    burst: dict[str, float] = {}
    first_token: dict[str, float] = {}
    start = time.perf_counter()
    while engine.has_work:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.rid in last and out.new_token_ids:
                gaps.append(now - last[out.rid])
            if out.rid in streams:
                last[out.rid] = now
            elif out.rid in burst and out.new_token_ids and out.rid not in first_token:
                first_token[out.rid] = now - burst[out.rid]
        if not burst and len(last) == STREAMS and len(gaps) >= 4 * STREAMS:
            for _ in range(BURST):  # the streams run: the burst arrives
                rid = engine.add_request(rng.integers(100, vocab - 1, BURST_PROMPT).tolist(),
                                         GenerationParams(max_new_tokens=BURST_OUT,
                                                          ignore_eos=True))
                burst[rid] = time.perf_counter()
    wall = time.perf_counter() - start
    ttft = np.array(list(first_token.values()))
    return {"gap_p50": float(np.percentile(gaps, 50)), "gap_p99": float(np.percentile(gaps, 99)),
            "gap_max": float(np.max(gaps)), "burst_ttft_mean": float(ttft.mean()),
            "burst_ttft_max": float(ttft.max()), "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", nargs="+", default=["8192:2048", "2048:1024", "1024:512"],
                        help="max_prefill_tokens:chunked_prefill_size; the first is the baseline")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = str(default_model_folder())
    for round_ in range(args.rounds):
        rows = {}
        if args.rounds > 1:
            print(f"round {round_ + 1}", flush=True)
        for budget in args.budgets:
            max_prefill, chunk = (int(x) for x in budget.split(":"))
            rows[budget] = r = run(folder, max_prefill, chunk, args.dtype)
            base = rows[args.budgets[0]]
            print(f"{budget:>10}: token gap p50 {r['gap_p50'] * 1e3:6.0f} ms, p99 "
                  f"{r['gap_p99'] * 1e3:6.0f} ms ({base['gap_p99'] / r['gap_p99']:.2f}x lower), max "
                  f"{r['gap_max'] * 1e3:6.0f} ms | burst TTFT mean {r['burst_ttft_mean']:.2f} s, "
                  f"max {r['burst_ttft_max']:.2f} s | wall {r['wall']:.1f} s "
                  f"({r['wall'] / base['wall']:.2f}x the baseline's)", flush=True)


if __name__ == "__main__":
    main()
