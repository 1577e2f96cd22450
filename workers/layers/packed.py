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

import functools
import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from . import small_gemm

if TYPE_CHECKING:
    from ..config import ModelConfig, WorkerConfig
    from ..parallel import TPGroup

logger = logging.getLogger(__name__)


@functools.cache
def native_bf16() -> bool:
    """The CPU computes bf16 dot products in hardware (AVX-512-BF16 or AMX tiles)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


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


@torch.library.custom_op("raydix::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product as one opaque operator for compiled graphs, on a plain fp32 weight
    (inductor would call MKL's sgemm for `F.linear`, 1.4-2.7x slower on AMD CPUs at 4-64 rows)
    or on a packed one (the CPU decode graph's bf16 LM head): inductor lowers oneDNN's own
    operator only for weights it packed itself, as constants, and fails on a graph input."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T + b`, through the packed weight when there is one."""
    if packed is not None:
        if torch.compiler.is_compiling():
            return onednn_linear(x.contiguous(), packed, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
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
            or x.shape[0] <= small_gemm.MAX_ROWS.get(x.dtype, 0)):
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
            module.register_parameter("weight", None)  # the packed weight is the only copy
            num_packed += 1
    logger.debug("packed %d linear weights for oneDNN (batch hint %d)", num_packed, batch_hint)
    return num_packed


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: parameters and packed weights."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if isinstance(packed, torch.Tensor):
            total += packed.numel() * packed.element_size()
    return total


# bf16 must beat fp32 by this much on the model's linear to be picked, and the linear must hold
# at least this many weights: below it a call is overhead (about 15 us for either dtype on a
# [256 x 64] linear), the two time the same and a measured pick would be a coin toss that
# could differ between two processes on one machine
BF16_MIN_SPEEDUP = 1.2
MIN_MEASURED_WEIGHTS = 1 << 18


def pick_cpu_dtype(in_features: int, out_features: int, rows: int = 1,
                   repeats: int = 20) -> torch.dtype:
    """`--dtype auto` on CPU: packed bf16 where it beats packed fp32 by `BF16_MIN_SPEEDUP` on
    one linear of the model's shape (`rows` input rows), measured here; fp32 where bf16 is not
    native, or where the linear is too small to tell (`MIN_MEASURED_WEIGHTS`)."""
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
    x = torch.randn(rows, in_features, generator=gen)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        packed, xd = pack_weight(weight.to(dtype), rows), x.to(dtype)
        linear(xd, None, packed)  # warm-up: oneDNN builds its primitive on the first call
        best = float("inf")
        for _ in range(3):  # best of three: the machine may be busy
            start = time.perf_counter()
            for _ in range(repeats):
                linear(xd, None, packed)
            best = min(best, time.perf_counter() - start)
        seconds[dtype] = best
    faster = seconds[torch.float32] >= BF16_MIN_SPEEDUP * seconds[torch.bfloat16]
    choice = torch.bfloat16 if faster else torch.float32
    logger.info("dtype auto: %s (a [%d x %d] linear: fp32 %.3f ms, bf16 %.3f ms; bf16 is "
                "picked from %.1fx faster)", str(choice).removeprefix("torch."), out_features,
                in_features, seconds[torch.float32] / repeats * 1e3,
                seconds[torch.bfloat16] / repeats * 1e3, BF16_MIN_SPEEDUP)
    return choice


def rank_dtype(config: WorkerConfig, mc: ModelConfig, group: TPGroup) -> torch.dtype:
    """The config's dtype; for `dtype="auto"` on CPU the faster one measured on this CPU, the
    same on every rank (bf16 only where every rank picked it)."""
    if not config.dtype_measured:
        return config.torch_dtype
    from ..parallel import all_reduce_min

    picked = pick_cpu_dtype(mc.hidden_size, 2 * mc.intermediate_size // config.tp_size)
    use_bf16 = all_reduce_min(int(picked == torch.bfloat16 and native_bf16()), group)
    return torch.bfloat16 if use_bf16 else torch.float32
