"""Linear layers on CPU through oneDNN, with each weight reordered once into oneDNN's layout.

`F.linear` on CPU calls MKL's sgemm on the plain `[out, in]` weight at every call. oneDNN's
matmul on a weight reordered once (the op torch's own CPU compiler uses after freezing) computes
the same product in fp32 with a blocked, cache-friendly weight: on SmolLM2-135M's shapes it is
15-20% faster for the layers and up to 60% for the LM head (measured one thread, AVX-512).

The plain weight is the parameter while the checkpoint loads (loading and TP sharding see it);
`pack_linear_layers` then reorders it and drops it, so the packed weight is the only copy (as
vLLM's CPU build does). `packed.to_dense()` gives the plain weight back when one is needed.

bf16 is packed only where the CPU computes it natively (AVX-512-BF16 or AMX); elsewhere oneDNN
would emulate it, and the layers stay plain.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu_features import native_bf16
from . import packed_gemv, small_gemm

if TYPE_CHECKING:
    from ..config import ModelConfig, WorkerConfig
    from ..parallel import TPGroup

logger = logging.getLogger(__name__)


# this torch build has oneDNN's linear ops (read once: dynamo does not trace the check)
_ONEDNN_LINEAR = (torch.backends.mkldnn.is_available()
                  and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                  and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packed linear runs here: a CPU build with oneDNN's linear ops, fp32, or bf16 on a
    CPU with native bf16."""
    if device.type != "cpu" or not _ONEDNN_LINEAR:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """`weight` `[out, in]` in oneDNN's layout, tuned for about `batch_hint` rows of input."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def packed_product(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product, or for one or two bf16 rows on a packed weight whose layout
    `packed_gemv.register` checked, the kernel that reads it in place (packed_gemv.py)."""
    y = packed_gemv.product(x, weight) if bias is None else None
    if y is not None:
        return y
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# oneDNN's product as one opaque operator for compiled graphs, on a plain fp32 weight (inductor
# would call MKL's sgemm for `F.linear`, 1.4-2.7x slower on AMD CPUs at 4-64 rows) or on a
# packed one (the CPU decode graph's bf16 LM head and, on AMX, its layers): inductor lowers
# oneDNN's own operator only for weights it packed itself, as constants, and fails on a graph
# input. Registered with torch.library's plain calls, not `custom_op`, whose wrappers cost
# about 5 us a call (a one-row product of a 576x576 bf16 weight takes 30-50; a decode step
# makes 121 of them).
_LIBRARY = torch.library.Library("raydix", "FRAGMENT")
_LIBRARY.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("onednn_linear", packed_product, "CompositeExplicitAutograd")


def _onednn_linear_fake(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


torch.library.register_fake("raydix::onednn_linear", _onednn_linear_fake)
onednn_linear = torch.ops.raydix.onednn_linear.default


def linear(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T + b`, through the packed weight when there is one."""
    if packed is not None:
        if torch.compiler.is_compiling():
            return onednn_linear(x.contiguous(), packed, bias)
        return packed_product(x.contiguous(), packed, bias)
    if weight is None:
        raise RuntimeError("linear layer has neither a weight nor a packed weight")
    if torch.compiler.is_compiling() and x.dim() == 2 and x.shape[0] == 1:
        # one row, traced for the CPU decode graph (cpu_decode_graph.py): as multiply-and-sum,
        # inductor reads each weight row once in a parallel loop; a matrix product would call
        # the GEMM library, which computes one row at about half the memory bandwidth
        y = (x[:, None, :] * weight[None]).sum(-1)
        return y if bias is None else y + bias
    if small_gemm.serves(x, weight) and (
            torch.compiler.is_compiling()
            or x.shape[0] <= small_gemm.max_rows(x.dtype)):
        # a few rows (the batched decode graph's products: it picks by rows at run time)
        y = torch.ops.raydix.small_gemm(x, weight)
        return y if bias is None else y + bias
    if (weight.device.type == "cpu" and weight.dtype == torch.float32 and x.dtype == weight.dtype
            and x.dim() == 2):
        # oneDNN on the plain weight: MKL's F.linear is 1.4-2.7x slower on this AMD CPU at 4-64
        # rows (benchmarks/gemv_bench.py); equal at 512. In a compiled graph (the CPU decode
        # graph's batches) as an operator of its own (dynamo does not trace the check)
        if torch.compiler.is_compiling():
            if _ONEDNN_LINEAR:
                return onednn_linear(x.contiguous(), weight, bias)
        elif _ONEDNN_LINEAR:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [],
                                                      "")
    return F.linear(x, weight, bias)


def pack_linear_layers(model: nn.Module, batch_hint: int,
                       only: type[nn.Module] | None = None) -> int:
    """Replace the weight of every layer with a `packed_weight` slot (of class `only`, when
    given) by its packed form; returns how many were packed. The plain weight is dropped (set to None), one layer at a time, so
    memory never holds more than one layer's weight twice. Layers already packed are left as
    they are."""
    num_packed = 0
    for module in model.modules():
        if only is not None and not isinstance(module, only):
            continue
        if hasattr(module, "packed_weight") and isinstance(module.weight, torch.Tensor):
            module.packed_weight = pack_weight(module.weight, batch_hint)
            packed_gemv.register(module.packed_weight)
            module.register_parameter("weight", None)  # the packed weight is the only copy
            num_packed += 1
    logger.debug("packed %d linear weights for oneDNN (batch hint %d)", num_packed, batch_hint)
    return num_packed


def plain_linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """The plain weights of `model`'s packable linear layers (those not packed)."""
    return [m.weight for m in model.modules()
            if hasattr(m, "packed_weight") and isinstance(m.weight, torch.Tensor)]


def packed_linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """The packed weights of `model`'s linear layers."""
    weights = (getattr(m, "packed_weight", None) for m in model.modules())
    return [w for w in weights if isinstance(w, torch.Tensor)]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: parameters and packed weights."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if isinstance(packed, torch.Tensor):
            total += packed.numel() * packed.element_size()
    return total


# bf16 must beat fp32 by this much on the model's linear to be picked (the geometric mean of
# the speed-ups at `PICK_ROWS`), and the linear must hold at least this many weights: below it a
# call is overhead (about 15 us for either dtype on a [256 x 64] linear), the two time the same
# and a measured pick would be a coin toss that could differ between two processes on one machine
BF16_MIN_SPEEDUP = 1.2
MIN_MEASURED_WEIGHTS = 1 << 18
# the rows timed: a lone stream's decode, a batch's decode, a prefill chunk. One row alone made
# the pick a coin toss on a CPU with AMX (an Intel Xeon, family 6 model 207, two threads, a
# [3072 x 576] linear: bf16 1.19-1.40x faster at one row between processes, 1.7x at 4 rows and
# 2.4x at 16), and a lone row is not what most of the work multiplies
PICK_ROWS = (1, 16, 256)


def pick_cpu_dtype(in_features: int, out_features: int, rows: tuple[int, ...] = PICK_ROWS,
                   repeats: int = 20) -> torch.dtype:
    """`--dtype auto` on CPU: packed bf16 where it beats packed fp32 by `BF16_MIN_SPEEDUP` on
    one linear of the model's shape (the geometric mean over `rows` input rows), measured here;
    fp32 where bf16 is not native, or where the linear is too small to tell
    (`MIN_MEASURED_WEIGHTS`)."""
    if not packing_supported(torch.device("cpu"), torch.float32):
        return torch.float32
    if not native_bf16():
        logger.info("dtype auto: float32 (this CPU has no native bf16: no avx512_bf16, no amx)")
        return torch.float32
    if in_features * out_features < MIN_MEASURED_WEIGHTS:
        logger.info("dtype auto: float32 (a [%d x %d] linear is too small for bf16 to gain)",
                    out_features, in_features)
        return torch.float32
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    speedups = []
    for n in rows:
        x = torch.randn(n, in_features, generator=gen)
        # a prefill-sized product takes milliseconds: fewer calls time it as well
        calls = repeats if n <= 16 else max(3, repeats // 8)
        ms = {dtype: _best_ms(x.to(dtype), pack_weight(weight.to(dtype), n), calls)
              for dtype in (torch.float32, torch.bfloat16)}
        speedups.append(ms[torch.float32] / ms[torch.bfloat16])
        logger.info("dtype auto: a [%d x %d] linear at %d rows: fp32 %.3f ms, bf16 %.3f ms",
                    out_features, in_features, n, ms[torch.float32], ms[torch.bfloat16])
    speedup = statistics.geometric_mean(speedups)
    choice = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else torch.float32
    logger.info("dtype auto: %s (bf16 %.2fx as fast as fp32 over %s rows; picked from %.1fx)",
                str(choice).removeprefix("torch."), speedup, "/".join(map(str, rows)),
                BF16_MIN_SPEEDUP)
    return choice


def _best_ms(x: torch.Tensor, packed: torch.Tensor, calls: int) -> float:
    """Milliseconds a call, the best of three runs of `calls` (the machine may be busy)."""
    linear(x, None, packed)  # warm-up: oneDNN builds its primitive on the first call
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            linear(x, None, packed)
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e3


def rank_dtype(config: WorkerConfig, mc: ModelConfig, group: TPGroup) -> torch.dtype:
    """The config's dtype; for `dtype="auto"` on CPU the faster one measured on this CPU, the
    same on every rank (bf16 only where every rank picked it)."""
    if not config.dtype_measured:
        return config.torch_dtype
    from ..parallel import all_reduce_min

    picked = pick_cpu_dtype(mc.hidden_size, 2 * mc.intermediate_size // config.tp_size)
    use_bf16 = all_reduce_min(int(picked == torch.bfloat16 and native_bf16()), group)
    return torch.bfloat16 if use_bf16 else torch.float32
