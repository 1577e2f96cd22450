"""The linear layers of one decode step of the default model (SmolLM2-135M's shapes: per layer
qkv, o, gate_up, down; then the LM head), timed per input row count, four ways in one run:

- packed: oneDNN on weights reordered once (`layers/packed.py`, the CPU default);
- plain oneDNN: oneDNN on the plain `[out, in]` weight (what unpacked fp32 layers run);
- F.linear: torch's default (MKL on CPU);
- compiled: multiply-and-sum traced by inductor, as the CPU decode graph runs one row
  (`cpu_decode_graph.py`); for up to `--compiled-max-rows` rows.

Each figure is the best of `--repeats` passes over all the layers (random weights: the speed
depends on the shapes only), printed in ms and as a ratio to packed.

    python benchmarks/gemv_bench.py [--rows 1 2 4 8 16 64 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer
NUM_LAYERS, LM_HEAD = 30, (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compiled-max-rows", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = LAYER_SHAPES * NUM_LAYERS + [LM_HEAD]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) for o, i in shapes]

    def multiply_and_sum(xs: dict[int, torch.Tensor], ws: list[torch.Tensor]) -> list[torch.Tensor]:
        return [(ws[k][:, None, :] * xs[i][None]).sum(-1) for k, (_, i) in enumerate(shapes)]

    compiled = torch.compile(multiply_and_sum, dynamic=False)
    print(f"{args.threads} threads; ms for all {len(shapes)} linear layers (ratio to packed)")
    with torch.inference_mode():
        for rows in args.rows:
            xs = {i: torch.randn(rows, i, generator=gen) for _, i in shapes}
            ways = _ways(shapes, weights, xs, rows)
            if rows <= args.compiled_max_rows:
                ways["compiled"] = functools.partial(compiled, xs, weights)
            best = dict.fromkeys(ways, float("inf"))
            for fn in ways.values():
                fn()  # first calls: oneDNN primitives, the compile
            for _ in range(args.repeats):  # interleaved, so that a busy moment hits all alike
                for name, fn in ways.items():
                    start = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - start)
            print(f"rows {rows:4d}: " + ", ".join(
                f"{name} {sec * 1e3:.1f} ({sec / best['packed']:.2f}x)"
                for name, sec in best.items()), flush=True)


def _ways(shapes: list[tuple[int, int]], weights: list[torch.Tensor],
          xs: dict[int, torch.Tensor], rows: int) -> dict[str, Callable[[], object]]:
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]

    def packed_pass() -> None:
        for k, (_, i) in enumerate(shapes):
            torch.ops.mkldnn._linear_pointwise(xs[i], packed[k], None, "none", [], "")

    def plain_pass() -> None:
        for k, (_, i) in enumerate(shapes):
            torch.ops.mkldnn._linear_pointwise(xs[i], weights[k], None, "none", [], "")

    def f_linear_pass() -> None:
        for k, (_, i) in enumerate(shapes):
            F.linear(xs[i], weights[k])

    return {"packed": packed_pass, "plain oneDNN": plain_pass, "F.linear": f_linear_pass}


if __name__ == "__main__":
    main()
