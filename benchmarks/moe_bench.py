"""The mixture-of-experts layer on the CPU: the grouped loop (one call per expert on its
tokens, layers/moe.py) against a naive loop over tokens (each token through its top-k experts
one by one), in one process, on the same random layer. Prints tokens per second of each and
the ratio, for several batch sizes; outputs are checked equal first.

    python benchmarks/moe_bench.py [--hidden 1024] [--experts 16] [--top-k 2]
                                   [--intermediate 704] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from raydix.workers.config import MoEConfig
from raydix.workers.layers.moe import SparseMoE, select_experts
from raydix.workers.layers.packed import pack_linear_layers
from raydix.workers.parallel import SINGLE_RANK


def naive(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = select_experts(layer.gate(x), layer.config)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            out[t] += weights[t, k] * layer.experts[int(ids[t, k])](x[t: t + 1])[0]
    return out


def seconds(fn: object, x: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn(x)  # type: ignore[operator]
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = MoEConfig(args.experts, args.top_k, args.intermediate, (True,), renormalize=True)
    layer = SparseMoE(args.hidden, config, "silu", SINGLE_RANK)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    pack_linear_layers(layer, 64)  # as the runner packs every linear on the CPU
    print(f"hidden {args.hidden}, {args.experts} experts of {args.intermediate}, top-{args.top_k}"
          f", {args.threads} threads")
    print("| tokens | grouped tok/s | per-token loop tok/s | speed-up |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for num_tokens in args.tokens:
            x = torch.randn(num_tokens, args.hidden)
            torch.testing.assert_close(layer(x), naive(layer, x), atol=1e-4, rtol=1e-4)
            repeats = max(1, 256 // num_tokens)
            grouped, loop = seconds(layer, x, repeats), seconds(lambda v: naive(layer, v), x,
                                                                 max(1, repeats // 4))
            print(f"| {num_tokens} | {num_tokens / grouped:.0f} | {num_tokens / loop:.0f} | "
                  f"{loop / grouped:.1f}x |")


if __name__ == "__main__":
    main()
