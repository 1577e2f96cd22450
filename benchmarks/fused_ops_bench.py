"""The fused-op seam on the CPU: decode speed of the default model with the plain-torch ops (the
CPU's default) and with the `raydix::` operators (the CUDA path's selection, their CPU kernels
being the same torch code), alternated round by round in one run, and their ratio.

It answers whether the CPU could take the operators too: the difference is the torch
dispatcher's cost per call, paid on every fused step of every layer.

    python benchmarks/fused_ops_bench.py [--model FOLDER] [--rounds 3] [--decode-tokens 24]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from worker_bench import bench_ours

from raydix.workers.config import WorkerConfig
from raydix.workers.gguf_convert import default_model_folder
from raydix.workers.kv_pool import KVPool
from raydix.workers.layers.fused import fused_ops_for
from raydix.workers.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model or default_model_folder()
    rounds, batches = args.rounds, (1, 16)
    runner = ModelRunner(WorkerConfig(
        str(folder), dtype="float32", max_running_requests=32,
        max_total_tokens=(args.prompt_len + args.decode_tokens + 8) * 17 * 2 * rounds * 2 + 64,
        max_context_len=args.prompt_len + args.decode_tokens + 16))
    vocab = runner.model_config.vocab_size
    speeds: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for kind in ("torch", "fused"):
            ops = fused_ops_for(kind)
            runner.model.use_fused_ops(ops)
            if isinstance(runner.kv_pool, KVPool):
                runner.kv_pool.ops = ops
            for batch in batches:
                _, decode = bench_ours(runner, batch, args.prompt_len, args.decode_tokens, vocab)
                speeds.setdefault((kind, batch), []).append(decode)
    print(f"{folder.name}, float32, {args.threads} thread(s), medians of {rounds} alternated "
          "rounds (decode tok/s):")
    for batch in batches:
        plain = statistics.median(speeds["torch", batch])
        fused = statistics.median(speeds["fused", batch])
        print(f"  batch {batch:2d}: plain torch {plain:8.1f} | raydix:: operators {fused:8.1f} "
              f"| ratio {fused / plain:.3f}")


if __name__ == "__main__":
    main()
