"""bf16 extend attention on CPU as row blocks (workers/attention/block_causal.py): equal to a
float32 causal reference at any length, prefix and head grouping; inside the runner as close
to the float32 model as torch's flash kernel on the same bf16 model."""

from __future__ import annotations

import pytest
import torch

from raydix.workers.attention import block_causal, torch_backend
from raydix.workers.attention.block_causal import block_causal_attention
from raydix.workers.attention.torch_backend import TorchAttentionBackend
from raydix.workers.config import WorkerConfig
from raydix.workers.runner import ModelRunner
from raydix.workers.step import ScheduledRequest, StepPlan

from .conftest import TinyModel


@pytest.fixture(params=["softmax kernel", "torch softmax"])
def softmax(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs with the C softmax (causal_softmax.c) and with torch's."""
    if request.param == "softmax kernel":
        assert block_causal.warm_up(), "the causal softmax kernel could not be built here"
    else:
        monkeypatch.setattr(block_causal, "_softmax", None)
    return str(request.param)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
               scale: float) -> torch.Tensor:
    """float32, one head at a time, each query row against keys [0, prefix + row]: [n, Hq, D]."""
    num_q_heads, n, _ = q.shape
    group = num_q_heads // k.shape[0]
    q, k, v = q.float(), k.float(), v.float()
    allowed = torch.arange(prefix + n)[None, :] <= torch.arange(n)[:, None] + prefix
    out = []
    for h in range(num_q_heads):
        scores = (q[h] @ k[h // group].T) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out.append(probs @ v[h // group])
    return torch.stack(out, dim=1)


@pytest.mark.parametrize(("prefix", "n"), [
    (0, 2), (0, 7), (0, 128), (0, 130), (0, 300),  # whole prompts: one block, several, a tail
    (37, 64), (500, 200),  # chunks after a prefix
    (1100, 70),  # past LONG_KEYS: the smaller blocks
])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(6, 2, 16), (4, 4, 32)])
def test_equals_a_float32_causal_reference(prefix: int, n: int, num_q_heads: int,
                                           num_kv_heads: int, head_dim: int, softmax: str
                                           ) -> None:
    gen = torch.Generator().manual_seed(prefix * 1000 + n)
    q = torch.randn(num_q_heads, n, head_dim, generator=gen).bfloat16()
    k = torch.randn(num_kv_heads, prefix + n, head_dim, generator=gen).bfloat16()
    v = torch.randn(num_kv_heads, prefix + n, head_dim, generator=gen).bfloat16()
    scale = head_dim ** -0.5
    got = block_causal_attention(q, k, v, prefix, scale)
    assert got.shape == (n, num_q_heads, head_dim) and got.dtype == torch.bfloat16
    # bf16 scores and probabilities (as transformers' eager bf16 attention): outputs of
    # magnitude ~1 within a few bf16 steps
    torch.testing.assert_close(got.float(), _reference(q, k, v, prefix, scale), atol=3e-2,
                               rtol=3e-2)


def test_the_softmax_kernel_rounds_as_torch_does() -> None:
    """The kernel's probabilities against torch's masked bf16 softmax on the same scores:
    equal but for the odd last-bit rounding, masked keys exactly 0."""
    assert block_causal.warm_up()
    gen = torch.Generator().manual_seed(8)
    rows, keys = 96, 400
    scores = (torch.randn(3, 2, rows, keys, generator=gen) * 4).bfloat16()
    above = torch.ones(rows, rows, dtype=torch.bool).triu(1)
    want = scores.clone()
    want[..., keys - rows:].masked_fill_(above, float("-inf"))
    want = torch.softmax(want, dim=-1)
    got = block_causal._masked_softmax(scores.clone(), rows)
    assert (got == want).float().mean() > 0.999
    torch.testing.assert_close(got.float(), want.float(), atol=2 ** -9, rtol=2 ** -7)
    assert not got[..., keys - rows:][..., above].any()


def test_a_query_never_sees_a_later_key(softmax: str) -> None:
    """Changing the keys and values after position p leaves rows up to p unchanged."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 300, 16, generator=gen).bfloat16()
    k = torch.randn(1, 300, 16, generator=gen).bfloat16()
    v = torch.randn(1, 300, 16, generator=gen).bfloat16()
    before = block_causal_attention(q, k, v, 0, 0.25)
    k[:, 200:], v[:, 200:] = 5.0, -5.0
    after = block_causal_attention(q, k, v, 0, 0.25)
    assert torch.equal(before[:200], after[:200])
    assert not torch.equal(before[200:], after[200:])


def test_mismatched_shapes_are_refused() -> None:
    q, k = torch.zeros(6, 8, 16, dtype=torch.bfloat16), torch.zeros(2, 10, 16,
                                                                    dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one causal extend"):
        block_causal_attention(q, k, k, 1, 0.25)  # 10 keys are not 1 + 8


def _chunk_logits(runner: ModelRunner, prompt: list[int], chunk: int) -> torch.Tensor:
    """The last logits of each step of `prompt` fed `chunk` tokens a step (later chunks attend
    to the earlier ones through the pool)."""
    first = runner.kv_pool.config.page_size
    slots = list(range(first, first + len(prompt)))
    out = []
    for step, start in enumerate(range(0, len(prompt), chunk)):
        ids = prompt[start:start + chunk]
        plan = StepPlan.build(step, [ScheduledRequest(0, start, ids,
                                                      slots[start:start + len(ids)])])
        out.append(runner.forward(plan))
    return torch.cat(out)


def test_the_runner_is_as_close_to_float32_as_with_the_flash_kernel(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_models["llama"]

    def runner(dtype: str) -> ModelRunner:
        return ModelRunner(WorkerConfig(str(m.folder), dtype=dtype, max_running_requests=2,
                                        max_context_len=512, max_total_tokens=1024))

    bf16, fp32 = runner("bfloat16"), runner("float32")
    backend = bf16.backend
    assert isinstance(backend, TorchAttentionBackend)
    calls = []
    monkeypatch.setattr(torch_backend, "block_causal_attention",
                        lambda *args: calls.append(args[3]) or block_causal_attention(*args))
    prompt = (m.prompts[0] * 40)[:240]  # within the tiny model's 256 positions
    for chunk in (240, 80):  # whole, and in chunks after a prefix
        exact = _chunk_logits(fp32, prompt, chunk).float()
        backend.block_causal = True
        blocks = _chunk_logits(bf16, prompt, chunk).float()
        backend.block_causal = False
        flash = _chunk_logits(bf16, prompt, chunk).float()
        torch.testing.assert_close(blocks, flash, atol=6e-2, rtol=6e-2)
        # bf16 scores cost no more than the flash kernel's bf16 rounding elsewhere does
        blocks_err, flash_err = (blocks - exact).abs().mean(), (flash - exact).abs().mean()
        assert blocks_err <= 1.5 * flash_err, (blocks_err, flash_err)
    num_layers = bf16.model_config.num_layers
    # every layer of every bf16 step past 128 keys took the blocks, with the chunk's prefix
    # (the first 80-token chunk, 80 keys, the flash kernel)
    assert calls == [p for p in (0, 80, 160) for _ in range(num_layers)]


@pytest.mark.parametrize("amx", [False, True])
def test_the_row_blocks_run_where_the_cpu_has_no_amx_tiles(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    """With AMX tiles torch's flash kernel is faster in bf16 (block_causal.py): a bf16 prompt
    past `MIN_KEYS` takes the row blocks only where the CPU has none."""
    m = tiny_models["llama"]
    monkeypatch.setattr(torch_backend, "amx_tiles", lambda: amx)
    runner = ModelRunner(WorkerConfig(str(m.folder), dtype="bfloat16", max_running_requests=2,
                                      max_context_len=512, max_total_tokens=1024))
    assert isinstance(runner.backend, TorchAttentionBackend)
    assert runner.backend.block_causal is not amx
    calls = []
    monkeypatch.setattr(torch_backend, "block_causal_attention",
                        lambda *args: calls.append(args[3]) or block_causal_attention(*args))
    prompt = (m.prompts[0] * 40)[:block_causal.MIN_KEYS + 20]
    logits = _chunk_logits(runner, prompt, len(prompt))
    assert torch.isfinite(logits).all()
    assert len(calls) == (0 if amx else runner.model_config.num_layers)
