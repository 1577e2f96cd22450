"""The fused-op seam's elementwise steps in C for bf16 on the CPU (`cpu_fused.c`): RMSNorm with
and without the residual add, SiLU·mul and rotary embedding, one pass each, for the eager steps
(prompts, mixed steps). torch's code runs them as several operators each, converting to float32
and back between them: at 512 rows of SmolLM2-135M about a millisecond a layer.

`NativeOps` is a `FusedOps`: steps it does not take (other dtypes, activations, layouts, or any
step while torch compiles a graph, where inductor fuses the torch code itself) run the torch
code it inherits. Built at start where the CPU runs bf16 (`warm_up`); without a C compiler the
torch code runs, and a warning says so.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ..native_build import NativeBuildError, load
from .fused import FusedOps

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_fused.c")
_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
FUNCTIONS = {
    "rmsnorm_bf16": [_P, _P, _P, _I, _I, _F, _T, _T],
    "add_rmsnorm_bf16": [_P, _P, _P, _I, _I, _F, _T, _T],
    "silu_and_mul_bf16": [_P, _P, _I, _I, _T],
    "rope_bf16": [_P, _I, _I, _P, _I, _I, _I, _I, _I, _P, _P, _T],
}


def _rows(x: torch.Tensor) -> bool:
    """bf16 on the CPU, contiguous, outside a graph being compiled."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous()
            and not torch.compiler.is_compiling())


class NativeOps(FusedOps):
    name = "native"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                gemma: bool = False) -> torch.Tensor:
        if not (_rows(x) and _rows(weight) and weight.shape == x.shape[-1:]):
            return super().rmsnorm(x, weight, eps, gemma)
        out = torch.empty_like(x)
        self.lib.rmsnorm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                              x.numel() // x.shape[-1], x.shape[-1], eps, int(gemma),
                              torch.get_num_threads())
        return out

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_rows(x) and _rows(residual) and _rows(weight) and x.shape == residual.shape
                and weight.shape == x.shape[-1:]):
            return super().add_rmsnorm(x, residual, weight, eps, gemma)
        self.lib.add_rmsnorm_bf16(x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                                  x.numel() // x.shape[-1], x.shape[-1], eps, int(gemma),
                                  torch.get_num_threads())
        return x, residual

    def act_and_mul(self, act: str, x: torch.Tensor) -> torch.Tensor:
        if act != "silu" or not _rows(x) or x.shape[-1] % 2:
            return super().act_and_mul(act, x)
        inter = x.shape[-1] // 2
        out = x.new_empty(*x.shape[:-1], inter)
        self.lib.silu_and_mul_bf16(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                                   inter, torch.get_num_threads())
        return out

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (q.dtype == k.dtype == torch.bfloat16 and q.device.type == "cpu"
                and not torch.compiler.is_compiling() and q.dim() == k.dim() == 3
                and q.shape[-1] == k.shape[-1] and q.shape[0] == k.shape[0] == positions.numel()
                and _heads_contiguous(q) and _heads_contiguous(k)
                and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
                and cos_sin.shape[1] % 2 == 0 and cos_sin.shape[1] <= q.shape[-1]
                and positions.dtype == torch.int64 and positions.is_contiguous()
                and (positions.numel() == 0 or int(positions.max()) < cos_sin.shape[0])):
            return super().rope(positions, q, k, cos_sin)
        self.lib.rope_bf16(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0),
                           k.shape[1], q.shape[0], q.shape[-1], cos_sin.shape[1],
                           positions.data_ptr(), cos_sin.data_ptr(), torch.get_num_threads())
        return q, k


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] whose heads and dims are packed within a row (rows may be further apart)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]


_ops: NativeOps | None = None


def warm_up() -> NativeOps | None:
    """The steps built (or loaded), or None, logged, where they cannot be."""
    global _ops
    if _ops is None:
        try:
            _ops = NativeOps(load(SOURCE, {}, FUNCTIONS))
        except (NativeBuildError, OSError) as exc:
            logger.warning("bf16 norms, rotary and SiLU·mul run as torch's operators: the C "
                           "steps could not be built: %s", exc)
            return None
    return _ops
