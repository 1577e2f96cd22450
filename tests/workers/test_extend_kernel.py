"""Extend attention in its kernel (workers/attention/extend_kernel.py), each kind this CPU runs
(bf16 on AMX tiles or as AVX-512-BF16 dot products, float32 as AVX-512 multiply-adds): as close
to an exact causal reference as torch's flash kernel on the same inputs, at any length (chunks
of keys past 512), prefix, head grouping and head size it takes; a query never sees a later key;
inside the runner the bf16 prompt steps take the served kind and stay as close to the float32
model as with the path taken without it, and the float32 ones equal transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from raydix.workers.attention import extend_kernel, torch_backend
from raydix.workers.attention.torch_backend import TorchAttentionBackend
from raydix.workers.config import WorkerConfig
from raydix.workers.runner import ModelRunner

from .reference import HFReference
from .test_block_causal import _chunk_logits

pytestmark = pytest.mark.skipif(not extend_kernel.kernels(),
                                reason="no AMX tiles granted, no AVX-512-BF16 and no AVX-512 here")


@pytest.fixture(params=list(extend_kernel.KERNELS))
def kind(request: pytest.FixtureRequest) -> str:
    if not extend_kernel.available(request.param):
        pytest.skip(f"no {request.param} kernel on this CPU")
    return str(request.param)


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
           scale: float) -> torch.Tensor:
    """The causal attention in float64: q [n, Hq, D], k and v [Hk, prefix + n, D] -> [n, Hq, D]."""
    group = q.shape[1] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = torch.einsum("nhd,hld->hnl", q.double(), k) * scale
    allowed = torch.arange(k.shape[1])[None, :] <= torch.arange(q.shape[0])[:, None] + prefix
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hnl,hld->nhd", probs, v)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's CPU flash kernel on the same inputs: q [n, Hq, D] -> [n, Hq, D]."""
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
def test_as_close_to_an_exact_reference_as_flash(prefix: int, n: int, num_q_heads: int,
                                                 num_kv_heads: int, head_dim: int,
                                                 kind: str) -> None:
    dtype = extend_kernel.KERNELS[kind]
    gen = torch.Generator().manual_seed(prefix * 1000 + n)
    q = torch.randn(n, num_q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_kv_heads, prefix + n, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_kv_heads, prefix + n, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    assert extend_kernel.serves(q, num_kv_heads)
    got = extend_kernel.attention(q, k, v, scale, kind=kind)
    assert got.shape == q.shape and got.dtype == dtype
    exact = _exact(q, k, v, prefix, scale)
    err = (got.double() - exact).abs().max().item()
    flash_err = (_flash(q, k, v, scale).double() - exact).abs().max().item()
    if dtype == torch.bfloat16:  # the output's own bf16 rounding: flash's error, within a bit
        assert err <= flash_err + 2 ** -8, (err, flash_err)
    else:  # float32 roundings in sums of up to 700 terms, as flash's: a few 1e-7
        assert err <= 2 * flash_err + 1e-6, (err, flash_err)


@pytest.mark.parametrize(("prefix", "n", "num_kv_heads", "head_dim"),
                         [(0, 40, 3, 64), (512, 64, 3, 64), (600, 17, 2, 128)])
def test_on_the_pages_equals_the_keys_gathered_first(prefix: int, n: int, num_kv_heads: int,
                                                     head_dim: int, kind: str) -> None:
    """Given the pool's buffers and each key's row in them (slots scattered, as a cache that
    freed and reused them leaves them), the kernel reads the keys and values in place: the
    same result, bit for bit, as on the same keys gathered into [Hk, L, D] first; rows outside
    the buffers or of another type are refused."""
    dtype = extend_kernel.KERNELS[kind]
    gen = torch.Generator().manual_seed(prefix + n)
    num_slots, length = 2000, prefix + n
    k_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:length]
    rows = (slots[None, :] * num_kv_heads + torch.arange(num_kv_heads)[:, None]).reshape(-1)
    q = torch.randn(n, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    shape = (num_kv_heads, length, head_dim)
    k = k_buf.view(-1, head_dim)[rows].view(shape)
    v = v_buf.view(-1, head_dim)[rows].view(shape)
    want = extend_kernel.attention(q, k, v, head_dim ** -0.5, kind=kind)
    got = extend_kernel.attention(q, k_buf, v_buf, head_dim ** -0.5, kind=kind, rows=rows)
    assert torch.equal(got, want)
    exact = _exact(q, k, v, prefix, head_dim ** -0.5)
    assert (got.double() - exact).abs().max().item() < (2 ** -7 if dtype == torch.bfloat16
                                                        else 1e-5)
    for bad in (rows.clone().index_fill_(0, torch.tensor([5]), num_slots * num_kv_heads),
                rows.clone().index_fill_(0, torch.tensor([0]), -1), rows.int(), rows[1:]):
        with pytest.raises(ValueError, match="extend attention on the pool"):
            extend_kernel.attention(q, k_buf, v_buf, 0.125, kind=kind, rows=bad)


def test_a_query_never_sees_a_later_key(kind: str) -> None:
    """Changing the keys and values after position p leaves rows up to p unchanged."""
    dtype = extend_kernel.KERNELS[kind]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(600, 2, 64, generator=gen).to(dtype)
    k = torch.randn(1, 600, 64, generator=gen).to(dtype)
    v = torch.randn(1, 600, 64, generator=gen).to(dtype)
    before = extend_kernel.attention(q, k, v, 0.125, kind=kind)
    k[:, 530:], v[:, 530:] = 5.0, -5.0
    after = extend_kernel.attention(q, k, v, 0.125, kind=kind)
    assert torch.equal(before[:530], after[:530])
    assert not torch.equal(before[530:], after[530:])


def test_writes_into_the_output_given_and_refuses_mismatched_shapes(kind: str) -> None:
    dtype = extend_kernel.KERNELS[kind]
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(8, 2, 64, generator=gen).to(dtype)
    k = torch.randn(1, 10, 64, generator=gen).to(dtype)
    out = torch.zeros(20, 2, 64, dtype=dtype)
    extend_kernel.attention(q, k, k, 0.125, out[4:12], kind=kind)
    assert torch.equal(out[4:12], extend_kernel.attention(q, k, k, 0.125, kind=kind))
    assert not out[:4].any() and not out[12:].any()
    with pytest.raises(ValueError, match="extend attention"):
        extend_kernel.attention(q, k[:, :5], k[:, :5], 0.125, kind=kind)  # fewer keys than queries
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="extend attention"):  # another dtype than the kind's
        extend_kernel.attention(q.to(other), k.to(other), k.to(other), 0.125, kind=kind)
    assert not extend_kernel.serves(q.half(), 1) and not extend_kernel.serves(q[..., :32], 1)
    assert not extend_kernel.serves(q, 3)  # 2 query heads do not group over 3 key heads


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


def _record_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The prefix length of each extend the backend sends to the kernel, in order; each must
    read the keys on the pool's pages (rows given, no copy gathered first)."""
    calls: list[int] = []
    real = extend_kernel.attention

    def record(q: torch.Tensor, k: torch.Tensor, *rest: object,
               rows: torch.Tensor | None = None, **kw: object) -> torch.Tensor:
        assert rows is not None and k.dim() == 3, "the keys gathered, not read on the pages"
        calls.append(rows.numel() // k.shape[1] - q.shape[0])
        return real(q, k, *rest, rows=rows, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_backend.extend_kernel, "attention", record)
    return calls


def test_the_runner_takes_it_and_is_as_close_to_float32_as_without_it(
        dim64_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def runner(dtype: str) -> ModelRunner:
        return ModelRunner(WorkerConfig(str(dim64_model), dtype=dtype, max_running_requests=2,
                                        max_context_len=1024, max_total_tokens=2048))

    bf16, fp32 = runner("bfloat16"), runner("float32")
    backend = bf16.backend
    assert isinstance(backend, TorchAttentionBackend) and backend.extend_kernel
    if not extend_kernel.available(dtype=torch.bfloat16):
        pytest.skip("no bf16 kernel on this CPU")
    calls = _record_calls(monkeypatch)
    prompt = torch.randint(3, 250, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    for chunk in (600, 200):  # whole, and in chunks after a prefix
        exact = _chunk_logits(fp32, prompt, chunk).float()
        calls.clear()
        kernel = _chunk_logits(bf16, prompt, chunk).float()
        # every layer of every step, with the chunk's prefix
        assert calls == [p for p in range(0, 600, chunk) for _ in range(2)]
        backend.extend_kernel = False  # flash with AMX, the row blocks without
        other = _chunk_logits(bf16, prompt, chunk).float()
        backend.extend_kernel = True
        # each as far from float32 as the other (two bf16 paths differ by both their errors:
        # the dot products against the row blocks 0.09 apart where each is within 0.08-0.11)
        kernel_err, other_err = (kernel - exact).abs(), (other - exact).abs()
        assert kernel_err.mean() <= 1.5 * other_err.mean(), (kernel_err.mean(), other_err.mean())
        assert kernel_err.max() <= 1.5 * other_err.max(), (kernel_err.max(), other_err.max())


def test_float32_prompts_in_the_kernel_equal_transformers(
        dim64_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not extend_kernel.available(dtype=torch.float32):
        pytest.skip("no float32 kernel on this CPU (AVX-512)")
    runner = ModelRunner(WorkerConfig(str(dim64_model), dtype="float32", max_running_requests=2,
                                      max_context_len=1024, max_total_tokens=2048))
    calls = _record_calls(monkeypatch)
    prompt = torch.randint(3, 250, (600,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.inference_mode():
        hf = HFReference(dim64_model).model(torch.tensor([prompt])).logits[0]
    for chunk in (600, 200):  # whole, and in chunks after a prefix
        calls.clear()
        ours = _chunk_logits(runner, prompt, chunk)
        assert calls == [p for p in range(0, 600, chunk) for _ in range(2)]
        ends = [min(start + chunk, 600) - 1 for start in range(0, 600, chunk)]
        torch.testing.assert_close(ours, hf[ends], atol=1e-4, rtol=0)
