"""bf16 extend attention in its kernel (workers/attention/extend_bf16.py), each kind this CPU
runs (AMX tiles, AVX-512-BF16 dot products): as close to a float32 causal reference as torch's
flash kernel, at any length (chunks of keys past 512), prefix, head grouping and head size it
takes; a query never sees a later key; inside the runner the prompt steps take the served kind
and stay as close to the float32 model as with the path taken without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from raydix.workers.attention import extend_bf16, torch_backend
from raydix.workers.attention.torch_backend import TorchAttentionBackend
from raydix.workers.config import WorkerConfig
from raydix.workers.runner import ModelRunner

from .test_block_causal import _chunk_logits, _reference

pytestmark = pytest.mark.skipif(not extend_bf16.available(),
                                reason="no AMX tiles granted and no AVX-512-BF16 here")


@pytest.fixture(params=extend_bf16.KERNELS)
def kind(request: pytest.FixtureRequest) -> str:
    if not extend_bf16.available(request.param):
        pytest.skip(f"no {request.param} kernel on this CPU")
    return str(request.param)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's CPU flash kernel on the same bf16 inputs: q [n, Hq, D] -> [n, Hq, D]."""
    n, num_keys = q.shape[0], k.shape[1]
    allowed = torch.arange(num_keys)[None, :] <= torch.arange(n)[:, None] + (num_keys - n)
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                          attn_mask=allowed, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize(("prefix", "n"), [
    (0, 1), (0, 17), (0, 512), (0, 700),  # whole prompts: a partial block, one chunk, two
    (5, 17), (512, 64), (1000, 33), (700, 100),  # chunks after a prefix, across 512 keys
])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"),
                         [(9, 3, 64), (4, 4, 64), (4, 2, 128)])
def test_as_close_to_a_float32_reference_as_flash(prefix: int, n: int, num_q_heads: int,
                                                 num_kv_heads: int, head_dim: int,
                                                 kind: str) -> None:
    gen = torch.Generator().manual_seed(prefix * 1000 + n)
    q = torch.randn(n, num_q_heads, head_dim, generator=gen).bfloat16()
    k = torch.randn(num_kv_heads, prefix + n, head_dim, generator=gen).bfloat16()
    v = torch.randn(num_kv_heads, prefix + n, head_dim, generator=gen).bfloat16()
    scale = head_dim ** -0.5
    assert extend_bf16.serves(q, num_kv_heads)
    got = extend_bf16.attention(q, k, v, scale, kind=kind)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    exact = _reference(q.transpose(0, 1), k, v, prefix, scale)
    err = (got.float() - exact).abs().max().item()
    flash_err = (_flash(q, k, v, scale).float() - exact).abs().max().item()
    # the output's own bf16 rounding: flash's error, within a last bit
    assert err <= flash_err + 2 ** -8, (err, flash_err)


def test_a_query_never_sees_a_later_key(kind: str) -> None:
    """Changing the keys and values after position p leaves rows up to p unchanged."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(600, 2, 64, generator=gen).bfloat16()
    k = torch.randn(1, 600, 64, generator=gen).bfloat16()
    v = torch.randn(1, 600, 64, generator=gen).bfloat16()
    before = extend_bf16.attention(q, k, v, 0.125, kind=kind)
    k[:, 530:], v[:, 530:] = 5.0, -5.0
    after = extend_bf16.attention(q, k, v, 0.125, kind=kind)
    assert torch.equal(before[:530], after[:530])
    assert not torch.equal(before[530:], after[530:])


def test_writes_into_the_output_given_and_refuses_mismatched_shapes(kind: str) -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(8, 2, 64, generator=gen).bfloat16()
    k = torch.randn(1, 10, 64, generator=gen).bfloat16()
    out = torch.zeros(20, 2, 64, dtype=torch.bfloat16)
    extend_bf16.attention(q, k, k, 0.125, out[4:12], kind=kind)
    assert torch.equal(out[4:12], extend_bf16.attention(q, k, k, 0.125, kind=kind))
    assert not out[:4].any() and not out[12:].any()
    with pytest.raises(ValueError, match="extend attention"):
        extend_bf16.attention(q, k[:, :5], k[:, :5], 0.125, kind=kind)  # fewer keys than queries
    assert not extend_bf16.serves(q.float(), 1) and not extend_bf16.serves(q[..., :32], 1)


@pytest.fixture(scope="module")
def dim64_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose heads have 64 dims (the kernel's), 2 query heads on 1 key head."""
    torch.manual_seed(99)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=250, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
        initializer_range=0.15, rms_norm_eps=1e-6))
    folder = tmp_path_factory.mktemp("dim64")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_the_runner_takes_it_and_is_as_close_to_float32_as_without_it(
        dim64_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def runner(dtype: str) -> ModelRunner:
        return ModelRunner(WorkerConfig(str(dim64_model), dtype=dtype, max_running_requests=2,
                                        max_context_len=1024, max_total_tokens=2048))

    bf16, fp32 = runner("bfloat16"), runner("float32")
    backend = bf16.backend
    assert isinstance(backend, TorchAttentionBackend) and backend.bf16_extend
    calls = []
    real = extend_bf16.attention
    monkeypatch.setattr(torch_backend.extend_bf16, "attention",
                        lambda q, k, *rest: calls.append(k.shape[1] - q.shape[0])
                        or real(q, k, *rest))
    prompt = torch.randint(3, 250, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    for chunk in (600, 200):  # whole, and in chunks after a prefix
        exact = _chunk_logits(fp32, prompt, chunk).float()
        calls.clear()
        kernel = _chunk_logits(bf16, prompt, chunk).float()
        # every layer of every step, with the chunk's prefix
        assert calls == [p for p in range(0, 600, chunk) for _ in range(2)]
        backend.bf16_extend = False  # flash with AMX, the row blocks without
        other = _chunk_logits(bf16, prompt, chunk).float()
        backend.bf16_extend = True
        # each as far from float32 as the other (two bf16 paths differ by both their errors:
        # the dot products against the row blocks 0.09 apart where each is within 0.08-0.11)
        kernel_err, other_err = (kernel - exact).abs(), (other - exact).abs()
        assert kernel_err.mean() <= 1.5 * other_err.mean(), (kernel_err.mean(), other_err.mean())
        assert kernel_err.max() <= 1.5 * other_err.max(), (kernel_err.max(), other_err.max())
