"""CPU decode attention of one layer: the paged kernel (workers/attention/paged_decode.c)
against the dense copies (`torch_backend`'s other path) and against the same attention's torch
ops compiled by inductor for static head sizes (the kernel's form before the C kernel), per
batch size and length. SmolLM2-135M's heads (3 KV heads of
64, 3 query heads each), a 40,000-slot pool per layer, each request's slots one run at a random
start (as a prefill allocates them; `--random-slots`: scattered, as a pool whose slots were
freed and reused gives them), glibc keeping freed blocks as the engine does; each call on the
next of `--layers` layers' pools (30, as the model: the rows come from memory, not from a cache
that one layer's pool would stay in); best of three wall-clock means of 30 calls.

    python benchmarks/paged_decode_bench.py [--threads 2] [--dtype bfloat16] [--random-slots]
        [--requests 1 4 16] [--keys 150 600]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from raydix.workers.attention import paged_decode
from raydix.workers.host_memory import keep_freed_memory

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
    return torch.matmul(probs.to(q.dtype), v)


def _micros(fn: Callable[..., torch.Tensor], q: torch.Tensor,
            pools: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor,
            lens: torch.Tensor, calls: int = 30) -> float:
    fn(q, *pools[0], slots, lens)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i in range(calls):
            fn(q, *pools[i % len(pools)], slots, lens)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _compiled() -> Callable[..., torch.Tensor]:
    """The attention's torch ops compiled for static head sizes and dynamic batch and keys."""
    compiled = torch.compile(paged_decode.paged_decode_reference, dynamic=False, fullgraph=True)

    def run(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
            lens: torch.Tensor) -> torch.Tensor:
        for tensor, dim in ((q, 0), (slots, 0), (slots, 1), (lens, 0)):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        out: torch.Tensor = compiled(q, k_buf, v_buf, slots, lens)
        return out

    return run


def _slots(num_req: int, num_keys: int, scattered: bool, gen: torch.Generator) -> torch.Tensor:
    if scattered:
        return torch.randint(0, NUM_SLOTS, (num_req, num_keys), generator=gen)
    starts = torch.randint(0, NUM_SLOTS - num_keys, (num_req, 1), generator=gen)
    return starts + torch.arange(num_keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--random-slots", action="store_true", help="scattered slots")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--keys", type=int, nargs="+", default=[64, 150, 300, 600, 1000])
    parser.add_argument("--layers", type=int, default=30, help="pools called in turn")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    kernel = paged_decode.warm_up(HK, D, G, dtype)
    if kernel is None:
        raise SystemExit("the paged kernel could not be built here")
    compiled = _compiled()
    gen = torch.Generator().manual_seed(0)
    pools = [(torch.randn(NUM_SLOTS, HK, D, generator=gen).to(dtype),
              torch.randn(NUM_SLOTS, HK, D, generator=gen).to(dtype))
             for _ in range(args.layers)]
    print(f"{args.threads} threads, {args.dtype}, {args.layers} layers' pools, "
          f"{'scattered' if args.random_slots else 'one run per request'}")
    print(f"{'requests':>8} {'keys':>5} {'paged us':>9} {'dense us':>9} {'inductor us':>11} "
          f"{'paged/dense':>11} {'paged/inductor':>14}")
    with torch.inference_mode():
        for num_req in args.requests:
            for num_keys in args.keys:
                q = torch.randn(num_req, HK, G, D, generator=gen).to(dtype)
                slots = _slots(num_req, num_keys, args.random_slots, gen)
                lens = torch.full((num_req,), num_keys)
                paged = _micros(kernel, q, pools, slots, lens)
                dense = _micros(_dense, q, pools, slots, lens)
                old = _micros(compiled, q, pools, slots, lens)
                print(f"{num_req:>8} {num_keys:>5} {paged:>9.0f} {dense:>9.0f} {old:>11.0f} "
                      f"{paged / dense:>10.2f}x {paged / old:>13.2f}x", flush=True)


if __name__ == "__main__":
    main()
