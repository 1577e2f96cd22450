"""Causal attention of an extend (a prompt, or a chunk of one after its cached prefix) on the
CPU in a kernel (`extend_kernel.c`): in bf16 with its products on the AMX tiles where the CPU has
them, else as AVX-512-BF16 dot products, where torch's flash kernel (AMX) or row blocks of
products (block_causal.py, without AMX) ran; in float32 as AVX-512 multiply-adds, where torch's
flash kernel ran.

On AMX: torch's CPU flash kernel runs its products on the tiles too (through oneDNN's small-GEMM
calls), but takes 1.1-1.6 ms a layer for a 512-token prompt of SmolLM2-135M (9 query heads, 3
key heads, 64 dims) on two cores of an AMX Xeon; the kernel here, 16 query rows a task with
their scores, softmax and weighted values in one pass, 0.55x that (0.58x for 64 tokens after
512 cached, 0.56x for 512 after 512, 0.71x for 2,048 new tokens; `attention_bench.py`).
Without AMX (an AMD EPYC Zen 5 with AVX-512-BF16, two cores), the dot products' kernel against
the row blocks: 0.35x their time at 512 new tokens, 0.25-0.41x for 64-1,024, 0.40-0.48x after a
512-token prefix, 0.62x for 64 after 2,048 (`attention_bench.py`). The bf16 results equal a
float32 reference as closely as flash's do (float32 scores and sums, the weights rounded to bf16
for their product with the values, the output rounded once); the float32 kernel's within a few
float32 roundings of it, as flash's.

Built at first use: the tiles' kernel where the CPU has AMX and Linux grants the tiles
(`cpu_features.amx_granted`), else the dot products' where it has AVX-512-BF16, and the float32
kernel where it has AVX-512; elsewhere `available(dtype=...)` is False and the backend keeps its
other paths.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from ..cpu_features import amx_granted, avx512, avx512_bf16
from ..native_build import NativeBuildError, load

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("extend_kernel.c")
HEAD_DIMS = (64, 128)  # the kernel's tiles: 64 dims take four at a time, 128 two rounds

# each kind of product with the dtype it computes; per dtype the first the CPU has is served
KERNELS = {"tiles": torch.bfloat16, "dot products": torch.bfloat16, "fma": torch.float32}
_DEFINES = {"tiles": {"TILES": 1, "F32": 0}, "dot products": {"TILES": 0, "F32": 0},
            "fma": {"TILES": 0, "F32": 1}}
_ARGTYPES = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]

_libs: dict[str, ctypes.CDLL] = {}
_failed: dict[str, str] = {}


@functools.cache
def kernels() -> tuple[str, ...]:
    """The kinds this CPU runs, each dtype's served one first (tests run each)."""
    has = {"tiles": amx_granted, "dot products": avx512_bf16, "fma": avx512}
    return tuple(kind for kind in KERNELS if has[kind]())


def kernel(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """The kind `attention` runs for `dtype` by default: the first this CPU runs, None where
    none."""
    return next((kind for kind in kernels() if KERNELS[kind] == dtype), None)


def available(kind: str | None = None, dtype: torch.dtype = torch.bfloat16) -> bool:
    """The kernel (`kind`, else the one served for `dtype`) is built or loaded; False, logged
    once, where the CPU lacks it or it does not build."""
    kind = kind or kernel(dtype)
    if kind is None:
        return False
    if kind in _libs:
        return True
    if kind in _failed or kind not in kernels():
        return False
    try:
        _libs[kind] = load(SOURCE, _DEFINES[kind], {"extend_attention": _ARGTYPES})
    except (NativeBuildError, OSError) as exc:
        _failed[kind] = str(exc)
        logger.warning("prompt attention stays with its other paths: the %s kernel could not "
                       "be built: %s", kind, exc)
        return False
    return True


def serves(q: torch.Tensor, num_kv_heads: int) -> bool:
    """A kernel takes these queries [n, Hq, D]: on CPU, in a dtype it computes, a head size it
    tiles, whole query groups per key head, and it is available."""
    return (q.device.type == "cpu" and q.dim() == 3 and q.shape[2] in HEAD_DIMS
            and q.shape[1] % num_kv_heads == 0 and available(dtype=q.dtype))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              out: torch.Tensor | None = None, kind: str | None = None,
              rows: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of `q` [n, Hq, D], the last n of the L positions of `k`, `v`
    [Hk, L, D] (all of q's dtype): each query sees the keys up to its own position. Given
    `rows` (int64 [Hk * L]: key head h's L row numbers from h * L), `k` and `v` are the KV
    pool's buffers of a layer, read in place as [rows, D]: no copy of the request's keys and
    values gathered first. Into `out` [n, Hq, D] (contiguous) when given; `kind` of KERNELS,
    else the one served for q's dtype."""
    kind = kind or kernel(q.dtype)
    assert kind is not None and available(kind), "available() first"
    lib = _libs[kind]
    n, num_q_heads, head_dim = q.shape
    if rows is None:
        num_kv_heads, num_keys, _ = k.shape
        address = 0
    else:
        num_kv_heads = k.shape[-2] if k.dim() == 3 else 0
        num_keys = rows.numel() // num_kv_heads if num_kv_heads else 0
        pool_rows = k.numel() // head_dim
        if (k.dim() != 3 or rows.dtype != torch.int64 or not rows.is_contiguous()
                or rows.numel() != num_kv_heads * num_keys or not k.is_contiguous()
                or not v.is_contiguous() or (num_keys and not 0 <= int(rows.min())
                                             <= int(rows.max()) < pool_rows)):
            raise ValueError(f"extend attention on the pool: rows {tuple(rows.shape)} "
                             f"{rows.dtype} against buffers k {tuple(k.shape)}, v "
                             f"{tuple(v.shape)}")
        address = rows.data_ptr()
    if (num_keys < n or v.shape != k.shape or k.shape[-1] != head_dim
            or {q.dtype, k.dtype, v.dtype} != {KERNELS[kind]}):
        raise ValueError(f"extend attention ({kind}, {KERNELS[kind]}): q {tuple(q.shape)} "
                         f"{q.dtype} against k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} "
                         f"{v.dtype}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dst = out if out is not None and out.is_contiguous() else torch.empty_like(
        q, memory_format=torch.contiguous_format)
    if n:
        lib.extend_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), address, dst.data_ptr(),
                             n, num_keys, num_q_heads, num_kv_heads, head_dim, scale,
                             torch.get_num_threads())
    if out is not None and dst is not out:
        out.copy_(dst)
    return dst if out is None else out
