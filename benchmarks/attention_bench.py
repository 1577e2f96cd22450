"""CPU extend attention in bf16: torch's flash kernel (SDPA, GQA native) against the row blocks
of `workers/attention/block_causal.py` and, where the CPU has AMX tiles, the kernel on them
(`workers/attention/extend_amx.py`), the same inputs, one after the other per shape; prints
each one's median and the ratios (blocks / flash and tiles / flash time, lower is better).

    python benchmarks/attention_bench.py [--threads 2] [--heads 9 3 64] [--repeats 30]

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

from raydix.workers.attention import extend_amx
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


def _time_shape(prefix: int, n: int, heads: list[int], repeats: int,
                gen: torch.Generator) -> tuple[float, float, float]:
    """Median ms of the flash kernel, the blocks and the tiles (nan without them) on one
    shape."""
    num_q, num_kv, dim = heads
    scale = dim ** -0.5
    q = torch.randn(num_q, n, dim, generator=gen).bfloat16()
    k = torch.randn(num_kv, prefix + n, dim, generator=gen).bfloat16()
    v = torch.randn(num_kv, prefix + n, dim, generator=gen).bfloat16()
    mask = (torch.arange(prefix + n)[None, :] <= torch.arange(n)[:, None] + prefix
            if prefix else None)

    def flash() -> torch.Tensor:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                              is_causal=mask is None, scale=scale,
                                              enable_gqa=True)

    def blocks() -> torch.Tensor:
        return block_causal_attention(q, k, v, prefix, scale)

    def tiles() -> torch.Tensor:
        return extend_amx.attention(q_tokens, k, v, scale)

    q_tokens = q.transpose(0, 1).contiguous()  # the tiles take [n, Hq, D]
    on_tiles = _median_ms(tiles, repeats) if extend_amx.serves(q_tokens, num_kv) else float("nan")
    return _median_ms(flash, repeats), _median_ms(blocks, repeats), on_tiles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64],
                        metavar=("Q_HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as a CPU runner does: freed scores are reused, not faulted in again
    num_q, num_kv, dim = args.heads
    print(f"bf16, {num_q}/{num_kv} heads of {dim}, {args.threads} threads; median ms")
    print(f"{'prefix':>6} {'new':>5} {'flash':>8} {'blocks':>8} {'tiles':>8} {'blocks/f':>8} "
          f"{'tiles/f':>8}")
    gen = torch.Generator().manual_seed(0)
    for prefix, n in SHAPES:
        flash_ms, blocks_ms, tiles_ms = _time_shape(prefix, n, args.heads, args.repeats, gen)
        print(f"{prefix:>6} {n:>5} {flash_ms:>8.3f} {blocks_ms:>8.3f} {tiles_ms:>8.3f} "
              f"{blocks_ms / flash_ms:>8.2f} {tiles_ms / flash_ms:>8.2f}")


if __name__ == "__main__":
    main()
