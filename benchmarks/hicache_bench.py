"""The host KV tier on multi-turn chat: the default model on the CPU, tier on vs off in one run.

Conversations (a system prompt, then turns that each add the model's reply and a new user
message to the whole history) are revisited round by round in random order; their total context
is about 4x the device KV pool and fits in the host tier. Each request is sent when the previous
one has finished, as one user after another would, to two engines in lockstep (host tier off,
then on), so both see the same load from neighbours on a shared machine. The replies of the two
must be equal token for token (greedy); the next turn's history uses them.

Reported per engine: prompt-token hit rate, TTFT p50 and mean, output tokens/s, wall and CPU
time, tokens loaded back from and written to the host tier; then the ratios against the targets
(hit rate >= 2x, TTFT p50 >= 2x lower with the tier on).

    python benchmarks/hicache_bench.py [--quick] [--threads N] [--write-policy P] [--json F]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.config import WorkerConfig
from raydix.workers.gguf_convert import default_model_folder


@dataclass
class Run:
    label: str
    engine: Engine
    ttft: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    num_output_tokens: int = 0


def make_engine(folder: Path, device_tokens: int, hicache_ratio: float,
                write_policy: str) -> Engine:
    worker = WorkerConfig(model_path=str(folder), max_total_tokens=device_tokens,
                          hicache_ratio=hicache_ratio)
    sched = SchedulerConfig(max_running_requests=8, max_context_len=2048,
                            max_prefill_tokens=512, chunked_prefill_size=512,
                            hicache_write_policy=write_policy)
    return Engine(EngineConfig.build(worker, sched))


def send(run: Run, prompt: list[int], max_new_tokens: int) -> list[int]:
    """One request to completion; returns its output tokens and records its TTFT."""
    start, cpu_start = time.perf_counter(), time.process_time()
    rid = run.engine.add_request(prompt, GenerationParams(max_new_tokens=max_new_tokens,
                                                          ignore_eos=True))
    tokens: list[int] = []
    while run.engine.has_work:
        for out in run.engine.step():
            if out.rid == rid:
                if out.new_token_ids and not tokens:
                    run.ttft.append(time.perf_counter() - start)
                tokens += out.new_token_ids
    run.seconds += time.perf_counter() - start
    run.cpu_seconds += time.process_time() - cpu_start
    run.num_output_tokens += len(tokens)
    return tokens


def summary(run: Run) -> dict[str, float]:
    m = run.engine.metrics()
    ttft = np.array(run.ttft)
    return {"hit_rate": m.cache_hit_rate, "host_hit_rate": m.host_hit_rate,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_mean_s": float(ttft.mean()),
            "output_tok_s": run.num_output_tokens / run.seconds, "wall_s": run.seconds,
            "cpu_s": run.cpu_seconds, "prompt_tokens": m.num_prompt_tokens,
            "computed_prompt_tokens": m.num_prompt_tokens - m.num_cached_tokens,
            "loaded_tokens": m.num_loaded_tokens, "written_tokens": m.num_written_tokens,
            "device_tokens": run.engine.scheduler.cache.capacity,
            "host_tokens": m.host_capacity}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer and shorter conversations")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--write-policy", default="write_through_selective",
                        choices=("write_through", "write_through_selective", "write_back"))
    parser.add_argument("--hicache-ratio", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.model or default_model_folder()
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    num_convs, turns, system_len = (6, 3, 256) if args.quick else (8, 5, 384)
    user_len, reply_len = (64, 160), 8
    rng = np.random.default_rng(args.seed)
    histories = [rng.integers(2, vocab, size=system_len).tolist() for _ in range(num_convs)]
    user_msgs = [[rng.integers(2, vocab, size=int(rng.integers(*user_len))).tolist()
                  for _ in range(turns)] for _ in range(num_convs)]
    total_context = sum(system_len + sum(len(u) + reply_len for u in msgs) for msgs in user_msgs)
    device_tokens = total_context // 4
    print(f"torch threads: {torch.get_num_threads()}; {num_convs} conversations x {turns} turns, "
          f"total context {total_context} tokens; device pool {device_tokens} tokens, host tier "
          f"{args.hicache_ratio:g}x ({args.write_policy})")
    runs = [Run("host tier off", make_engine(folder, device_tokens, 0, args.write_policy)),
            Run("host tier on", make_engine(folder, device_tokens, args.hicache_ratio,
                                            args.write_policy))]
    for turn in range(turns):
        for c in rng.permutation(num_convs).tolist():
            prompt = histories[c] + user_msgs[c][turn]
            replies = [send(run, prompt, reply_len) for run in runs]
            if replies[0] != replies[1]:
                raise RuntimeError(f"conversation {c}, turn {turn}: the replies differ with the "
                                   f"host tier on: {replies[0]} vs {replies[1]}")
            histories[c] = prompt + replies[0]
    report = {run.label: summary(run) for run in runs}
    for label, s in report.items():
        print(f"  {label:14} hit rate {s['hit_rate']:.3f} (host {s['host_hit_rate']:.3f})  "
              f"TTFT p50 {s['ttft_p50_s']:.3f} s, mean {s['ttft_mean_s']:.3f} s  "
              f"{s['output_tok_s']:.2f} tok/s  wall {s['wall_s']:.1f} s, CPU {s['cpu_s']:.1f} s  "
              f"computed {s['computed_prompt_tokens']}/{s['prompt_tokens']} prompt tokens  "
              f"loaded {s['loaded_tokens']}, written {s['written_tokens']}")
    off, on = report["host tier off"], report["host tier on"]
    ratios = {"hit_rate": on["hit_rate"] / max(off["hit_rate"], 1e-9),
              "ttft_p50": off["ttft_p50_s"] / on["ttft_p50_s"],
              "ttft_mean": off["ttft_mean_s"] / on["ttft_mean_s"],
              "throughput": on["output_tok_s"] / off["output_tok_s"],
              "cpu": off["cpu_s"] / on["cpu_s"]}
    print(f"  hit rate on/off {ratios['hit_rate']:.2f}x (target >= 2x); TTFT p50 off/on "
          f"{ratios['ttft_p50']:.2f}x (target >= 2x); TTFT mean {ratios['ttft_mean']:.2f}x; "
          f"throughput {ratios['throughput']:.2f}x; CPU time off/on {ratios['cpu']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args),
                                               "report": report, "ratios": ratios},
                                              default=str, indent=1))


if __name__ == "__main__":
    main()
