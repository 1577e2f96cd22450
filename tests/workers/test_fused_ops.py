"""The fused-op seam on the CPU: the plain-torch implementation and the `raydix::` operators'
CPU kernels against independent references (transformers' RMSNorms, rotary and activations;
a slot-by-slot K/V write). The CUDA kernels (flashinfer) are compared with these in
test_fused_ops_gpu.py."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm as HFLlamaRMSNorm
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from raydix.workers.layers.fused import FusedOps, fused_ops_for

OPS = {"torch": fused_ops_for("torch"), "fused": fused_ops_for("fused")}
DTYPES = [torch.float32, torch.bfloat16]


def _hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    norm = HFGemmaRMSNorm(x.shape[-1], eps) if gemma else HFLlamaRMSNorm(x.shape[-1], eps)
    norm = norm.to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("ops", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rmsnorm_equals_transformers(ops: str, dtype: torch.dtype, gemma: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 48, dtype=dtype) * 3
    w = torch.randn(48, dtype=dtype)
    x_before = x.clone()
    got = OPS[ops].rmsnorm(x, w, 1e-5, gemma)
    assert torch.equal(got, _hf_norm(x_before, w, 1e-5, gemma))
    assert torch.equal(x, x_before)  # rmsnorm leaves its input alone
    heads = x.view(5, 4, 12)[:, 1:3]  # per-head norm of a strided view (q/k norms)
    w12 = w[:12]
    assert torch.equal(OPS[ops].rmsnorm(heads, w12, 1e-5, gemma),
                       _hf_norm(heads.contiguous(), w12, 1e-5, gemma))


@pytest.mark.parametrize("ops", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_add_rmsnorm_equals_transformers(ops: str, dtype: torch.dtype, gemma: bool) -> None:
    torch.manual_seed(1)
    x, residual = torch.randn(7, 64, dtype=dtype), torch.randn(7, 64, dtype=dtype)
    w = torch.randn(64, dtype=dtype)
    summed = residual + x  # transformers: `hidden_states = residual + hidden_states`
    want = _hf_norm(summed, w, 1e-6, gemma)
    normed, new_residual = OPS[ops].add_rmsnorm(x.clone(), residual.clone(), w, 1e-6, gemma)
    assert torch.equal(new_residual, summed)
    assert torch.equal(normed, want)


def _hf_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
             rotary: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotate-half rotary on the first `rotary` dims (Phi-3's partial rotary)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()  # [T, rotary]
    qt, kt = q.transpose(0, 1), k.transpose(0, 1)  # [H, T, D], as transformers holds them
    qr, kr = apply_rotary_pos_emb(qt[..., :rotary].float(), kt[..., :rotary].float(), cos, sin,
                                  unsqueeze_dim=0)
    qo = torch.cat((qr.to(q.dtype), qt[..., rotary:]), -1).transpose(0, 1)
    ko = torch.cat((kr.to(k.dtype), kt[..., rotary:]), -1).transpose(0, 1)
    return qo, ko


@pytest.mark.parametrize("ops", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary", [32, 16], ids=["full", "partial"])
def test_rope_equals_transformers(ops: str, dtype: torch.dtype, rotary: int) -> None:
    torch.manual_seed(2)
    head_dim, max_pos = 32, 100
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.tensor([0, 5, 17, 99, 3])
    qkv = torch.randn(5, (4 + 2 + 2) * head_dim, dtype=dtype)
    q = qkv[:, :4 * head_dim].view(5, 4, head_dim)  # strided views, as the model passes them
    k = qkv[:, 4 * head_dim:6 * head_dim].view(5, 2, head_dim)
    want_q, want_k = _hf_rope(positions, q.clone(), k.clone(), inv_freq, rotary)
    got_q, got_k = OPS[ops].rope(positions, q, k, cos_sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("ops", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
def test_act_and_mul_equals_transformers(ops: str, dtype: torch.dtype, act: str) -> None:
    torch.manual_seed(3)
    x = torch.randn(6, 2 * 40, dtype=dtype) * 2
    gate, up = x[:, :40], x[:, 40:]
    assert torch.equal(OPS[ops].act_and_mul(act, x), ACT2FN[act](gate) * up)


def test_unknown_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="relu"):
        OPS["torch"].act_and_mul("relu", torch.zeros(1, 4))


@pytest.mark.parametrize("ops", sorted(OPS))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_store_kv_writes_each_slot(ops: str, index_dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    page_size, pages, heads, dim = 4, 5, 2, 8
    k_buf = torch.zeros((pages + 1) * page_size, heads, dim)
    v_buf = torch.zeros_like(k_buf)
    slots = torch.tensor([4, 5, 13, 23, 8], dtype=index_dtype)
    kv = torch.randn(5, 2 * heads, dim)  # strided halves, as the qkv projection gives them
    k, v = kv[:, :heads], kv[:, heads:]
    want_k, want_v = k_buf.clone(), v_buf.clone()
    for i, s in enumerate(slots.tolist()):
        want_k[s], want_v[s] = k[i], v[i]
    OPS[ops].store_kv(k_buf, v_buf, slots, k, v, page_size)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="'triton'"):
        fused_ops_for("triton")


def test_custom_ops_are_one_operator_each() -> None:
    """What the kernel-count test relies on: a dispatch mode sees each fused step as one
    `raydix::` operator, not the torch code inside it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    ops: FusedOps = OPS["fused"]
    x, r, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8, dtype=torch.bfloat16), \
        torch.ones(8, dtype=torch.bfloat16)
    with Record():
        ops.add_rmsnorm(x, r, w, 1e-6)
        ops.act_and_mul("silu", x)
    assert seen == ["raydix.add_rmsnorm", "raydix.act_and_mul"]
