"""Products of a few rows with a packed weight, read in place (CPU: AVX-512, AVX-512-BF16, AMX).

A decode step multiplies a few rows (one per running stream) by every weight of the model: it
reads each weight once and is bound by memory. oneDNN's product on its packed bf16 weight
(packed.py) read SmolLM2-135M's 30 decoder layers at 6.6-11 GB/s on two cores of an AMX Xeon,
which stream 23 GB/s, whatever the rows from 1 to 32; at 19-23 GB/s from 1 to 8 rows on two
cores of an AMD EPYC Zen 5 (AVX-512-BF16, no AMX; 46 GB/s streamed), 16-17 at 16, 12-14 at 32.
`packed_gemv.c` reads the same packed weights, in oneDNN's own layout, in place:

- where the CPU has AMX tiles, on the tiles, 1 to `MAX_TILE_ROWS` rows (16 at a time: one read
  of the weight for 16 rows): 0.56-0.77x oneDNN's time from 1 to 32 rows, 0.91x at 48, 1.02x
  at 64 (so 32 at most);
- elsewhere with AVX-512-BF16's dot products of pairs, 1 to `MAX_ROWS` rows, four at a time
  through each block of 64 outputs (the block from memory for the first four, from the core's
  cache for the rest). On the Zen 5: 0.71-0.78x oneDNN's time at one row, 0.71-0.85x at two,
  0.71-0.87x from three to 12, 0.75-0.86x at 16, 0.79-0.85x at 24, 0.80-0.88x at 32,
  0.72-0.75x at 48, 0.73-0.74x at 64, 0.86-0.87x at 96, 0.80-0.85x at 128; at 256 and 512 rows
  (compute, not memory, bounds both) 0.93-0.99x, so up to 128. (On the AMX Xeon, whose tiles
  serve instead, the dot products were bound by their own speed from three rows on: 1.04x at
  eight, 1.5x at sixteen.)

float32 (session 33): a packed float32 weight is blocks of 64 outputs, each input's 64 outputs
side by side; the float32 kernel reads it with four FMAs an input per row. Four rows a pass on
the Zen 5 (30 layers' weights from memory, two threads), its time against oneDNN's product on
the same packed weight: 0.72x at one row, 0.76x at two, 0.88-0.91x at three to eight, 1.02x at
16, 1.09x at 32; against `small_gemm` on the plain weights (the few-row kernel float32 layers
used while they stayed plain) 0.53-0.75x. Six rows a pass (session 37) on an AMD EPYC Zen 4:
0.76-0.86x the time of four at 6 to 32 rows, and against oneDNN 0.58-0.64x at one to four rows,
0.62-0.69x at 8 to 12, 0.82-0.88x at 16, 0.83-0.95x at 24 to 32. From nine rows (session 38)
each pass over a block also asks for its share of the next block's weight, so that the block
streams in while the passes compute (the first pass of a block waited on memory, the others on
the cores): 0.82-0.94x the time at 9 to 48 rows; against oneDNN 0.67-0.89x at 16 to 48, 0.83x
at 64 (the start-up tune). So the kernel takes 1 to `F32_KNOWN_ROWS` rows everywhere, and up
to `MAX_F32_ROWS` (64) where `tune_f32` measured it faster than oneDNN on the model's own
weights at start. The bf16 dot products' passes ask for the next block the same way
(0.90-0.94x at 9 to 64 rows).

Equal results within bf16's rounding (both sum in float32 and round once); in float32 within
the order of the sums. More rows, and prompts, keep oneDNN's product on the same packed weight
(still the only copy). Measured on 30 layers' weights (from memory, as a decode step reads
them), two threads.

The layout is oneDNN's choice, not a promise: `register` checks each packed weight, one
product of random rows against oneDNN's for each block size the kernels read (32 and 64 output
rows, what oneDNN picks for batch hints of 64 and 1 on AMX), and records the one that agrees;
a weight none agrees with (another layout, another oneDNN) keeps oneDNN's product. The kernels
are built at start (`warm_up`) where the CPU has AVX-512-BF16, the tiles' one where it has AMX
and Linux grants the process the tiles; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import time
import weakref
from pathlib import Path

import torch

from ..cpu_features import amx_granted, avx512, avx512_bf16
from ..native_build import NativeBuildError, load

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("packed_gemv.c")
MAX_ROWS = 128  # the dot-product kernel's (packed_gemv.c); more rows take oneDNN's product
MAX_TILE_ROWS = 32  # the tiles' kernel's
F32_KNOWN_ROWS = 8  # the float32 kernel's rows on every CPU with AVX-512 (faster at 1 to 8)
F32_TUNE_ROWS = (16, 32, 64)  # the rows `tune_f32` times, past F32_KNOWN_ROWS
MAX_F32_ROWS = F32_TUNE_ROWS[-1]  # the most `tune_f32` may give it
ENABLED = True  # False: every product takes oneDNN's (benchmarks/path_bench.py compares)
BLOCKS = (32, 64)  # output rows of a block of oneDNN's AB16b<block>a2b layout (bf16)
F32_BLOCKS = (64,)  # output rows of a block of oneDNN's packed float32 layout

_lib: ctypes.CDLL | None = None
_failed: str | None = None
_tiles = False  # the tiles' kernel is built and Linux granted the tiles
_bf16 = False  # the bf16 dot products' kernel is built (the CPU has AVX-512-BF16)
_f32_rows = F32_KNOWN_ROWS  # the float32 kernel's rows here (`tune_f32`)
# id of a packed weight -> the output block of its layout and its data's address (weights no
# block agrees with are absent); an entry leaves with its weight (`weakref.finalize`), before
# its id can be reused
_blocks: dict[int, tuple[int, int]] = {}


def warm_up() -> bool:
    """Build (or load) the kernels: float32's where the CPU has AVX-512, bf16's where it has
    AVX-512-BF16 too; False where it has no AVX-512 or they cannot be built (logged once)."""
    global _lib, _failed, _tiles, _bf16
    if _lib is not None:
        return True
    if _failed is not None:
        return False
    if not avx512():
        _failed = "no AVX-512 on this CPU"
        return False
    argtypes: list[type] = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    functions = {"packed_gemv_f32": argtypes}
    if avx512_bf16():
        functions["packed_gemv_bf16"] = argtypes
    try:
        lib = load(SOURCE, {}, functions)
    except (NativeBuildError, OSError) as exc:
        _failed = str(exc)
        logger.warning("products of a few rows stay with oneDNN: the packed-weight kernels "
                       "could not be built: %s", exc)
        return False
    _lib, _bf16 = lib, "packed_gemv_bf16" in functions
    _tiles = _bf16 and amx_granted() and _tile_kernel(lib, argtypes)
    return True


def _tile_kernel(lib: ctypes.CDLL, argtypes: list[type]) -> bool:
    """The tiles' kernel is in `lib` (the C compiler knew AMX)."""
    kernel = getattr(lib, "packed_amx_bf16", None)
    if kernel is None:
        logger.warning("the C compiler built no AMX kernel: bf16 products of 3-%d rows stay "
                       "with oneDNN", MAX_TILE_ROWS)
        return False
    kernel.argtypes, kernel.restype = argtypes, None
    return True


def max_rows(dtype: torch.dtype = torch.bfloat16) -> int:
    """The most rows of `dtype` the kernels take here (0 before `warm_up` or without them)."""
    if _lib is None:
        return 0
    if dtype == torch.float32:
        return _f32_rows
    if dtype != torch.bfloat16 or not _bf16:
        return 0
    return MAX_TILE_ROWS if _tiles else MAX_ROWS


def tune_f32(weights: list[torch.Tensor]) -> int:
    """Time the float32 kernel against oneDNN's product on the model's packed weights that
    `register` recorded (one pass over them all, as a decode step reads them: from memory) at
    `F32_TUNE_ROWS`, and let it take up to the most rows at which it and every smaller count
    timed won, `F32_KNOWN_ROWS` at least. Returns the limit, logged."""
    global _f32_rows
    weights = [w for w in weights if w.dtype == torch.float32 and w.is_mkldnn and block_of(w)]
    if not weights or _lib is None:
        return max_rows(torch.float32)
    limit, timed = F32_KNOWN_ROWS, []
    for rows in F32_TUNE_ROWS:
        kernel_s, onednn_s = _pass_seconds(weights, rows)
        timed.append(f"{rows} rows {kernel_s * 1e3:.1f} against {onednn_s * 1e3:.1f} ms")
        if kernel_s > onednn_s:
            break
        limit = rows
    _f32_rows = limit
    logger.info("float32 packed-weight kernel: up to %d rows (a pass over %d weights, kernel "
                "against oneDNN: %s)", _f32_rows, len(weights), "; ".join(timed))
    return _f32_rows


TUNE_PASSES = 4  # timed passes of each product, alternated (the machine's pace drifts)


def _pass_seconds(weights: list[torch.Tensor], rows: int) -> tuple[float, float]:
    """Seconds of one product of `rows` rows with each weight in turn, by the kernel and by
    oneDNN: the best of `TUNE_PASSES` each, the two alternated (which goes first flips every
    pass), after one untimed pass of each (oneDNN builds its primitives on the first call)."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def one_pass(kernel: bool) -> float:
        start = time.perf_counter()
        for w in weights:
            x = xs[w.shape[1]]
            if kernel:
                _run(x, w, *_blocks[id(w)])
            else:
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return time.perf_counter() - start

    one_pass(True), one_pass(False)
    best = {True: float("inf"), False: float("inf")}
    for attempt in range(TUNE_PASSES):
        for kernel in (True, False) if attempt % 2 == 0 else (False, True):
            best[kernel] = min(best[kernel], one_pass(kernel))
    return best[True], best[False]


def register(packed: torch.Tensor) -> int:
    """Check `packed` (oneDNN's packed bf16 or float32 weight, `[out, in]`) against each block
    size the kernel of its dtype reads; returns the one that agrees with oneDNN's own product,
    recorded for `product`, or 0."""
    if not packed.is_mkldnn or not warm_up() or not max_rows(packed.dtype):
        return 0
    out_features, in_features = packed.shape
    bf16 = packed.dtype == torch.bfloat16
    if bf16 and in_features % 32:
        return 0
    size = packed.element_size() * out_features * in_features
    if torch.ops.mkldnn._nbytes(packed) != size:
        return 0
    # the rows the kernel here takes, with the tiles a full group of 16 and a partial one
    x = torch.randn(min(max_rows(packed.dtype), 19), in_features,
                    generator=torch.Generator().manual_seed(0)).to(packed.dtype)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()
    # bf16's rounding of the largest output; in float32 another order of the sums (a layout
    # read wrongly is off by the outputs' own size)
    tolerance = (2 ** -7 if bf16 else 1e-4) * want.abs().amax().item()
    for block in BLOCKS if bf16 else F32_BLOCKS:
        if out_features % block:
            continue
        address = torch.ops.mkldnn.data_ptr(packed)
        got = _run(x, packed, block, address).float()
        if (got - want).abs().amax().item() <= tolerance:
            _blocks[id(packed)] = (block, address)
            weakref.finalize(packed, _blocks.pop, id(packed), None)
            return block
    return 0


def block_of(packed: torch.Tensor) -> int:
    """The output block `register` found for `packed`, or 0 (not registered, or no block)."""
    entry = _blocks.get(id(packed))
    return entry[0] if entry is not None else 0


def product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """`x` [rows, in] times the packed weight [out, in] through a kernel, [rows, out] in the
    weight's dtype; None where the kernels do not take them (a weight `register` did not
    record, more than `max_rows` rows, another dtype, `ENABLED` off): oneDNN's product then."""
    entry = _blocks.get(id(packed)) if ENABLED else None
    if (entry is None or x.dim() != 2 or x.dtype != packed.dtype
            or not 0 < x.shape[0] <= max_rows(x.dtype)):
        return None
    return _run(x, packed, *entry)


def _run(x: torch.Tensor, packed: torch.Tensor, block: int, address: int) -> torch.Tensor:
    assert _lib is not None
    x = x.contiguous()
    rows, in_features = x.shape
    y = torch.empty(rows, packed.shape[0], dtype=packed.dtype)
    if packed.dtype == torch.float32:
        kernel = _lib.packed_gemv_f32
    else:
        kernel = _lib.packed_amx_bf16 if _tiles else _lib.packed_gemv_bf16
    kernel(x.data_ptr(), address, y.data_ptr(), rows, packed.shape[0], in_features, block,
           torch.get_num_threads())
    return y
