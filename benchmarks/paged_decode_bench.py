"""CPU decode attention of one layer: the compiled paged kernel (workers/attention/paged_decode.py)
against the dense copies (`torch_backend`'s other path), per batch size and length, with the
path `pages_faster` picks; SmolLM2-135M's heads (3 KV heads of 64, 3 query heads each), random
slots in a 40,000-slot pool, best of three in CPU time, one thread unless told.

    python benchmarks/paged_decode_bench.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from raydix.workers.attention import paged_decode
from raydix.workers.attention.torch_backend import pages_faster

HK, G, D, NUM_SLOTS = 3, 3, 64, 40_000


def _dense(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
           lens: torch.Tensor) -> torch.Tensor:
    """The dense path's ops: gather rows head-major, two matmuls, masked softmax."""
    num_req, num_keys = slots.shape
    rows = (slots[:, None, :] * HK + torch.arange(HK)[:, None]).reshape(-1)
    shape = (num_req, HK, num_keys, D)
    k = k_buf.view(-1, D).index_select(0, rows).view(shape)
    v = v_buf.view(-1, D).index_select(0, rows).view(shape)
    scores = torch.matmul(q, k.transpose(-1, -2)) * D ** -0.5
    past = (torch.arange(num_keys)[None, :] >= lens[:, None])[:, None, None, :]
    probs = torch.softmax(scores.float().masked_fill_(past, float("-inf")), dim=-1)
    return torch.matmul(probs, v)


def _micros(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...],
            calls: int = 100) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.process_time() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = paged_decode.warm_up(HK, D, G, torch.float32)
    if kernel is None:
        raise SystemExit("the paged kernel did not compile here")
    gen = torch.Generator().manual_seed(0)
    k_buf = torch.randn(NUM_SLOTS, HK, D, generator=gen)
    v_buf = torch.randn(NUM_SLOTS, HK, D, generator=gen)
    print(f"{'requests':>8} {'keys':>5} {'paged us':>9} {'dense us':>9} {'paged/dense':>11}  picks")
    with torch.inference_mode():
        for num_req in (1, 2, 4, 8, 16):
            for num_keys in (150, 300, 600):
                q = torch.randn(num_req, HK, G, D, generator=gen)
                slots = torch.randint(0, NUM_SLOTS, (num_req, num_keys), generator=gen)
                lens = torch.full((num_req,), num_keys)
                inputs = (q, k_buf, v_buf, slots, lens)
                paged, dense = _micros(kernel, inputs), _micros(_dense, inputs)
                pick = "paged" if pages_faster(num_req, num_keys) else "dense"
                print(f"{num_req:>8} {num_keys:>5} {paged:>9.0f} {dense:>9.0f} "
                      f"{paged / dense:>10.2f}x  {pick}", flush=True)


if __name__ == "__main__":
    main()
