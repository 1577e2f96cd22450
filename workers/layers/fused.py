"""The fused-op seam: every elementwise step of a transformer block that a GPU kernel library
fuses (RMSNorm with and without the residual add, rotary embedding from a cos/sin cache,
activation times up-projection, the K/V write into the pool) goes through one `FusedOps` object,
so the model code has one path.

`FusedOps` itself is the plain-torch implementation, the one the CPU runs: it computes exactly
as transformers does in float32 (the model equality tests hold it to that). `custom_ops.py`
registers the same steps as `raydix::` torch operators, each one operator whatever it does
inside: their CUDA kernels are flashinfer's fused kernels, their CPU kernels this module's torch
code. The CUDA path runs those (`fused_ops_for`), one kernel launch per fused step.

Implementations may overwrite the tensors they are given where the docstring says so (the
flashinfer kernels work in place): callers never reuse them after the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class FusedOps:
    """The plain-torch implementation (the CPU's); subclasses replace it step by step."""

    name = "torch"

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                gemma: bool = False) -> torch.Tensor:
        """RMSNorm over the last dim, in float32, scaled by `weight` (by `1 + weight` with
        `gemma`). Returns a new tensor; x is left as it was."""
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if gemma:  # Gemma: the scale in float32, then one cast
            return (xf * (1.0 + weight.float())).to(dtype)
        return weight * xf.to(dtype)  # Llama: cast back, then scale in the model dtype

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual), x + residual). May overwrite x and residual."""
        x = x + residual
        return self.rmsnorm(x, weight, eps, gemma), x

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] at `positions` [T] in the rotate-half layout
        ("neox"), over the first `cos_sin.shape[1]` dims of each head. `cos_sin`:
        [max_position, rotary_dim] float32, each row [cos | sin]. May rotate q and k in place."""
        half = cos_sin.shape[1] // 2
        cs = cos_sin[positions].unsqueeze(1)
        cos, sin = cs[..., :half], cs[..., half:]
        rotary = 2 * half
        if rotary == q.shape[-1]:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        return (torch.cat((_rotate(q[..., :rotary], cos, sin), q[..., rotary:]), dim=-1),
                torch.cat((_rotate(k[..., :rotary], cos, sin), k[..., rotary:]), dim=-1))

    def act_and_mul(self, act: str, x: torch.Tensor) -> torch.Tensor:
        """x = [gate | up] on the last dim; returns act(gate) * up."""
        gate, up = x.chunk(2, dim=-1)
        return _activation(act, gate) * up

    def store_kv(self, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, page_size: int) -> None:
        """Write K/V [T, Hk, D] into the pool's slot-indexed buffers [num_slots, Hk, D] at
        `slots` [T] (int32 or int64). `page_size` divides num_slots: slot s is entry
        s % page_size of page s // page_size (what a paged kernel needs)."""
        # index_copy_, not `k_buf[slots] = k`: on the CPU, index_put_ with int64 indices
        # writes a 512-token prompt's K in 1.2-1.7 ms, index_copy_ in 0.16 (the same result)
        index = slots if slots.dtype == torch.int64 else slots.long()
        k_buf.index_copy_(0, index, k.to(k_buf.dtype))
        v_buf.index_copy_(0, index, v.to(v_buf.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def _activation(act: str, x: torch.Tensor) -> torch.Tensor:
    """`hidden_act` as transformers names it (models/config_fields.py refuses the others)."""
    if act == "silu":
        return F.silu(x)
    if act == "gelu":  # the exact (erf) GELU
        return F.gelu(x)
    if act == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"activation {act!r} is not supported")


TORCH_OPS = FusedOps()


def fused_ops_for(kind: str) -> FusedOps:
    """The implementation called `kind`: "torch" (plain torch, the CPU's) or "fused" (the
    `raydix::` operators: flashinfer's kernels on CUDA, the torch code on the CPU, one operator
    per step either way)."""
    if kind == "torch":
        return TORCH_OPS
    if kind == "fused":
        from .custom_ops import CUSTOM_OPS

        return CUSTOM_OPS
    raise ValueError(f"unknown fused ops {kind!r}; choose 'torch' or 'fused'")


class UsesFusedOps:
    """A module whose forward goes through the seam; `use_fused_ops` (models) sets `ops`."""

    ops: FusedOps = TORCH_OPS
