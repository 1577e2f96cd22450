"""Products of a few rows on the CPU: the small-GEMM kernel (workers/layers/small_gemm.c)
against torch's product on the same plain weights (bf16: what the batched decode graph called
before; float32: oneDNN on the plain weight, what it called before) and against oneDNN on
packed weights (a second copy the decode graph does not keep). 30 layers
of SmolLM2-135M's shapes (fused QKV 576->960, O 576->576, fused gate/up 576->3072, down
1536->576), each product on its own layer's weight so that the weights come from memory as in a
decode step; best of four passes, ms per pass over the 30 layers.

    python benchmarks/small_gemm_bench.py [--dtype bfloat16|float32] [--threads 2]
        [--rows 1 2 4 8 16 32 64]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from raydix.workers.host_memory import keep_freed_memory
from raydix.workers.layers import small_gemm
from raydix.workers.layers.packed import linear, pack_weight, packing_supported

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
LAYERS = 30

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _ms(fn: Product, xs: list[torch.Tensor], weights: list[list[torch.Tensor]],
        packed: list[list[torch.Tensor | None]]) -> float:
    best = float("inf")
    for _ in range(4):
        start = time.perf_counter()
        for layer, layer_packed in zip(weights, packed, strict=True):
            for x, w, p in zip(xs, layer, layer_packed, strict=True):
                fn(x, w, p)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    if not small_gemm.warm_up():
        raise SystemExit("the small-GEMM kernel does not run here (see the log)")
    can_pack = packing_supported(torch.device("cpu"), dtype)
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=gen).to(dtype) for o, i in SHAPES]
               for _ in range(LAYERS)]
    if not small_gemm.serves(torch.ones(1, SHAPES[0][1], dtype=dtype), weights[0][0]):
        raise SystemExit(f"the small-GEMM kernel does not compute {args.dtype} on this CPU")
    weight_mb = sum(o * i * dtype.itemsize for o, i in SHAPES) * LAYERS / 1e6
    print(f"{args.threads} threads, {args.dtype}, {LAYERS} layers, {weight_mb:.0f} MB of weights")
    print(f"{'rows':>4} {'torch mm':>9} {'packed':>8} {'kernel':>8} {'kernel/mm':>9} "
          f"{'kernel/packed':>13}")
    # torch's product on the plain weight: what the decode graph's batches called before
    # (float32: oneDNN's, through `linear`, as MKL's is slower on AMD CPUs)
    mm: Product = ((lambda x, w, p: torch.mm(x, w.t())) if dtype == torch.bfloat16 else
                   (lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [],
                                                                       "")))
    with torch.inference_mode():
        for rows in args.rows:
            xs = [torch.randn(rows, i, generator=gen).to(dtype) for _, i in SHAPES]
            none: list[list[torch.Tensor | None]] = [[None] * len(SHAPES)] * LAYERS
            plain = _ms(mm, xs, weights, none)
            kernel = _ms(lambda x, w, p: small_gemm.small_gemm(x, w), xs, weights, none)
            packed_ms = float("nan")
            if can_pack:
                packs: list[list[torch.Tensor | None]] = [
                    [pack_weight(w, rows) for w in layer] for layer in weights]
                packed_ms = _ms(lambda x, w, p: linear(x, None, p), xs, weights, packs)
            print(f"{rows:>4} {plain:>9.2f} {packed_ms:>8.2f} {kernel:>8.2f} "
                  f"{kernel / plain:>8.2f}x {kernel / packed_ms:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
