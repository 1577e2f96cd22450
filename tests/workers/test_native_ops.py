"""The fused-op seam's bf16 CPU steps in C (workers/layers/native_ops.py): each gives torch's
code's result but for the odd last bit (the sum of squares is added in another order), works
in place where the seam allows it, and hands every input it does not take to the torch code."""

from __future__ import annotations

import pytest
import torch

from raydix.workers.config import WorkerConfig
from raydix.workers.layers import native_ops
from raydix.workers.layers.fused import TORCH_OPS
from raydix.workers.runner import ModelRunner

from .conftest import TinyModel


@pytest.fixture(scope="module")
def ops() -> native_ops.NativeOps:
    built = native_ops.warm_up()
    assert built is not None, "the C steps could not be built on this machine"
    return built


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


def _same_but_last_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)
    assert (got == want).float().mean() > 0.98


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 48), (300, 576)])
def test_norms(ops: native_ops.NativeOps, gemma: bool, shape: tuple[int, ...]) -> None:
    x, residual = _bf16(*shape, seed=1, scale=3.0), _bf16(*shape, seed=2)
    weight = _bf16(shape[-1], seed=3)
    _same_but_last_bits(ops.rmsnorm(x, weight, 1e-6, gemma), TORCH_OPS.rmsnorm(x, weight, 1e-6,
                                                                                gemma))
    want_norm, want_sum = TORCH_OPS.add_rmsnorm(x.clone(), residual.clone(), weight, 1e-6, gemma)
    got_norm, got_sum = ops.add_rmsnorm(x.clone(), residual.clone(), weight, 1e-6, gemma)
    assert torch.equal(got_sum, want_sum)  # one bf16 addition: exactly torch's
    _same_but_last_bits(got_norm, want_norm)


@pytest.mark.parametrize("rows", [1, 9, 512])
def test_silu_and_mul(ops: native_ops.NativeOps, rows: int) -> None:
    x = _bf16(rows, 2 * 96, seed=rows, scale=4.0)
    _same_but_last_bits(ops.act_and_mul("silu", x), TORCH_OPS.act_and_mul("silu", x))


@pytest.mark.parametrize("rotary", [64, 32])  # the whole head, or its first half (partial)
def test_rope_on_views_of_one_projection(ops: native_ops.NativeOps, rotary: int) -> None:
    """q and k as the model makes them: views into one qkv projection, rotated in place."""
    tokens, hq, hk, dim = 11, 6, 2, 64
    qkv = _bf16(tokens, (hq + 2 * hk) * dim, seed=4, scale=2.0)
    cos_sin = torch.randn(100, rotary)
    positions = torch.randint(0, 100, (tokens,), generator=torch.Generator().manual_seed(5))

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([hq * dim, hk * dim, hk * dim], dim=-1)
        return q.view(tokens, hq, dim), k.view(tokens, hk, dim), v.view(tokens, hk, dim)

    want_q, want_k = TORCH_OPS.rope(positions, *views(qkv.clone())[:2], cos_sin)
    mine = qkv.clone()
    q, k, v = views(mine)
    got_q, got_k = ops.rope(positions, q, k, cos_sin)
    _same_but_last_bits(got_q, want_q)
    _same_but_last_bits(got_k, want_k)
    assert torch.equal(v, views(qkv)[2])  # the values are not touched


def test_inputs_it_does_not_take_run_torchs_code(ops: native_ops.NativeOps) -> None:
    x, weight = torch.randn(4, 32), torch.randn(32)
    assert torch.equal(ops.rmsnorm(x, weight, 1e-6), TORCH_OPS.rmsnorm(x, weight, 1e-6))
    gelu_in = _bf16(3, 16, seed=6)
    assert torch.equal(ops.act_and_mul("gelu", gelu_in), TORCH_OPS.act_and_mul("gelu", gelu_in))
    q, k = _bf16(2, 2, 8, seed=7), _bf16(2, 1, 8, seed=8)
    far = torch.tensor([0, 50])  # past the cos/sin table: torch's indexing says so
    with pytest.raises(IndexError):
        ops.rope(far, q, k, torch.randn(10, 8))
    strided = _bf16(4, 64, seed=9)[:, ::2]  # not contiguous
    assert torch.equal(ops.rmsnorm(strided, weight.bfloat16(), 1e-6),
                       TORCH_OPS.rmsnorm(strided, weight.bfloat16(), 1e-6))


def test_a_bf16_cpu_runner_uses_them(tiny_models: dict[str, TinyModel]) -> None:
    runner = ModelRunner(WorkerConfig(str(tiny_models["llama"].folder), dtype="bfloat16",
                                      max_running_requests=2, max_context_len=32,
                                      max_total_tokens=128))
    assert isinstance(runner.fused_ops, native_ops.NativeOps)
    fp32 = ModelRunner(WorkerConfig(str(tiny_models["llama"].folder), dtype="float32",
                                    max_running_requests=2, max_context_len=32,
                                    max_total_tokens=128))
    assert not isinstance(fp32.fused_ops, native_ops.NativeOps)  # float32: torch's, exact
