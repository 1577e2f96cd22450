"""Which weights a runner with the CPU decode graph packs for oneDNN: the LM head in bf16 always
and in float32 where timed faster at start; every linear layer in bf16 on a CPU with native bf16
(AMX tiles or AVX-512-BF16), and in float32 on a CPU with AVX-512 (`layers_packed`, below).

The graph (cpu_decode_graph.py) computes a one-row product as multiply-and-sum on the plain
weight, which inductor turns into one parallel loop that reads each weight row once. In bf16
its LM head is packed always (`PACKED_HEAD_DTYPES`). In float32 which of the two is faster
depends on the CPU: on an AMD EPYC the packed head lost one stream (0.86-0.95x); on an Intel
Xeon with AMX (family 6 model 207, two threads, SmolLM2-135M's 113 MB head) oneDNN's one-row
product took 5.8-6.5 ms against 7.2-7.6 for the compiled multiply-and-sum, and decode steps of
one stream 41-47 ms against 51-52 with the head plain (three alternated runs of 200 steps each).
So the runner times both on the model's own head weight and packs it where oneDNN is clearly
faster.

bf16 on a CPU with native bf16: the decoder layers too. With AMX, oneDNN's bf16 products run on
the tiles, on packed weights, and time one row about as the graph's multiply-and-sum on the
plain weights and several rows much faster than torch's product on them (which reorders the
weight at each call). On the Intel Xeon above, SmolLM2-135M, two threads, both graphs, one
process, two engines alternated (three runs each, every layer packed / all plain but the head):
one stream 0.95-1.11x (median 1.09), four streams 1.18-1.33x (1.26), shared prefix 1.02-1.11x
(1.10), mixed 0.81-1.18x (1.01), a lone 512-token prompt's TTFT 0.90-1.36x (0.91, lower is
better). With AVX-512-BF16 and no AMX the packed weights' few-row products take the dot
products' kernel (layers/packed_gemv.py: 1-32 rows, 0.25-0.46x the time of `small_gemm` on
the plain weights on an AMD EPYC Zen 5, 30 layers' weights) and prompts oneDNN's product
without the per-call reorder (0.79x at 512 rows); the same A/B there (three runs each): one
stream 0.92-1.10x (1.05), four streams 1.58-1.77x (1.74), shared prefix 1.03-1.15x (1.15),
mixed 1.12-1.33x (1.18), TTFT 0.94-0.96x (0.96).

float32 with AVX-512: the decoder layers too, their few-row products on the float32 kernel of
layers/packed_gemv.py (up to 8 rows; oneDNN's product on the packed weight for more, and for
prompts). On the AMD EPYC Zen 5, the same A/B (two engines in one process, three rounds): one
stream 0.96-1.06x (1.00), four streams 1.21-1.32x (1.31), shared prefix 1.03-1.05x (1.03),
mixed 1.03-1.23x (1.19), TTFT 0.87-0.99x (0.98). Before that kernel the packed layers' one-row
products were oneDNN's, and one stream lost (0.85x: session 32). Without AVX-512 float32 keeps its
decoder layers plain.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .cpu_decode_graph import PACKED_HEAD_DTYPES
from .cpu_features import native_bf16
from .layers import packed_gemv
from .layers.embedding import ParallelLMHead
from .layers.packed import MIN_MEASURED_WEIGHTS, linear, pack_weight

logger = logging.getLogger(__name__)

# the packed product must take at most this share of the multiply-and-sum's time: the two are
# within noise of each other on some CPUs, and a pick that flips between restarts is worse
# than either
PACKED_HEAD_MAX_SHARE = 0.9


def layers_packed(dtype: torch.dtype) -> bool:
    """Whether a runner with the CPU decode graph packs every linear layer, the decoder layers'
    too (each packed weight its layer's only copy): bf16 on a CPU with native bf16 (AMX tiles
    or AVX-512-BF16), float32 where the packed-weight kernel reads float32 weights (AVX-512)."""
    if dtype == torch.bfloat16:
        return native_bf16()
    return dtype == torch.float32 and packed_gemv.warm_up()


def head_packed(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a runner with the CPU decode graph packs `model`'s LM head: always in the
    `PACKED_HEAD_DTYPES`, in float32 where `packed_head_pays` on this CPU."""
    if dtype in PACKED_HEAD_DTYPES:
        return True
    heads = [m.weight for m in model.modules()
             if isinstance(m, ParallelLMHead) and isinstance(m.weight, torch.Tensor)]
    return len(heads) == 1 and packed_head_pays(heads[0])


def _multiply_and_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x[:, None, :] * weight[None]).sum(-1)


def packed_head_pays(weight: torch.Tensor, rounds: int = 5, calls: int = 3) -> bool:
    """Time oneDNN's one-row product on `weight` packed against the graph's compiled
    multiply-and-sum on it plain (alternating, best of `rounds` runs of `calls`); True where
    packed takes at most `PACKED_HEAD_MAX_SHARE` of the time. A weight too small to tell
    (`MIN_MEASURED_WEIGHTS`) stays plain without timing. Logged."""
    if weight.dtype != torch.float32 or weight.numel() < MIN_MEASURED_WEIGHTS:
        return False
    best = _time_both(weight, rounds, calls)
    pays = best["packed"] <= PACKED_HEAD_MAX_SHARE * best["plain"]
    logger.info("CPU decode graph: float32 LM head %s (one row: oneDNN packed %.2f ms, "
                "multiply-and-sum %.2f ms; packed from %.0f%% of the time)",
                "packed" if pays else "plain", best["packed"] * 1e3, best["plain"] * 1e3,
                PACKED_HEAD_MAX_SHARE * 100)
    return pays


def _time_both(weight: torch.Tensor, rounds: int, calls: int) -> dict[str, float]:
    """Seconds a one-row product takes, "packed" and "plain" (the best of `rounds`)."""
    mulsum: Any = torch.compile(_multiply_and_sum, dynamic=False, fullgraph=True)
    x = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0))
    packed = pack_weight(weight, 1)
    runs: dict[str, Callable[[], object]] = {
        "packed": lambda: linear(x, None, packed), "plain": lambda: mulsum(x, weight)}
    best = {name: float("inf") for name in runs}
    for run in runs.values():
        run()  # compiles / builds oneDNN's primitive
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best
