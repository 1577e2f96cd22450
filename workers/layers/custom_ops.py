"""The fused steps of fused.py as `raydix::` torch operators: one operator per step, whose CUDA
kernel is flashinfer's fused kernel (imported on the first CUDA call) and whose CPU kernel is
the plain-torch code of `FusedOps`.

Being operators, each step is one entry in a torch dispatch mode's trace (the kernel-count test
counts the CUDA path's steps on the CPU through them) and one kernel inside a CUDA graph.
flashinfer's norm, rope, activation and append kernels take float16 and bfloat16 only: other
dtypes (a float32 model on CUDA) run the torch code in the CUDA kernel too. The mutating operators
(`add_rmsnorm`, `rope`, `store_kv`) work in place on both devices, as flashinfer's kernels do.

The plain `FusedOps` stays the CPU's default: each call through the torch dispatcher costs tens
of microseconds of host time on the CPU (benchmarks/fused_ops_bench.py measures it).
"""

from __future__ import annotations

from typing import Any

import torch

from .fused import TORCH_OPS, FusedOps

_SCHEMAS = {
    "rmsnorm": "rmsnorm(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor",
    "add_rmsnorm": "add_rmsnorm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
                   "bool gemma) -> ()",
    "rope": "rope(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin) -> ()",
    "act_and_mul": "act_and_mul(Tensor x, str act) -> Tensor",
    "store_kv": "store_kv(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor slots, Tensor k, Tensor v, "
                "int page_size) -> ()",
}
_HALF = (torch.float16, torch.bfloat16)


# ---- CPU kernels: the torch code, in place where the operator mutates ----------------------

def _rmsnorm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 gemma: bool) -> torch.Tensor:
    return TORCH_OPS.rmsnorm(x, weight, eps, gemma)


def _add_rmsnorm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, gemma: bool) -> None:
    residual.add_(x)  # x + residual, as the torch path adds (addition commutes exactly)
    x.copy_(TORCH_OPS.rmsnorm(residual, weight, eps, gemma))


def _rope_cpu(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              cos_sin: torch.Tensor) -> None:
    q_rot, k_rot = TORCH_OPS.rope(positions, q, k, cos_sin)
    q.copy_(q_rot)
    k.copy_(k_rot)


def _act_and_mul_cpu(x: torch.Tensor, act: str) -> torch.Tensor:
    return TORCH_OPS.act_and_mul(act, x)


def _store_kv_cpu(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, page_size: int) -> None:
    TORCH_OPS.store_kv(k_buf, v_buf, slots, k, v, page_size)


# ---- CUDA kernels: flashinfer ---------------------------------------------------------------

def _rmsnorm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  gemma: bool) -> torch.Tensor:
    if x.dtype not in _HALF or x.dim() not in (2, 3):
        return TORCH_OPS.rmsnorm(x, weight, eps, gemma)
    from flashinfer import norm

    if gemma and x.dim() == 3:  # flashinfer's Gemma norm takes rows only: one row per head
        out: torch.Tensor = norm.gemma_rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps)
        return out.view(x.shape)
    return (norm.gemma_rmsnorm if gemma else norm.rmsnorm)(x, weight, eps)


def _add_rmsnorm_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, gemma: bool) -> None:
    if x.dtype not in _HALF:
        return _add_rmsnorm_cpu(x, residual, weight, eps, gemma)
    from flashinfer import norm

    (norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm)(x, residual, weight, eps)
    return None


def _rope_cuda(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> None:
    if q.dtype not in _HALF:
        return _rope_cpu(positions, q, k, cos_sin)
    from flashinfer import rope

    # rotate-half pairs (x_i, x_{i + r/2}): flashinfer's "neox" layout, not the interleaved one
    rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, q.shape[-1], cos_sin,
                                               is_neox=True)
    return None


_FLASHINFER_ACT = {"silu": "silu_and_mul", "gelu": "gelu_and_mul",
                   "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


def _act_and_mul_cuda(x: torch.Tensor, act: str) -> torch.Tensor:
    if x.dtype not in _HALF or act not in _FLASHINFER_ACT:
        return TORCH_OPS.act_and_mul(act, x)
    from flashinfer import activation

    fn: Any = getattr(activation, _FLASHINFER_ACT[act])
    out: torch.Tensor = fn(x)
    return out


class _PageIndex:
    """Per device and pool size, the int32 tables that make flashinfer's paged append a plain
    slot write: one "request" whose pages are all the pool's pages in order, each token at
    "position" = its slot, so the kernel writes entry slot % page_size of page slot //
    page_size. Built on first use (warm-up runs before graph capture) and kept."""

    def __init__(self) -> None:
        self._tables: dict[tuple[torch.device, int, int], tuple[torch.Tensor, ...]] = {}
        self._zeros: dict[torch.device, torch.Tensor] = {}

    def tables(self, device: torch.device, num_pages: int,
               page_size: int) -> tuple[torch.Tensor, ...]:
        key = (device, num_pages, page_size)
        if key not in self._tables:
            i32 = torch.int32
            self._tables[key] = (torch.arange(num_pages, dtype=i32, device=device),
                                 torch.tensor([0, num_pages], dtype=i32, device=device),
                                 torch.tensor([page_size], dtype=i32, device=device))
        return self._tables[key]

    def zeros(self, device: torch.device, n: int) -> torch.Tensor:
        have = self._zeros.get(device)
        if have is None or have.numel() < n:
            have = torch.zeros(max(n, 16384), dtype=torch.int32, device=device)
            self._zeros[device] = have
        return have[:n]


_PAGES = _PageIndex()


def _store_kv_cuda(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, page_size: int) -> None:
    if (slots.dtype != torch.int32 or k_buf.dtype not in _HALF or k.dtype != k_buf.dtype
            or k_buf.shape[0] % page_size or k.stride(-1) != 1 or v.stride(-1) != 1):
        return _store_kv_cpu(k_buf, v_buf, slots, k, v, page_size)
    from flashinfer import page

    num_pages = k_buf.shape[0] // page_size
    shape = (num_pages, page_size, *k_buf.shape[1:])
    indices, indptr, last_page_len = _PAGES.tables(k_buf.device, num_pages, page_size)
    page.append_paged_kv_cache(k, v, _PAGES.zeros(k_buf.device, k.shape[0]), slots,
                               (k_buf.view(shape), v_buf.view(shape)), indices, indptr,
                               last_page_len, kv_layout="NHD")
    return None


def _register() -> None:
    if hasattr(torch.ops.raydix, "rmsnorm"):  # already registered in this process
        return
    lib = torch.library.Library("raydix", "DEF")
    for name, schema in _SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, globals()[f"_{name}_cpu"], "CPU")
        lib.impl(name, globals()[f"_{name}_cuda"], "CUDA")
    _LIBRARIES.append(lib)  # the registration lives as long as the library object


_LIBRARIES: list[torch.library.Library] = []
_register()


class CustomOps(FusedOps):
    """The seam through the `raydix::` operators (the CUDA path)."""

    name = "fused"

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                gemma: bool = False) -> torch.Tensor:
        out: torch.Tensor = torch.ops.raydix.rmsnorm(x, weight, eps, gemma)
        return out

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.raydix.add_rmsnorm(x, residual, weight, eps, gemma)
        return x, residual

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.raydix.rope(positions, q, k, cos_sin)
        return q, k

    def act_and_mul(self, act: str, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.raydix.act_and_mul(x, act)
        return out

    def store_kv(self, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, page_size: int) -> None:
        torch.ops.raydix.store_kv(k_buf, v_buf, slots, k, v, page_size)


CUSTOM_OPS = CustomOps()
