"""Decode attention that reads K/V from the pool's pages in place (CPU).

One query token per request attends to the K/V at its slots. Written as plain torch ops, the
slot lookup `k_buf[slots]` would copy every request's keys and values into a dense tensor per
layer (at 64 requests of 400 tokens that copy dominates the step). The kernel here
(`paged_decode.c`) reads each key and value row from its page once, in one pass with an online
softmax, on torch's OpenMP threads: SmolLM2-135M's heads, two threads, bf16, 0.19-0.29x the time
of the same ops compiled by torch's inductor, its form before (`benchmarks/paged_decode_bench.py`).
Requests whose rows start with the same slots (a prefix the radix cache gave them all) read that
prefix once, all their queries in one pass over it, then each its own keys (the C file's
header): the decode graphs get what the eager step's cascade (cascade.py) does, inside the one
operator.

It is built for the model's head sizes at start (`warm_up`: a C file, under a second the first
time on a machine, then loaded from `~/.cache/raydix/kernels`) and runs as the `raydix::
paged_decode` operator, so that the compiled decode graphs (cpu_decode_graph.py) call it as one
opaque step. Where no C compiler works, `warm_up` returns None and says why: the eager step
then reads dense copies, and the graphs trace the plain ops (`paged_decode_reference`).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..native_build import NativeBuildError, load

logger = logging.getLogger(__name__)

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                  torch.Tensor]
SOURCE = Path(__file__).with_name("paged_decode.c")
DTYPES = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}

# (head_dim, group) -> the library built for those head sizes
_libraries: dict[tuple[int, int], ctypes.CDLL] = {}
_failed: str | None = None  # why the build failed, once it has


def paged_decode_reference(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                           slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Softmax(q K^T / sqrt(D)) V for q `[B, Hk, G, D]` (G query heads per KV head); k_buf / v_buf `[num_slots, Hk, D]`;
    slots `[B, L]` int64, of which the first `lens[b]` are request b's; returns `[B, Hk, G, D]`
    in q's dtype. Scores and softmax in fp32. It builds large dense temporaries: the tests'
    reference, and what the graphs trace where the kernel cannot be built."""
    num_keys = slots.shape[1]
    k = k_buf[slots].float()  # [B, L, Hk, D]
    scale = q.shape[-1] ** -0.5
    scores = (q.float()[:, None] * k[:, :, :, None, :]).sum(-1) * scale  # [B, L, Hk, G]
    past = torch.arange(num_keys, device=q.device)[None, :] >= lens[:, None]
    scores = scores.masked_fill(past[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    v = v_buf[slots].float()
    return (probs[..., None] * v[:, :, :, None, :]).sum(1).to(q.dtype)


def _library(head_dim: int, group: int) -> ctypes.CDLL:
    lib = _libraries.get((head_dim, group))
    if lib is None:
        argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int]
        lib = load(SOURCE, {"HEAD_DIM": head_dim, "GROUP": group},
                   dict.fromkeys(DTYPES.values(), argtypes))
        _libraries[(head_dim, group)] = lib
    return lib


@torch.library.custom_op("raydix::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
    """`paged_decode_reference`'s result, computed by the kernel on the pages in place where it
    takes these inputs (`_takes`), by the reference otherwise."""
    if not _takes(q, k_buf, v_buf, slots, lens):
        return paged_decode_reference(q, k_buf, v_buf, slots, lens)
    batch, num_kv_heads, group, head_dim = q.shape
    q, slots, lens = q.contiguous(), slots.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    scratch = torch.empty(3 * batch + 1, dtype=torch.int64)  # the kernel's row order and parts
    fn = getattr(_library(head_dim, group), DTYPES[q.dtype])
    fn(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), slots.data_ptr(), lens.data_ptr(),
       out.data_ptr(), scratch.data_ptr(), batch, slots.shape[1], num_kv_heads,
       head_dim ** -0.5, torch.get_num_threads())
    return out


@paged_decode.register_fake
def _(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
      lens: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def supports(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
             lens: torch.Tensor) -> bool:
    """Whether the kernel serves these inputs: built for their head sizes and takes them."""
    _, _, group, head_dim = q.shape
    return (head_dim, group) in _libraries and _takes(q, k_buf, v_buf, slots, lens)


def _takes(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
           lens: torch.Tensor) -> bool:
    """q `[B, Hk, G, D]` and the buffers of one supported dtype on the CPU, the buffers
    contiguous `[num_slots, Hk, D]`, slots `[B, L]` and lengths `[B]` int64."""
    batch, num_kv_heads, _, head_dim = q.shape
    return (q.dtype in DTYPES and q.device.type == "cpu"
            and k_buf.device.type == v_buf.device.type == "cpu"
            and k_buf.dtype == v_buf.dtype == q.dtype
            and k_buf.shape[1:] == v_buf.shape[1:] == (num_kv_heads, head_dim)
            and k_buf.is_contiguous() and v_buf.is_contiguous()
            and slots.dtype == lens.dtype == torch.int64 and slots.dim() == 2
            and slots.shape[0] == lens.shape[0] == batch)


def attend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
           lens: torch.Tensor) -> torch.Tensor:
    """Decode attention on the pages: the kernel where it serves the inputs, else the plain
    ops (what the compiled graphs call; decided once, as they are traced)."""
    if supports(q, k_buf, v_buf, slots, lens):
        out: torch.Tensor = torch.ops.raydix.paged_decode(q, k_buf, v_buf, slots, lens)
        return out
    return paged_decode_reference(q, k_buf, v_buf, slots, lens)


def warm_up(num_kv_heads: int, head_dim: int, group: int, dtype: torch.dtype) -> Kernel | None:
    """The kernel, built (or loaded) for these head sizes, or None where it cannot be: another
    dtype, or no working C compiler (logged once). Called at start, so no step waits for the
    compiler."""
    global _failed
    if dtype not in DTYPES:
        logger.info("decode attention reads dense copies: no paged kernel for %s", dtype)
        return None
    if _failed is not None:
        return None
    start = time.perf_counter()
    try:
        _library(head_dim, group)
    except (NativeBuildError, OSError) as exc:
        _failed = str(exc)
        logger.warning("decode attention reads dense K/V copies per layer: the paged kernel "
                       "could not be built: %s", exc)
        return None
    logger.info("paged decode kernel for %d KV heads of %d (%d queries each) ready in %.2f s",
                num_kv_heads, head_dim, group, time.perf_counter() - start)
    kernel: Kernel = torch.ops.raydix.paged_decode
    return kernel
