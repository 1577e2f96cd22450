"""Decode attention on the pages: the compiled kernel agrees with a per-request reference and
builds no dense copy of the keys and values."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from raydix.workers.attention import paged_decode

HK, G, D = 3, 3, 16


def _per_request(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                 slots: torch.Tensor, lens: torch.Tensor, scale: float = D ** -0.5) -> torch.Tensor:
    """Plain softmax attention, one request and one KV head at a time, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        own = slots[b, : int(lens[b])]
        for h in range(q.shape[1]):
            k, v = k_buf[own, h].double(), v_buf[own, h].double()
            probs = torch.softmax(q[b, h].double() @ k.T * scale, dim=-1)
            out[b, h] = probs @ v
    return out


@pytest.fixture(scope="module")
def kernel() -> paged_decode.Kernel:
    compiled = paged_decode.warm_up(HK, D, G, torch.float32)
    assert compiled is not None, "torch.compile of the decode attention failed on this machine"
    return compiled


def _case(batch: int, max_len: int, dtype: torch.dtype, seed: int
          ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    num_slots = 4 * batch * max_len
    k_buf = torch.randn(num_slots, HK, D, generator=gen).to(dtype)
    v_buf = torch.randn(num_slots, HK, D, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[: batch * max_len].view(batch, max_len)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[0] = max_len
    q = torch.randn(batch, HK, G, D, generator=gen).to(dtype)
    return q, k_buf, v_buf, slots, lens


@pytest.mark.parametrize(("batch", "max_len"), [(1, 1), (1, 37), (5, 64), (12, 130)])
def test_paged_decode_equals_per_request_attention(kernel: paged_decode.Kernel, batch: int,
                                                   max_len: int) -> None:
    q, k_buf, v_buf, slots, lens = _case(batch, max_len, torch.float32, batch + max_len)
    got = kernel(q, k_buf, v_buf, slots, lens)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _per_request(q, k_buf, v_buf, slots, lens),
                               atol=1e-5, rtol=1e-5)


def test_paged_decode_bf16_pool(kernel: paged_decode.Kernel) -> None:
    q, k_buf, v_buf, slots, lens = _case(6, 50, torch.bfloat16, 3)
    got = kernel(q, k_buf, v_buf, slots, lens)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _per_request(q, k_buf, v_buf, slots, lens),
                               atol=2e-2, rtol=2e-2)


def test_paged_decode_builds_no_dense_kv_copy(kernel: paged_decode.Kernel) -> None:
    batch, max_len = 16, 256
    q, k_buf, v_buf, slots, lens = _case(batch, max_len, torch.float32, 9)
    dense_bytes = batch * max_len * HK * D * 4  # what k_buf[slots] would allocate
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                         profile_memory=True) as prof:
        kernel(q, k_buf, v_buf, slots, lens)
    allocations = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocations, "the profiler saw no allocation at all (not even the output)"
    assert max(allocations) < dense_bytes / 4, (max(allocations), dense_bytes)
    # the uncompiled ops do build it: the check would catch a kernel that gathers
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                         profile_memory=True) as prof:
        paged_decode.paged_decode_reference(q, k_buf, v_buf, slots, lens)
    assert max(e.cpu_memory_usage for e in prof.events()) >= dense_bytes


def test_steps_after_warm_up_compile_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphs compiled at start serve the steps that follow, of any batch and length, with
    K and V as two tensors made outside inference mode (as the pool holds them) and the rest
    made inside it (as a step makes them): no step waits for the compiler again. (A batch or
    key count of 1 runs the plain ops: the engine calls the kernel from 4 requests of 64 keys.)"""
    torch._dynamo.reset()  # no graph compiled by another test may serve these calls
    monkeypatch.setattr(paged_decode, "_compiled", None)
    hk, g, d = 3, 3, 8  # a batch of 3 (or 8) would equal a head size
    kernel = paged_decode.warm_up(hk, d, g, torch.float32)
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    k_buf = torch.randn(2000, hk, d, generator=gen)
    v_buf = torch.randn(2000, hk, d, generator=gen)
    with torch.compiler.set_stance("fail_on_recompile"):
        for batch, max_len in ((1, 2), (1, 40), (2, 3), (3, 3), (8, 17), (16, 300)):
            with torch.inference_mode():
                slots = torch.randint(0, 2000, (batch, max_len), generator=gen)
                lens = torch.randint(2, max_len + 1, (batch,), generator=gen)
                q = torch.randn(batch, hk, g, d, generator=gen)
                kernel(q, k_buf, v_buf, slots, lens)


def test_head_sizes_are_compiled_static(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel is compiled for the model's head sizes (static: inductor vectorises the head
    dimension without runtime tails and spreads the softmax over the threads), the batch and
    key counts stay dynamic: other head sizes would need a new graph, other batches do not."""
    torch._dynamo.reset()
    monkeypatch.setattr(paged_decode, "_compiled", None)
    hk, g, d = 2, 2, 16
    kernel = paged_decode.warm_up(hk, d, g, torch.float32)
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)

    def call(batch: int, max_len: int, head_dim: int) -> None:
        k_buf = torch.randn(500, hk, head_dim, generator=gen)
        v_buf = torch.randn(500, hk, head_dim, generator=gen)
        with torch.inference_mode():
            slots = torch.randint(0, 500, (batch, max_len), generator=gen)
            q = torch.randn(batch, hk, g, head_dim, generator=gen)
            kernel(q, k_buf, v_buf, slots, torch.full((batch,), max_len))

    with torch.compiler.set_stance("fail_on_recompile"):
        call(5, 70, d)
        with pytest.raises(RuntimeError, match=r"[Rr]ecompil"):
            call(5, 70, 32)
