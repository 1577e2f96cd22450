"""Decode attention that reads K/V from the pool's pages in place (CPU).

One query token per request attends to the K/V at its slots. Written as plain torch ops, the
slot lookup `k_buf[slots]` would copy every request's keys and values into a dense tensor per
layer (at 64 requests of 400 tokens that copy dominates the step). Compiled by torch's own
compiler (inductor), the lookup is fused into the reductions that read it: each key row is read
from its page once and nothing dense is built (at 16 and 64 requests of 64-1000 keys 0.29-0.73x
the dense copies' time, 2 threads, AVX2; see `pages_faster` in torch_backend.py).

The compiled kernel is built once per process at start (`warm_up`): the first start on a machine
compiles it (about 10-30 s on 2 cores); inductor keeps the result in its on-disk cache
(`TORCHINDUCTOR_CACHE_DIR`, by default under /tmp), so later starts load it in about a second.
Without a working C++ compiler the plain torch version runs, and a warning says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                  torch.Tensor]
# Sizes of 0 and 1 are compiled apart (one request, one KV head per rank, ...), and so is each
# dtype: a process that runs several models (the tests) needs more than dynamo's default of 8.
RECOMPILE_LIMIT = 64


def paged_decode_reference(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                           slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Softmax(q K^T / sqrt(D)) V for q `[B, Hk, G, D]` (G query heads per KV head); k_buf / v_buf `[num_slots, Hk, D]`;
    slots `[B, L]` int64, of which the first `lens[b]` are request b's; returns `[B, Hk, G, D]`
    in q's dtype. Scores and softmax in fp32. Uncompiled it builds large dense temporaries: it is
    the source of the compiled kernel and the tests' reference, not a fallback."""
    num_keys = slots.shape[1]
    k = k_buf[slots].float()  # [B, L, Hk, D]
    scale = q.shape[-1] ** -0.5
    scores = (q.float()[:, None] * k[:, :, :, None, :]).sum(-1) * scale  # [B, L, Hk, G]
    past = torch.arange(num_keys, device=q.device)[None, :] >= lens[:, None]
    scores = scores.masked_fill(past[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    v = v_buf[slots].float()
    return (probs[..., None] * v[:, :, :, None, :]).sum(1).to(q.dtype)


_compiled: Kernel | None = None
_failed = False


def _compile() -> Kernel:
    """The kernel compiled for static head sizes (a model's heads never change) and a dynamic
    batch, key count and pool size: with every size dynamic, inductor left the softmax to one
    thread and kept runtime tails on the head dimension, 1.3-1.6x slower (2 threads, 4-64
    requests of 128-1000 keys; `benchmarks/paged_decode_bench.py`)."""
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    compiled = torch.compile(paged_decode_reference, dynamic=False, fullgraph=True)

    def kernel(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
               lens: torch.Tensor) -> torch.Tensor:
        if q.shape[0] < 2 or slots.shape[1] < 2:  # torch would compile a graph of its own
            return paged_decode_reference(q, k_buf, v_buf, slots, lens)  # for a size of 1
        for tensor, dim in ((q, 0), (k_buf, 0), (v_buf, 0), (slots, 0), (slots, 1), (lens, 0)):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)  # sizes 0 and 1 stay apart
        return compiled(q, k_buf, v_buf, slots, lens)

    return kernel


def warm_up(num_kv_heads: int, head_dim: int, group: int, dtype: torch.dtype) -> Kernel | None:
    """The compiled kernel, built for these head shapes, or None where it cannot be compiled.
    Called at start, so that no step waits for the compiler. One graph serves every batch and
    key count from 2 (the engine calls it from `PAGED_MIN_REQUESTS` requests of
    `PAGED_MIN_LEN` keys); a size of 1, which torch would compile apart, runs the plain ops
    (one graph less to load at every start: about 0.5-1.5 s on 2 cores)."""
    global _compiled, _failed
    if _failed:
        return None
    kernel = _compiled or _compile()
    start = time.perf_counter()
    # The graphs are kept for inputs like these, so they must look like a step's: K and V
    # are two tensors (one tensor passed as both is compiled for that aliasing, and the first
    # real step compiles again), and the batch, key and slot counts differ from the head
    # sizes (dynamo unifies equal sizes and guards on the equality).
    batch, num_keys, num_slots = _sizes_apart((num_kv_heads, group, head_dim), 3)
    k_buf = torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype)
    v_buf = torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype)
    try:
        with torch.inference_mode():
            q = torch.zeros(batch, num_kv_heads, group, head_dim, dtype=dtype)
            slots = torch.arange(batch * num_keys).view(batch, num_keys) % num_slots
            kernel(q, k_buf, v_buf, slots, torch.full((batch,), num_keys - 1))
    except Exception as exc:  # no C++ compiler, or an inductor limit: the plain ops still work
        _failed = True
        logger.warning("decode attention runs uncompiled (dense K/V copies per layer): "
                       "torch.compile failed: %s", exc)
        return None
    if _compiled is None:
        logger.info("decode attention compiled in %.1f s (kept in inductor's on-disk cache)",
                    time.perf_counter() - start)
    _compiled = kernel
    return kernel


def _sizes_apart(taken: tuple[int, ...], count: int) -> list[int]:
    """`count` distinct sizes >= 2, none of them in `taken`, in increasing order."""
    sizes: list[int] = []
    size = 2
    while len(sizes) < count:
        if size not in taken:
            sizes.append(size)
        size += 1
    return sizes
