"""Linear layers of a few rows on a plain bf16 weight (CPU, AVX-512 BF16): `small_gemm.c`.

The CPU decode graph keeps the decoder layers' weights plain (one copy, read by its one-row
multiply-and-sum), so a decode step of several requests multiplies them unpacked, and the GEMM
library then reads each weight at a fraction of the memory bandwidth (30 layers of SmolLM2's
shapes, two threads, cold caches: 18-20 ms at 1-4 rows and 26 ms at 16 against 10-12 and 15 ms
on oneDNN-packed weights). This kernel reads each weight block once for all the rows: 7-8 ms at
1-4 rows, 16-18 ms at 8-16 (`benchmarks/small_gemm_bench.py`). It runs as the
`raydix::small_gemm` operator, so the batched decode graph calls it as one opaque step; larger
products, and every other dtype or device, stay torch's.

Built with the host compiler at start (`warm_up`, under a second, then loaded from
`~/.cache/raydix/kernels`); where the CPU has no AVX-512 BF16 or no compiler works, it is not
used and torch's product runs, as before.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ..native_build import NativeBuildError, load

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("small_gemm.c")
# more rows than this: torch's product (at 64 rows the GEMM library is as fast)
MAX_ROWS = 32

_library: ctypes.CDLL | None = None


def warm_up() -> bool:
    """Build (or load) the kernel; False, logged once, where it cannot run here."""
    global _library
    if _library is not None:
        return True
    argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    try:
        lib = load(SOURCE, {}, {"small_gemm_bf16": argtypes})
    except (NativeBuildError, OSError) as exc:
        logger.warning("bf16 products of a few rows use torch's GEMM on the plain weights: the "
                       "small-GEMM kernel could not be built: %s", exc)
        return False
    if not lib.small_gemm_native():
        logger.info("bf16 products of a few rows use torch's GEMM: this CPU has no AVX-512 BF16")
        return False
    _library = lib
    return True


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x @ weight.T` goes through the kernel: built here, bf16 rows on the CPU against
    a plain contiguous `[out, in]` bf16 weight."""
    return (_library is not None and x.dim() == 2 and weight.dim() == 2
            and x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.is_contiguous()
            and x.shape[1] == weight.shape[1])


@torch.library.custom_op("raydix::small_gemm", mutates_args=())
def small_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T`: the kernel up to MAX_ROWS rows where it `serves` them, torch's product
    otherwise."""
    rows, out_features = x.shape[0], weight.shape[0]
    if _library is None or rows > MAX_ROWS or rows == 0 or not serves(x, weight):
        return torch.mm(x, weight.t())
    x = x.contiguous()
    y = torch.empty(rows, out_features, dtype=x.dtype)
    _library.small_gemm_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, out_features,
                             x.shape[1], torch.get_num_threads())
    return y


@small_gemm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
