"""The CPU speed paths: oneDNN-packed linear weights, glibc keeping freed activations, decode
batches split by length."""

from __future__ import annotations

import platform
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raydix.workers.attention.torch_backend import (
    TorchAttentionBackend,
    split_by_length,
)
from raydix.workers.config import WorkerConfig
from raydix.workers.cpu_features import native_bf16
from raydix.workers.host_memory import keep_freed_memory
from raydix.workers.layers import packed as packed_module
from raydix.workers.layers.packed import (
    linear,
    pack_weight,
    packing_supported,
    pick_cpu_dtype,
)
from raydix.workers.runner import ModelRunner
from raydix.workers.step import ScheduledRequest, StepPlan

from .conftest import TinyModel

needs_onednn = pytest.mark.skipif(
    not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN linear ops")


@needs_onednn
@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_packed_linear_equals_plain(num_rows: int) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(num_rows, 64, generator=gen)
    packed = pack_weight(weight, batch_hint=64)  # a hint other than num_rows still works
    torch.testing.assert_close(linear(x, weight, packed, bias), F.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, weight, None), F.linear(x, weight))


def _logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    first_slot = runner.kv_pool.config.page_size
    plan = StepPlan.build(1, [ScheduledRequest(0, 0, prompt, list(range(first_slot, first_slot
                                                                        + len(prompt))))])
    return runner.forward(plan)


@needs_onednn
def test_runner_packs_every_linear_and_keeps_the_logits(
        tiny_models: dict[str, TinyModel]) -> None:
    m = tiny_models["llama"]
    config = WorkerConfig(str(m.folder), max_running_requests=2, max_context_len=64,
                          max_total_tokens=128)
    packed = ModelRunner(config)
    plain = ModelRunner(WorkerConfig(**{**config.__dict__, "cpu_packed_linear": False}))
    num_layers = packed.model_config.num_layers
    plain_modules = dict(plain.model.named_modules())
    slots = [(name, mod) for name, mod in packed.model.named_modules()
             if hasattr(mod, "packed_weight")]
    assert len(slots) == 4 * num_layers + 1  # qkv, o, gate_up, down per layer + the LM head
    for name, mod in slots:  # one copy per linear layer: the packed one, holding the weight
        assert mod.weight is None and mod.packed_weight is not None, name
        assert "weight" not in dict(mod.named_parameters()), name
        assert torch.equal(mod.packed_weight.to_dense(), plain_modules[name].weight), name
    assert all(getattr(mod, "packed_weight", None) is None for mod in plain.model.modules())
    # the packed weights replace the plain ones: the same bytes, so as many KV slots fit
    assert packed.weight_bytes == plain.weight_bytes
    prompt = m.prompts[0]
    np.testing.assert_allclose(_logits(packed, prompt).numpy(), _logits(plain, prompt).numpy(),
                               atol=1e-4, rtol=0)


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                    reason="no native bf16 on this CPU (avx512_bf16 or amx)")
def test_bf16_is_packed_where_native_and_agrees_with_plain_bf16(
        tiny_models: dict[str, TinyModel]) -> None:
    m = tiny_models["llama"]
    config = WorkerConfig(str(m.folder), dtype="bfloat16", max_running_requests=2,
                          max_context_len=64, max_total_tokens=128)
    packed, plain = ModelRunner(config), ModelRunner(
        WorkerConfig(**{**config.__dict__, "cpu_packed_linear": False}))
    layer = packed.model.model.layers[0].mlp.down_proj
    assert layer.weight is None and layer.packed_weight.dtype == torch.bfloat16
    assert packed.kv_pool.config.dtype == torch.bfloat16
    for prompt in m.prompts:  # the tolerance of the bf16 kernel comparisons on CUDA
        torch.testing.assert_close(_logits(packed, prompt).float(), _logits(plain, prompt).float(),
                                   atol=3e-2, rtol=3e-2)


def test_dtype_auto_measures_where_bf16_is_native(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger=packed_module.__name__)
    picked = pick_cpu_dtype(576, 1536, repeats=2)  # SmolLM2-135M's down projection
    if native_bf16():
        assert picked in (torch.float32, torch.bfloat16)
        assert "fp32" in caplog.text and "bf16" in caplog.text  # both were timed
    monkeypatch.setattr(packed_module, "native_bf16", lambda: False)
    caplog.clear()
    assert pick_cpu_dtype(576, 1536, repeats=2) == torch.float32
    assert "no native bf16" in caplog.text


def test_dtype_auto_keeps_fp32_for_a_small_linear_without_timing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A tiny model's linear is call overhead in either dtype: the pick would be a coin toss,
    so it is fp32, the same in every process."""
    caplog.set_level("INFO", logger=packed_module.__name__)
    monkeypatch.setattr(packed_module, "native_bf16", lambda: True)
    monkeypatch.setattr(packed_module, "linear", _fail_if_called)
    assert pick_cpu_dtype(64, 192, repeats=2) == torch.float32
    assert "too small" in caplog.text


def _fail_if_called(*args: object) -> None:
    raise AssertionError("timed a linear")


@pytest.mark.parametrize(("fp32_ms", "bf16_ms", "expected"),
                         [((20.0,), (10.0,), torch.bfloat16), ((11.0,), (10.0,), torch.float32),
                          ((10.0,), (20.0,), torch.float32),
                          # as fast at one row, twice at a batch and a prefill: bf16
                          ((10.0, 20.0, 20.0), (10.0, 10.0, 10.0), torch.bfloat16),
                          # faster at one row count only, by half: not enough over the three
                          ((10.0, 10.0, 15.0), (10.0, 10.0, 10.0), torch.float32)])
def test_dtype_auto_picks_bf16_only_when_clearly_faster(
        monkeypatch: pytest.MonkeyPatch, fp32_ms: tuple[float, ...], bf16_ms: tuple[float, ...],
        expected: torch.dtype) -> None:
    """bf16 must be `BF16_MIN_SPEEDUP` faster over one row, a batch's and a prefill's rows (the
    geometric mean): a few percent either way is the machine's noise, and one row alone is not
    the work. Times are per row count (one value: every row count). (Sleeps of 10 ms and more:
    a sleep of 1 ms overran by half a millisecond on a busy machine, which made 1.1 against 1.0
    ms look 1.3x.)"""
    if not packing_supported(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN linear ops")
    monkeypatch.setattr(packed_module, "native_bf16", lambda: True)
    monkeypatch.setattr(packed_module, "pack_weight", lambda weight, rows: weight)
    delay = {torch.float32: fp32_ms, torch.bfloat16: bf16_ms}
    rows = (1, 16, 256)

    def timed(x: torch.Tensor, weight: None, packed: torch.Tensor) -> None:
        times = delay[packed.dtype]
        time.sleep(times[rows.index(x.shape[0])] / 1e3 if len(times) > 1 else times[0] / 1e3)

    monkeypatch.setattr(packed_module, "linear", timed)
    assert pick_cpu_dtype(576, 1536, rows=rows, repeats=3) == expected


def test_runner_with_dtype_auto_runs_the_dtype_it_picked(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_models["llama"]
    monkeypatch.setattr(packed_module, "native_bf16", lambda: False)
    runner = ModelRunner(WorkerConfig(str(m.folder), dtype="auto", max_running_requests=2,
                                      max_context_len=64, max_total_tokens=128))
    assert runner.dtype == runner.kv_pool.config.dtype == torch.float32
    with pytest.raises(ValueError, match="auto"):
        _ = WorkerConfig(str(m.folder), dtype="float8").torch_dtype


_LAYERS_SCRIPT = """
import resource, sys, torch
from raydix.workers.host_memory import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
size = 24 << 20  # a prefill MLP activation
faults = []
for _ in range(12):  # three activations alive at once, all freed at the end, like a layer
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    acts = [torch.ones(size // 4) for _ in range(3)]
    del acts
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def _layer_faults(mode: str) -> list[int]:
    """Minor page faults of each of 12 layer-like alloc/free rounds, in a fresh interpreter
    (the heap of this test process depends on what ran before it)."""
    out = subprocess.run([sys.executable, "-c", _LAYERS_SCRIPT, mode], capture_output=True,
                         text=True, timeout=120, check=True)
    return [int(n) for n in out.stdout.split()]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc only")
def test_freed_activations_are_reused_without_page_faults() -> None:
    assert keep_freed_memory()
    default, kept = _layer_faults("default"), _layer_faults("kept")
    # The first round faults its fresh pages either way, and the heap may grow once or twice
    # more. Kept in the heap, the freed blocks are then reused: after a few rounds nothing
    # faults. glibc's defaults trim and map them again; in some runs its thresholds adapt after
    # three rounds, in most it faults about 12,000 pages every round for good (measured here).
    # Where the defaults adapt as early, both fault the same rounds, give or take a few pages
    # (18,464 against 18,482 in one run): never worse by more than that noise.
    assert sum(kept[4:]) < 1000, (kept, default)
    assert sum(kept[1:]) <= sum(default[1:]) + 1000, (kept, default)


def test_decode_batch_splits_by_length_only_when_it_pays() -> None:
    lens = np.array([10, 500, 12, 11, 520, 13])
    short, long = split_by_length(np.arange(6) + 100, lens)
    assert short.tolist() == [100, 102, 103, 105] and long.tolist() == [101, 104]
    assert [p.tolist() for p in split_by_length(np.arange(4), np.array([500, 510, 505, 520]))
            ] == [[0, 1, 2, 3]]
    assert [p.tolist() for p in split_by_length(np.arange(2), np.array([5, 500]))] == [[0, 1]]
    assert split_by_length(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)) == []


def test_split_decode_batch_equals_each_request_alone(tiny_models: dict[str, TinyModel]) -> None:
    m = tiny_models["llama"]
    # the dense copies' path (the paged kernel reads each request's own keys: nothing to split)
    runner = ModelRunner(WorkerConfig(str(m.folder), max_running_requests=8, max_context_len=128,
                                      max_total_tokens=1024, cpu_compiled_attention=False))
    rng = np.random.default_rng(0)
    prompt_lens = [5, 6, 70, 7, 60, 8]
    assert len(split_by_length(np.arange(6), np.array(prompt_lens) + 1)) == 2
    prompts = [rng.integers(1, 250, size=n).tolist() for n in prompt_lens]
    slot = runner.kv_pool.config.page_size
    extends = []
    for row, prompt in enumerate(prompts):
        extends.append(ScheduledRequest(row, 0, prompt, list(range(slot, slot + len(prompt)))))
        slot += len(prompt)
    runner.forward(StepPlan.build(1, extends))
    decodes = [ScheduledRequest(row, len(p), [3], [slot + row]) for row, p in enumerate(prompts)]
    together = runner.forward(StepPlan.build(2, decodes))
    for row, req in enumerate(decodes):
        alone = runner.forward(StepPlan.build(3 + row, [req]))
        torch.testing.assert_close(together[row: row + 1], alone, rtol=1e-5, atol=1e-5)


def test_paged_kernel_runs_for_every_decode_step_and_equals_dense(
        tiny_models: dict[str, TinyModel]) -> None:
    """Decode steps of four requests and of one run the paged kernel, once a layer for the
    whole batch (no split by length: it reads each request's own keys); it gives what the
    dense copies give for the same batch."""
    m = tiny_models["llama"]
    runner = ModelRunner(WorkerConfig(str(m.folder), max_running_requests=8, max_context_len=256,
                                      max_total_tokens=1024))
    backend = runner.backend
    assert isinstance(backend, TorchAttentionBackend)
    kernel = backend.paged_kernel
    assert kernel is not None, "the paged kernel could not be built on this machine"
    calls: list[int] = []

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return kernel(*args)

    rng = np.random.default_rng(1)
    prompt_lens = [9, 95, 100, 30]  # far apart: the dense path would split them in two
    slot = runner.kv_pool.config.page_size
    extends = []
    for row, n in enumerate(prompt_lens):
        prompt = rng.integers(1, 250, size=n).tolist()
        extends.append(ScheduledRequest(row, 0, prompt, list(range(slot, slot + n))))
        slot += n
    runner.forward(StepPlan.build(1, extends))
    decodes = [ScheduledRequest(row, n, [3], [slot + row]) for row, n in enumerate(prompt_lens)]
    backend.paged_kernel = counted
    paged = runner.forward(StepPlan.build(2, decodes))
    layers = runner.kv_pool.config.num_layers
    assert calls == [4] * layers  # one call per layer, the whole batch
    calls.clear()
    alone = runner.forward(StepPlan.build(3, decodes[:1]))
    assert calls == [1] * layers
    backend.paged_kernel = None
    dense = runner.forward(StepPlan.build(4, decodes))
    torch.testing.assert_close(paged, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, dense[:1], rtol=1e-5, atol=1e-5)
