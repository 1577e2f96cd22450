"""CUDA only: each `raydix::` operator's CUDA kernel (flashinfer) against the plain-torch
implementation on the same device. bfloat16 within rounding (flashinfer keeps the residual sum
and the norm's scale in float32 where transformers rounds between them); the K/V write and the
float32 fallbacks exactly."""

from __future__ import annotations

import pytest
import torch

from raydix.workers.layers.fused import fused_ops_for

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TORCH, FUSED = fused_ops_for("torch"), fused_ops_for("fused")
BF16 = dict(dtype=torch.bfloat16, device="cuda")


@pytest.fixture(autouse=True)
def _flashinfer() -> None:
    pytest.importorskip("flashinfer")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rmsnorm(gemma: bool) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(33, 2048, **BF16), torch.randn(2048, **BF16)  # type: ignore[arg-type]
    _close(FUSED.rmsnorm(x, w, 1e-5, gemma), TORCH.rmsnorm(x, w, 1e-5, gemma))
    heads = torch.randn(33, 48 * 64, **BF16).view(33, 48, 64)[:, :32]  # type: ignore[arg-type]
    _close(FUSED.rmsnorm(heads, w[:64], 1e-5, gemma), TORCH.rmsnorm(heads, w[:64], 1e-5, gemma))


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_add_rmsnorm(gemma: bool) -> None:
    torch.manual_seed(1)
    x, r = torch.randn(17, 2048, **BF16), torch.randn(17, 2048, **BF16)  # type: ignore[arg-type]
    w = torch.randn(2048, **BF16)  # type: ignore[arg-type]
    want_normed, want_residual = TORCH.add_rmsnorm(x.clone(), r.clone(), w, 1e-6, gemma)
    normed, residual = FUSED.add_rmsnorm(x, r, w, 1e-6, gemma)
    assert torch.equal(residual, want_residual)  # the sum rounds to bf16 the same way
    _close(normed, want_normed)


@pytest.mark.parametrize("rotary", [64, 32], ids=["full", "partial"])
def test_rope(rotary: int) -> None:
    torch.manual_seed(2)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
    angles = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).cuda()
    positions = torch.randint(0, 4096, (40,), device="cuda")
    qkv = torch.randn(40, (32 + 4 + 4) * 64, **BF16)  # type: ignore[arg-type]
    q, k = qkv[:, :2048].view(40, 32, 64), qkv[:, 2048:2304].view(40, 4, 64)
    want_q, want_k = TORCH.rope(positions, q.clone(), k.clone(), cos_sin)
    got_q, got_k = FUSED.rope(positions, q, k, cos_sin)
    _close(got_q, want_q)
    _close(got_k, want_k)
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated in place, in the projection's output


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
def test_act_and_mul(act: str) -> None:
    torch.manual_seed(3)
    x = torch.randn(29, 2 * 5632, **BF16)  # type: ignore[arg-type]
    _close(FUSED.act_and_mul(act, x), TORCH.act_and_mul(act, x))


def test_store_kv_is_exact() -> None:
    torch.manual_seed(4)
    page_size, pages, heads, dim = 16, 64, 4, 64
    k_buf = torch.zeros((pages + 1) * page_size, heads, dim, **BF16)  # type: ignore[arg-type]
    v_buf = torch.zeros_like(k_buf)
    slots = torch.randperm((pages + 1) * page_size, device="cuda")[:300].int()
    kv = torch.randn(300, 3 * heads, dim, **BF16)  # type: ignore[arg-type]
    k, v = kv[:, heads:2 * heads], kv[:, 2 * heads:]  # strided, as the model passes them
    want_k, want_v = k_buf.clone(), v_buf.clone()
    TORCH.store_kv(want_k, want_v, slots.long(), k, v, page_size)
    FUSED.store_kv(k_buf, v_buf, slots, k, v, page_size)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)


def test_float32_falls_back_to_torch_exactly() -> None:
    torch.manual_seed(5)
    x, r = torch.randn(5, 256, device="cuda"), torch.randn(5, 256, device="cuda")
    w = torch.randn(256, device="cuda")
    assert torch.equal(FUSED.rmsnorm(x, w, 1e-6), TORCH.rmsnorm(x, w, 1e-6))
    want = TORCH.add_rmsnorm(x.clone(), r.clone(), w, 1e-6)
    got = FUSED.add_rmsnorm(x.clone(), r.clone(), w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(FUSED.act_and_mul("silu", x), TORCH.act_and_mul("silu", x))
    k_buf, v_buf = torch.zeros(64, 4, 64, device="cuda"), torch.zeros(64, 4, 64, device="cuda")
    k, v = torch.randn(3, 4, 64, device="cuda"), torch.randn(3, 4, 64, device="cuda")
    FUSED.store_kv(k_buf, v_buf, torch.tensor([1, 9, 60], device="cuda").int(), k, v, 16)
    assert torch.equal(k_buf[[1, 9, 60]], k) and torch.equal(v_buf[[1, 9, 60]], v)


def _graph_kernels(folder: object, layers: int, tmp: object) -> int:
    """CUDA kernels of one batch-1 decode graph replay of the gpu_model's shape with `layers`
    layers (random weights)."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig, LlamaForCausalLM

    from raydix.workers.config import WorkerConfig
    from raydix.workers.runner import ModelRunner

    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = layers
    path = Path(str(tmp)) / f"llama-{layers}"
    LlamaForCausalLM(config).save_pretrained(path)
    runner = ModelRunner(WorkerConfig(str(path), device="cuda", dtype="bfloat16",
                                      attention_backend="flashinfer", cuda_graph=True,
                                      cuda_graph_max_batch=4, max_running_requests=4,
                                      max_context_len=128, max_total_tokens=2048))
    assert runner.fused_ops.name == "fused"
    graphs = runner.graph_runner
    assert graphs is not None
    graphs.graphs[1].replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs.graphs[1].replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA"
               and not e.name.startswith(("Memcpy", "Memset")))


def test_decode_graph_launches_at_most_15_kernels_per_layer(gpu_model: object,
                                                            tmp_path: object) -> None:
    """The budget of tests/workers/test_kernel_count.py, on the GPU itself: the kernels a
    decode graph replay launches per layer (the difference between 4 and 2 layers, halved, so
    the embedding, final norm and head are not counted)."""
    two, four = _graph_kernels(gpu_model, 2, tmp_path), _graph_kernels(gpu_model, 4, tmp_path)
    per_layer = (four - two) / 2
    print(f"decode graph replay: {two} kernels with 2 layers, {four} with 4: "
          f"{per_layer} per layer")
    assert per_layer <= 15, (two, four)
