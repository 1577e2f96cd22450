"""CPU extend attention in bf16 or float32: torch's flash kernel (SDPA, GQA native) against the
row blocks of `workers/attention/block_causal.py` (served in bf16 only) and, where the CPU has
one for the dtype, the kernel (`workers/attention/extend_kernel.py`: bf16 on AMX tiles or as
AVX-512-BF16 dot products, float32 as AVX-512 multiply-adds; the kind served here, or
`--kernel`), the same inputs, one after the other per shape; prints each one's median and the
ratios (blocks / flash, kernel / flash and kernel / blocks time, lower is better).

    python benchmarks/attention_bench.py [--threads 2] [--heads 9 3 64] [--repeats 30]
                                         [--dtype bfloat16|float32]
                                         [--kernel tiles|"dot products"|fma]

Default heads: SmolLM2-135M's (9 query heads, 3 KV heads of 64). Shapes: whole prompts of
64-1,024 tokens, and chunks after a prefix (a shared prefix's question, a chunked prompt's
second chunk, a question after a long conversation).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from raydix.workers.attention import extend_kernel
from raydix.workers.attention.block_causal import block_causal_attention
from raydix.workers.host_memory import keep_freed_memory

SHAPES = [(0, 64), (0, 256), (0, 512), (0, 1024), (512, 64), (512, 512), (1024, 512),
          (2048, 64)]  # (prefix, new tokens)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def _time_shape(prefix: int, n: int, heads: list[int], repeats: int, gen: torch.Generator,
                kind: str | None, dtype: torch.dtype) -> tuple[float, float, float]:
    """Median ms of the flash kernel, the blocks and the kernel of `kind` (nan without one) on
    one shape."""
    num_q, num_kv, dim = heads
    scale = dim ** -0.5
    q = torch.randn(num_q, n, dim, generator=gen).to(dtype)
    k = torch.randn(num_kv, prefix + n, dim, generator=gen).to(dtype)
    v = torch.randn(num_kv, prefix + n, dim, generator=gen).to(dtype)
    mask = (torch.arange(prefix + n)[None, :] <= torch.arange(n)[:, None] + prefix
            if prefix else None)

    def flash() -> torch.Tensor:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                              is_causal=mask is None, scale=scale,
                                              enable_gqa=True)

    def blocks() -> torch.Tensor:
        return block_causal_attention(q, k, v, prefix, scale)

    def kernel() -> torch.Tensor:
        return extend_kernel.attention(q_tokens, k, v, scale, kind=kind)

    q_tokens = q.transpose(0, 1).contiguous()  # the kernel takes [n, Hq, D]
    in_kernel = (_median_ms(kernel, repeats) if kind and extend_kernel.serves(q_tokens, num_kv)
                 else float("nan"))
    return _median_ms(flash, repeats), _median_ms(blocks, repeats), in_kernel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64],
                        metavar=("Q_HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--kernel", choices=list(extend_kernel.KERNELS),
                        help="the kernel's kind (its dtype); default: the one served here")
    args = parser.parse_args()
    dtype = extend_kernel.KERNELS[args.kernel] if args.kernel else getattr(torch, args.dtype)
    kind = args.kernel or extend_kernel.kernel(dtype)
    if kind is not None and not extend_kernel.available(kind):
        raise SystemExit(f"no {kind} kernel on this CPU")
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as a CPU runner does: freed scores are reused, not faulted in again
    num_q, num_kv, dim = args.heads
    print(f"{dtype}, {num_q}/{num_kv} heads of {dim}, {args.threads} threads, kernel: "
          f"{kind or 'none here'}; median ms")
    print(f"{'prefix':>6} {'new':>5} {'flash':>8} {'blocks':>8} {'kernel':>8} {'blocks/f':>8} "
          f"{'kernel/f':>8} {'kernel/b':>8}")
    gen = torch.Generator().manual_seed(0)
    for prefix, n in SHAPES:
        flash_ms, blocks_ms, kernel_ms = _time_shape(prefix, n, args.heads, args.repeats, gen,
                                                     kind, dtype)
        print(f"{prefix:>6} {n:>5} {flash_ms:>8.3f} {blocks_ms:>8.3f} {kernel_ms:>8.3f} "
              f"{blocks_ms / flash_ms:>8.2f} {kernel_ms / flash_ms:>8.2f} "
              f"{kernel_ms / blocks_ms:>8.2f}")


if __name__ == "__main__":
    main()
