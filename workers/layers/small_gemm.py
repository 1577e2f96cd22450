"""Linear layers of a few rows on a plain weight (CPU): `small_gemm.c`, in bf16 (AVX-512 BF16)
and float32 (AVX2 + FMA).

The CPU decode graph keeps the decoder layers' weights plain (one copy, read by its one-row
multiply-and-sum), so a decode step of several requests multiplies them unpacked, and the GEMM
library then reads each weight at a fraction of the memory bandwidth. bf16 (30 layers of
SmolLM2's shapes, two threads, cold caches): 18-20 ms at 1-4 rows and 26 ms at 16 against 10-12
and 15 ms on oneDNN-packed weights; the kernel 7-8 ms at 1-4 rows, 16-18 ms at 8-16. float32 on
an AVX2 Zen 3 (425 MB of weights, 21.8 ms at the machine's 19.5 GB/s): oneDNN on the plain
weights 42-66 ms at 2-16 rows (`benchmarks/small_gemm_bench.py --dtype float32`). The kernel
reads each weight block once for all the rows. It runs as the `raydix::small_gemm` operator,
so the batched decode graph calls it as one opaque step; larger products, and every other
dtype or device, stay torch's.

Built with the host compiler at start (`warm_up`, under a second, then loaded from
`~/.cache/raydix/kernels`); a dtype whose instructions the CPU lacks (AVX-512 BF16 for bf16,
AVX2 and FMA for float32), or a machine where no compiler works, keeps torch's product.
"""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path

import torch

from ..native_build import NativeBuildError, load

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("small_gemm.c")
# more rows than this: the GEMM library's product (bf16: at 64 rows the GEMM library is as fast;
# float32 on a Zen 3, 30 layers: the lanes kernel 111-122 ms at 64 rows against 142-165 for
# oneDNN on the plain weight, at 128 rows as fast)
MAX_ROWS = {torch.bfloat16: 32, torch.float32: 64}

# the rows `tune` times the kernel at against the library's product, up to MAX_ROWS
TUNE_ROWS = (2, 8, 32)

_library: ctypes.CDLL | None = None
_DTYPES: frozenset[torch.dtype] = frozenset()  # what the built kernel computes on this CPU
_limits: dict[torch.dtype, int] = {}  # the kernel's rows as `tune` measured them on this CPU


def warm_up() -> bool:
    """Build (or load) the kernel; False, logged once, where it runs for no dtype here."""
    global _library, _DTYPES
    if _library is not None:
        return True
    argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    try:
        lib = load(SOURCE, {}, {"small_gemm_bf16": argtypes, "small_gemm_f32": argtypes})
    except (NativeBuildError, OSError) as exc:
        logger.warning("products of a few rows use torch's GEMM on the plain weights: the "
                       "small-GEMM kernel could not be built: %s", exc)
        return False
    dtypes = {dtype for dtype, native in ((torch.bfloat16, lib.small_gemm_native()),
                                          (torch.float32, lib.small_gemm_f32_native())) if native}
    if torch.bfloat16 not in dtypes:
        logger.info("bf16 products of a few rows use torch's GEMM: this CPU has no AVX-512 BF16")
    if not dtypes:
        return False
    _library, _DTYPES = lib, frozenset(dtypes)
    return True


def max_rows(dtype: torch.dtype) -> int:
    """The most rows the kernel takes in `dtype`: `MAX_ROWS`, or what `tune` measured."""
    return _limits.get(dtype, MAX_ROWS.get(dtype, 0))


def tune(weights: list[torch.Tensor], dtype: torch.dtype) -> int:
    """Time the kernel against the library's product on the model's own weights (one pass over
    them all, as a decode step reads them: from memory, not from cache) at `TUNE_ROWS` rows, and
    keep the kernel up to the most rows at which it and every smaller count timed won; 0 where
    it lost at the fewest. The kernel was written on AMD CPUs; on an Intel Xeon with AMX
    (family 6 model 207, two threads, SmolLM2-135M's 30 layers) it took 1.3-2.8x the time of
    `torch.mm` in bf16 and 1-2x in float32 at every row count from 1 to 64
    (`benchmarks/small_gemm_bench.py`). Returns the limit, logged."""
    if not computes(dtype):
        return 0
    weights = [w for w in weights if w.dtype == dtype and w.dim() == 2 and w.is_contiguous()]
    if not weights:
        return max_rows(dtype)
    limit, timed = 0, []
    rows = [n for n in TUNE_ROWS if n <= MAX_ROWS[dtype]]
    for n in rows:
        kernel_s = _pass_seconds(weights, n, kernel=True)
        library_s = _pass_seconds(weights, n, kernel=False)
        timed.append(f"{n} rows {kernel_s * 1e3:.1f} against {library_s * 1e3:.1f} ms")
        if kernel_s > library_s:
            break
        limit = n
    if limit == rows[-1]:
        limit = MAX_ROWS[dtype]  # won at every count timed: up to the measured ceiling
    _limits[dtype] = limit
    logger.info("small-GEMM kernel in %s: up to %d rows (a pass over %d weights, kernel against "
                "the GEMM library: %s)", str(dtype).removeprefix("torch."), limit, len(weights),
                "; ".join(timed))
    return limit


def _pass_seconds(weights: list[torch.Tensor], rows: int, kernel: bool) -> float:
    """Seconds of one product of `rows` rows with each weight in turn, the best of two passes
    after one untimed (the first call builds the library's primitives)."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights}
    best = float("inf")
    for attempt in range(3):
        start = time.perf_counter()
        for w in weights:
            x = xs[w.shape[1]]
            _kernel_product(x, w) if kernel else _library_product(x, w)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def computes(dtype: torch.dtype) -> bool:
    """The kernel is built and computes `dtype` on this CPU."""
    return _library is not None and dtype in _DTYPES


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x @ weight.T` goes through the kernel: built here, bf16 or float32 rows (as
    this CPU computes them) on the CPU against a plain contiguous `[out, in]` weight of the
    same dtype."""
    return (_library is not None and x.dim() == 2 and weight.dim() == 2
            and x.dtype == weight.dtype and x.dtype in _DTYPES and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.is_contiguous()
            and x.shape[1] == weight.shape[1])


@torch.library.custom_op("raydix::small_gemm", mutates_args=())
def small_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T`: the kernel up to `MAX_ROWS` rows where it `serves` them, the GEMM
    library's product otherwise (`max_rows`: `MAX_ROWS`, or as `tune` measured)."""
    rows = x.shape[0]
    if _library is None or rows == 0 or rows > max_rows(x.dtype) or not serves(x, weight):
        return _library_product(x, weight)
    return _kernel_product(x, weight)


def _kernel_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    assert _library is not None
    rows, out_features = x.shape[0], weight.shape[0]
    x = x.contiguous()
    y = torch.empty(rows, out_features, dtype=x.dtype)
    kernel = _library.small_gemm_bf16 if x.dtype == torch.bfloat16 else _library.small_gemm_f32
    kernel(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, out_features, x.shape[1],
           torch.get_num_threads())
    return y


def _library_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The GEMM library's product: oneDNN's for float32 on the CPU (MKL's, which `torch.mm`
    calls, is 1.4-2.7x slower on AMD CPUs at 4-64 rows: `packed.linear`), else `torch.mm`."""
    if (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.backends.mkldnn.is_available()):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
    return torch.mm(x, weight.t())


@small_gemm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
