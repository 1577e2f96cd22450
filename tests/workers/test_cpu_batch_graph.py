"""The CPU decode graph's batched graph (workers/cpu_decode_graph.py, `BATCHED_DTYPES`): decode
steps of two or more requests run one compiled graph whatever their number and lengths
(nothing compiles after the warm-up), and their logits agree with the eager step's: within
1e-4 in fp32 (its products are the eager step's oneDNN calls), within bf16's rounding in bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydix.workers import cpu_decode_graph, graph_head
from raydix.workers.config import WorkerConfig
from raydix.workers.layers import packed_gemv, small_gemm
from raydix.workers.runner import ModelRunner
from raydix.workers.step import ScheduledRequest, StepPlan

from .conftest import TinyModel

STEPS = 6
TOLERANCES = {"bfloat16": dict(atol=0.1, rtol=0.05),  # two bf16 paths rounding differently
              "float32": dict(atol=1e-4, rtol=0.0)}


def _runner(m: TinyModel, graph: bool, dtype: str = "bfloat16") -> ModelRunner:
    return ModelRunner(WorkerConfig(str(m.folder), dtype=dtype, max_running_requests=5,
                                    max_context_len=64, max_total_tokens=512,
                                    cpu_decode_graph=graph))


def _decode_logits(runner: ModelRunner, prompts: list[list[int]],
                   tokens: list[list[int]]) -> list[np.ndarray]:
    """Prefill `prompts` in one step, then decode them side by side on the given tokens
    (teacher-forced, so that two runners see the same inputs); each step's logits [B, vocab].
    Requests drop out as their tokens run out: the batch shrinks."""
    first = runner.kv_pool.config.page_size + 7
    slots = []
    for p, t in zip(prompts, tokens, strict=True):
        slots.append(list(range(first, first + len(p) + len(t))))
        first += len(p) + len(t)
    runner.forward(StepPlan.build(0, [ScheduledRequest(1 + i, 0, p, s[:len(p)])
                                      for i, (p, s) in enumerate(zip(prompts, slots,
                                                                     strict=True))]))
    steps = []
    for step in range(max(len(t) for t in tokens)):
        logits = runner.forward(StepPlan.build(1 + step, [
            ScheduledRequest(1 + i, len(p) + step, [t[step]], [s[len(p) + step]])
            for i, (p, s, t) in enumerate(zip(prompts, slots, tokens, strict=True))
            if step < len(t)]))
        steps.append(logits.float().numpy())
    return steps


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_batches_run_one_graph_and_agree_with_the_eager_step(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    m = tiny_models["llama"]
    graph_runner, eager = _runner(m, True, dtype), _runner(m, False, dtype)
    graph = graph_runner.decode_graph
    assert graph is not None and graph._batch_layers is not None
    batched: list[int] = []
    real = graph._replay_batch
    monkeypatch.setattr(graph, "_replay_batch", lambda batch: batched.append(batch.batch_size)
                        or real(batch))
    # four requests of different lengths; two stop early, so the steps have 4, then 3 requests
    prompts = [*m.prompts, m.prompts[0][:4] + m.prompts[1]]
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(3, 250, (n,), generator=gen).tolist()
              for n in (STEPS, STEPS, STEPS // 2, STEPS)]
    with torch._dynamo.config.patch(error_on_recompile=True), torch.profiler.profile(
            record_shapes=True) as prof:  # the warm-up compiled it all
        got = _decode_logits(graph_runner, prompts, tokens)
    assert batched == [4] * (STEPS // 2) + [3] * (STEPS - STEPS // 2)
    # the batches' products: the small-GEMM kernel where this CPU computes the dtype (four a
    # layer: 3 or 4 rows against a decoder layer's weight; the eager prompt step's products of
    # a few rows, the plain float32 LM head's among them, may take it too and are not counted)
    vocab = graph_runner.model_config.vocab_size
    products = sum(e.name == "raydix::small_gemm" and e.input_shapes[0][0] in (3, 4)
                   and e.input_shapes[1][0] != vocab for e in prof.events())
    expected = (small_gemm.warm_up() and small_gemm.computes(getattr(torch, dtype))
                and not graph_head.layers_packed(getattr(torch, dtype)))  # packed: oneDNN's
    assert products == (STEPS * 4 * graph_runner.kv_pool.config.num_layers if expected else 0)
    want = _decode_logits(eager, prompts, tokens)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(w), **TOLERANCES[dtype])
    # the comparison can fail: the logits move by more than its tolerance from step to step
    assert float(np.abs(got[1] - got[0]).max()) > 1.0


def test_larger_float32_batches_agree_with_the_eager_step(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 17 down to 5 requests: the batched graph's float32 products of more than 4 rows
    take the small-GEMM kernel's lanes path (chunks of 16 and 8 rows, part-filled), the eager
    step's are oneDNN's on packed weights; the logits agree. (Float32 layers stay plain beside
    the graph where the packed-weight kernel does not run, as on a CPU without AVX-512.)"""
    monkeypatch.setattr(packed_gemv, "warm_up", lambda: False)
    m = tiny_models["llama"]

    def runner(graph: bool) -> ModelRunner:
        return ModelRunner(WorkerConfig(str(m.folder), dtype="float32", max_running_requests=20,
                                        max_context_len=64, max_total_tokens=1024,
                                        cpu_decode_graph=graph))

    graph_runner, eager = runner(True), runner(False)
    gen = torch.Generator().manual_seed(7)
    # requests stop one group after another: steps of 17, 16, 9, 8 and 5 requests
    lengths = [1] + [2] * 7 + [3] + [4] * 3 + [5] * 5
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist()
               for n in torch.randint(2, 12, (len(lengths),), generator=gen)]
    tokens = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]
    with torch._dynamo.config.patch(error_on_recompile=True), torch.profiler.profile(
            record_shapes=True) as prof:
        got = _decode_logits(graph_runner, prompts, tokens)
    assert [g.shape[0] for g in got] == [17, 16, 9, 8, 5]
    vocab = graph_runner.model_config.vocab_size
    rows = sorted(e.input_shapes[0][0] for e in prof.events()
                  if e.name == "raydix::small_gemm" and e.input_shapes[1][0] != vocab
                  and e.input_shapes[0][0] in (17, 16, 9, 8, 5))
    layers = graph_runner.kv_pool.config.num_layers
    expected = small_gemm.warm_up() and small_gemm.computes(torch.float32)
    assert rows == (sorted([17, 16, 9, 8, 5] * 4 * layers) if expected else [])
    want = _decode_logits(eager, prompts, tokens)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(w),
                                   **TOLERANCES["float32"])


def test_steps_that_skip_the_guards_run_the_graphs_the_guards_would_pick(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """After the warm-up a step skips dynamo's guard checks; the graph each call runs (the first
    layer's or another's, one request's or a batch's) must be the one the guards pick: the
    same logits, bit for bit, with and without skipping."""
    m = tiny_models["llama"]
    runner = _runner(m, graph=True)
    graph = runner.decode_graph
    assert graph is not None and graph.skip_guards
    skipped: list[bool] = []
    real = cpu_decode_graph._as_warmed_up
    monkeypatch.setattr(cpu_decode_graph, "_as_warmed_up",
                        lambda batch: skipped.append(real(batch)) or skipped[-1])
    prompts = [*m.prompts, m.prompts[0][:4] + m.prompts[1]]
    gen = torch.Generator().manual_seed(5)
    # steps of 4 requests (the batched graph), then 2 and 1 (the one-request graphs)
    tokens = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (6, 4, 2, 2)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        fast = _decode_logits(runner, prompts, tokens)
    assert skipped and all(skipped)  # the runner's inputs are of the warm-up's kind
    graph.skip_guards = False
    guarded = _decode_logits(runner, prompts, tokens)
    assert [g.shape[0] for g in guarded] == [4, 4, 2, 2, 1, 1]
    for f, g in zip(fast, guarded, strict=True):
        np.testing.assert_array_equal(f, g)


def test_requests_on_a_long_shared_prefix_decode_eagerly_through_the_cascade(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `CASCADE_KEYS_SAVED` shared key reads a step, the eager step's cascade reads the
    shared keys once and wins: such a step does not take the batched graph."""
    m = tiny_models["llama"]
    runner = _runner(m, graph=True)
    graph = runner.decode_graph
    assert graph is not None
    batched: list[int] = []
    real = graph._replay_batch
    monkeypatch.setattr(graph, "_replay_batch", lambda batch: batched.append(batch.batch_size)
                        or real(batch))
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 250, (40,), generator=gen).tolist()  # a cascade group's minimum: 32
    prompts = [shared + torch.randint(3, 250, (5,), generator=gen).tolist() for _ in range(4)]
    tokens = [torch.randint(3, 250, (3,), generator=gen).tolist() for _ in range(4)]
    slots_first = runner.kv_pool.config.page_size + 7

    def decode() -> None:  # the four requests on one shared run of slots for the prefix
        runner.forward(StepPlan.build(0, [ScheduledRequest(
            1 + i, 0, p, list(range(slots_first, slots_first + 40))
            + list(range(slots_first + 40 + 8 * i, slots_first + 45 + 8 * i)))
            for i, p in enumerate(prompts)]))
        for step in range(3):
            runner.forward(StepPlan.build(1 + step, [ScheduledRequest(
                1 + i, 45 + step, [t[step]], [slots_first + 45 + 8 * i + step])
                for i, t in enumerate(tokens)]))

    decode()  # 3 x ~40 keys saved: under the threshold, through the graph
    assert batched == [4, 4, 4]
    batched.clear()
    monkeypatch.setattr(cpu_decode_graph, "CASCADE_KEYS_SAVED", 100)
    decode()
    assert batched == []


def test_a_thread_count_changed_after_the_warm_up_takes_the_guarded_path(
        tiny_models: dict[str, TinyModel]) -> None:
    """dynamo guards each graph on torch's thread count: a process that sets another after the
    warm-up gets new graphs compiled for it (skipping the guards there would raise), and their
    logits agree with the eager step's."""
    m = tiny_models["llama"]
    runner, eager = _runner(m, graph=True), _runner(m, graph=False)
    assert runner.decode_graph is not None and runner.decode_graph.skip_guards
    prompts = [*m.prompts, m.prompts[0][:4] + m.prompts[1]]
    gen = torch.Generator().manual_seed(7)
    tokens = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (4, 4, 2, 2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        got = _decode_logits(runner, prompts, tokens)  # a batch of 4, then 2 and 1 request
    finally:
        torch.set_num_threads(threads)
    want = _decode_logits(eager, prompts, tokens)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(w),
                                   **TOLERANCES["bfloat16"])


@pytest.mark.parametrize("num_prompts", [1, 2, 4])
def test_one_token_prompts_take_the_eager_step(tiny_models: dict[str, TinyModel],
                                               num_prompts: int) -> None:
    """A one-token prompt's step has one key per request, where the graphs were compiled for
    two or more: it runs eagerly (through the graph it would compile again, or raise once the
    guards are skipped), alone (one-request graph) or in a batch (batched graph), and its
    logits and the next steps' agree with the eager runner's."""
    m = tiny_models["llama"]
    runner, eager = _runner(m, graph=True), _runner(m, graph=False)
    assert runner.decode_graph is not None and runner.decode_graph.skip_guards
    prompts = [[11 + i] for i in range(num_prompts)]
    tokens = [[40 + i, 90 + i, 7] for i in range(num_prompts)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _decode_logits(runner, prompts, tokens)
    want = _decode_logits(eager, prompts, tokens)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(w),
                                   **TOLERANCES["bfloat16"])
