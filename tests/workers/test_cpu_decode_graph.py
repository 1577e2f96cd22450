"""The CPU decode graph (workers/cpu_decode_graph.py): a lone decode token runs one compiled
graph; its greedy tokens equal transformers' and its logits the eager forward's; the weights stay
one copy (plain, but the LM head's, packed); models and settings it does not cover run eagerly,
saying why."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from raydix.workers import cpu_decode_graph, graph_head
from raydix.workers.config import WorkerConfig
from raydix.workers.layers.packed import packing_supported
from raydix.workers.runner import ModelRunner
from raydix.workers.step import ScheduledRequest, StepPlan

from .conftest import TINY, TinyModel
from .reference import HFReference, assert_greedy_equal

MAX_NEW_TOKENS = 12


def _runner(m: TinyModel, graph: bool) -> ModelRunner:
    return ModelRunner(WorkerConfig(str(m.folder), dtype="float32", max_running_requests=4,
                                    max_context_len=64, max_total_tokens=256,
                                    cpu_decode_graph=graph))


def _generate(runner: ModelRunner, prompt: list[int],
              new_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens of one request alone (so every decode step has one token), and the
    logits of each decode step."""
    first = runner.kv_pool.config.page_size + 7  # any free slots past the padding page
    slots = list(range(first, first + len(prompt) + new_tokens))
    logits = runner.forward(StepPlan.build(0, [ScheduledRequest(1, 0, prompt,
                                                                slots[:len(prompt)])]))
    tokens = [int(logits.argmax())]
    steps = []
    for i in range(new_tokens - 1):
        pos = len(prompt) + i
        logits = runner.forward(StepPlan.build(1 + i, [ScheduledRequest(
            1, pos, [tokens[-1]], [slots[pos]])]))
        steps.append(logits[0].float().numpy())
        tokens.append(int(logits.argmax()))
    return tokens, steps


@pytest.fixture(scope="module")
def llama_runners(tiny_models: dict[str, TinyModel]) -> tuple[ModelRunner, ModelRunner]:
    m = tiny_models["llama"]
    return _runner(m, graph=True), _runner(m, graph=False)


def test_decode_graph_matches_transformers_and_the_eager_forward(
        tiny_models: dict[str, TinyModel], llama_runners: tuple[ModelRunner, ModelRunner],
        monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_models["llama"]
    graph_runner, eager = llama_runners
    assert graph_runner.decode_graph is not None and eager.decode_graph is None
    replays = []
    real = graph_runner.decode_graph.replay
    monkeypatch.setattr(graph_runner.decode_graph, "replay",
                        lambda batch: replays.append(1) or real(batch))
    _decode_alone_and_compare(m, graph_runner, eager, "llama decode graph")
    assert len(replays) == len(m.prompts) * (MAX_NEW_TOKENS - 1)  # every decode step


def _decode_alone_and_compare(m: TinyModel, runner: ModelRunner, eager: ModelRunner,
                              label: str) -> list[list[np.ndarray]]:
    """Each prompt decoded alone through `runner`'s graph with recompiles forbidden; its greedy
    tokens must equal transformers' and its decode logits the eager runner's (within 1e-4).
    Returns each prompt's decode logits."""
    ref = m.hf.greedy(m.prompts, MAX_NEW_TOKENS)
    # the warm-up compiled every graph the steps need: a step that compiles again would stall
    # a request for seconds (it did, when the warm-up made its tensors outside inference mode)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, got_logits = zip(*(_generate(runner, p, MAX_NEW_TOKENS) for p in m.prompts),
                              strict=True)
    assert_greedy_equal(list(got), ref, m.prompts, m.hf,
                        lambda seqs: [runner.forward(_probe(runner, s))[0].numpy()
                                      for s in seqs], label)
    for p, logits in zip(m.prompts, got_logits, strict=True):
        _, eager_logits = _generate(eager, p, MAX_NEW_TOKENS)
        np.testing.assert_allclose(np.stack(logits), np.stack(eager_logits), atol=1e-4, rtol=0)
    return list(got_logits)


def _generate_together(runner: ModelRunner, prompts: list[list[int]],
                       new_tokens: int) -> list[list[int]]:
    """Greedy tokens of requests that prefill in one step and then decode side by side (every
    decode step has one token of each)."""
    first = runner.kv_pool.config.page_size + 7
    slots = []
    for p in prompts:
        slots.append(list(range(first, first + len(p) + new_tokens)))
        first += len(p) + new_tokens
    logits = runner.forward(StepPlan.build(0, [
        ScheduledRequest(1 + i, 0, p, s[:len(p)]) for i, (p, s) in enumerate(
            zip(prompts, slots, strict=True))]))
    tokens = [[int(t)] for t in logits.argmax(-1)]
    for step in range(new_tokens - 1):
        logits = runner.forward(StepPlan.build(1 + step, [
            ScheduledRequest(1 + i, len(p) + step, [t[-1]], [s[len(p) + step]])
            for i, (p, s, t) in enumerate(zip(prompts, slots, tokens, strict=True))]))
        for t, token in zip(tokens, logits.argmax(-1), strict=True):
            t.append(int(token))
    return tokens


def test_two_requests_decode_through_the_batched_graph(
        tiny_models: dict[str, TinyModel], llama_runners: tuple[ModelRunner, ModelRunner],
        monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_models["llama"]
    graph_runner, _ = llama_runners
    assert graph_runner.decode_graph is not None
    runs: list[int] = []  # the one-request graphs
    real_run = graph_runner.decode_graph._run
    monkeypatch.setattr(graph_runner.decode_graph, "_run",
                        lambda *args: runs.append(1) or real_run(*args))
    batches: list[int] = []
    real_batch = graph_runner.decode_graph._replay_batch
    monkeypatch.setattr(graph_runner.decode_graph, "_replay_batch",
                        lambda batch: batches.append(batch.batch_size) or real_batch(batch))
    eager_steps: list[int] = []
    real_forward = graph_runner.model.forward
    monkeypatch.setattr(graph_runner.model, "forward",
                        lambda *args: eager_steps.append(1) or real_forward(*args))
    prompts = m.prompts[:2]
    ref = m.hf.greedy(prompts, MAX_NEW_TOKENS)
    # the warm-up's batch of three compiled the graph a batch of two runs: no compile here
    with torch._dynamo.config.patch(error_on_recompile=True), profile(
            activities=[ProfilerActivity.CPU]) as prof:
        got = _generate_together(graph_runner, prompts, MAX_NEW_TOKENS)
    assert batches == [2] * (MAX_NEW_TOKENS - 1) and not runs  # one batched pass a step
    # attention through the paged kernel, once a layer a step, not the traced plain ops
    kernel_calls = [e for e in prof.events() if e.name == "raydix::paged_decode"]
    num_layers = graph_runner.kv_pool.config.num_layers
    assert len(kernel_calls) == (MAX_NEW_TOKENS - 1) * num_layers, len(kernel_calls)
    assert len(eager_steps) == 1  # the prefill only
    assert_greedy_equal(got, ref, prompts, m.hf,
                        lambda seqs: [graph_runner.forward(_probe(graph_runner, s))[0].numpy()
                                      for s in seqs], "llama decode graph, two requests")


def test_a_lone_decode_after_a_paged_batch_does_not_compile_again(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with four long decodes that runs eagerly (a mixed step; here the batched graph is
    held back) runs the compiled paged kernel, which marks the pool's buffers dynamic; the next
    lone decode must still find its graph (it compiled both layer graphs again, seconds on a
    server's first requests, before the graph marked them), and so must the next batch."""
    m = tiny_models["llama"]
    runner = ModelRunner(WorkerConfig(str(m.folder), dtype="float32", max_running_requests=5,
                                      max_context_len=128, max_total_tokens=1024,
                                      cpu_decode_graph=True, cpu_compiled_attention=True))
    backend = runner.backend
    if runner.decode_graph is None or backend.paged_kernel is None:
        pytest.skip("no C++ compiler: nothing is compiled")
    paged_calls: list[int] = []
    real_kernel = backend.paged_kernel
    monkeypatch.setattr(backend, "paged_kernel",
                        lambda *args: paged_calls.append(1) or real_kernel(*args))
    prompts = [(p * 40)[:70 + i] for i, p in enumerate(m.prompts[:2] * 2)]  # >= 64 keys each
    graph = runner.decode_graph
    batch_layers = graph._batch_layers
    monkeypatch.setattr(graph, "_batch_layers", None)  # decode steps of 3+ requests run eagerly
    _generate_together(runner, prompts, 3)
    assert paged_calls  # the batched decode steps ran the paged kernel
    monkeypatch.setattr(graph, "_batch_layers", batch_layers)
    paged_calls.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        _generate(runner, m.prompts[0], 4)
        _generate_together(runner, prompts, 3)
    assert not paged_calls  # the batch went through the batched graph


def _probe(runner: ModelRunner, seq: list[int]) -> StepPlan:
    first = runner.kv_pool.config.page_size
    return StepPlan.build(99, [ScheduledRequest(2, 0, seq, list(range(first, first + len(seq))))])


def _plain_layers_packed_head(runner: ModelRunner, head_packed: bool) -> None:
    head = runner.model.lm_head
    linears = [mod for mod in runner.model.modules()
               if hasattr(mod, "packed_weight") and mod is not head]
    assert linears and all(mod.packed_weight is None and mod.weight is not None
                           for mod in linears)
    if head_packed:  # the packed weight is the head's only copy
        assert head.weight is None and head.packed_weight is not None
    else:
        assert head.packed_weight is None and head.weight is not None


def test_decode_graph_keeps_one_weight_per_linear_layer(
        tiny_models: dict[str, TinyModel], llama_runners: tuple[ModelRunner, ModelRunner],
        monkeypatch: pytest.MonkeyPatch) -> None:
    graph_runner, eager = llama_runners
    if graph_head.layers_packed(torch.float32):  # AVX-512: every fp32 weight packed, only copy
        linears = [mod for mod in graph_runner.model.modules() if hasattr(mod, "packed_weight")]
        assert linears and all(mod.weight is None and mod.packed_weight is not None
                               for mod in linears)
    else:
        _plain_layers_packed_head(graph_runner, head_packed=False)  # fp32: every weight plain
    assert graph_runner.weight_bytes == eager.weight_bytes  # eager: packed, the same bytes
    if not packing_supported(torch.device("cpu"), torch.bfloat16):
        return  # no native bf16 here: bf16 stays plain everywhere
    monkeypatch.setattr(graph_head, "native_bf16", lambda: False)  # the layers plain
    m = tiny_models["llama"]
    config = WorkerConfig(str(m.folder), dtype="bfloat16", max_running_requests=4,
                          max_context_len=64, max_total_tokens=256)
    graph = {"cpu_decode_graph": True}
    bf16_graph = ModelRunner(WorkerConfig(**{**config.__dict__, **graph}))
    all_plain = ModelRunner(WorkerConfig(**{**config.__dict__, **graph,
                                            "cpu_packed_linear": False}))
    _plain_layers_packed_head(bf16_graph, head_packed=True)
    _plain_layers_packed_head(all_plain, head_packed=False)
    assert torch.equal(bf16_graph.model.lm_head.packed_weight.to_dense(),
                       all_plain.model.lm_head.weight)
    assert bf16_graph.weight_bytes == all_plain.weight_bytes
    # the graph's head through `raydix::onednn_linear` gives the multiply-and-sum's logits, to
    # bf16's rounding of them (about 2: steps of 1/64)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, graph_logits = _generate(bf16_graph, m.prompts[0], 6)
        want, plain_logits = _generate(all_plain, m.prompts[0], 6)
    assert got == want
    np.testing.assert_allclose(np.stack(graph_logits), np.stack(plain_logits), atol=0.04, rtol=0)


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                    reason="no native bf16 on this CPU (avx512_bf16 or amx): bf16 stays plain")
def test_bf16_layers_packed_decode_and_prefill_as_plain_ones(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on a CPU with native bf16 (`graph_head.layers_packed`): every linear layer packed,
    its only copy, and all three graphs (one request, a batch, a prompt step) call oneDNN on them; the
    tokens and logits are the all-plain graphs' to bf16's rounding."""
    m = tiny_models["llama"]
    monkeypatch.setattr(graph_head, "native_bf16", lambda: True)
    config = WorkerConfig(str(m.folder), dtype="bfloat16", max_running_requests=4,
                          max_context_len=64, max_total_tokens=256, cpu_decode_graph=True,
                          cpu_step_graph=True)
    packed = ModelRunner(config)
    plain = ModelRunner(WorkerConfig(**{**config.__dict__, "cpu_packed_linear": False}))
    linears = [mod for mod in packed.model.modules() if hasattr(mod, "packed_weight")]
    assert linears and all(mod.weight is None and mod.packed_weight is not None
                           for mod in linears)
    assert packed.weight_bytes == plain.weight_bytes
    with torch._dynamo.config.patch(error_on_recompile=True), profile(
            activities=[ProfilerActivity.CPU]) as prof:
        got, got_logits = _generate(packed, m.prompts[0], 6)
        together = _generate_together(packed, m.prompts, 4)
    want, want_logits = _generate(plain, m.prompts[0], 6)
    assert got == want and together == _generate_together(plain, m.prompts, 4)
    np.testing.assert_allclose(np.stack(got_logits), np.stack(want_logits), atol=0.1, rtol=0)
    calls = sum(e.name == "raydix::onednn_linear" for e in prof.events())
    assert calls > 0 and not any(e.name == "raydix::small_gemm" for e in prof.events())


def test_layer_groups_split_evenly_in_order() -> None:
    groups = cpu_decode_graph.layer_groups
    assert groups(30, 10) == [range(0, 10), range(10, 20), range(20, 30)]
    assert [len(g) for g in groups(29, 10)] == [10, 10, 9]
    assert [len(g) for g in groups(22, 10)] == [8, 7, 7]
    assert groups(2, 10) == [range(0, 2)] and groups(3, 2) == [range(0, 2), range(2, 3)]
    for n in range(1, 70):
        for per in (1, 4, 10):
            runs = groups(n, per)
            assert [i for g in runs for i in g] == list(range(n))
            assert max(map(len, runs)) <= per and len({len(g) for g in runs}) <= 2


def test_runs_of_two_sizes_decode_as_transformers_does(
        tiny_models: dict[str, TinyModel], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three layers two to a call: a run of two, then one, each its own graph, the first with
    a zero residual; greedy tokens equal transformers' (one request and a batch of three),
    logits the eager forward's, no compile after the warm-up, and the steps that skip the
    guards run the graphs the guards pick."""
    torch.manual_seed(99)
    LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 3}, num_key_value_heads=2,
                                 tie_word_embeddings=True)).save_pretrained(tmp_path)
    m = TinyModel("llama3", tmp_path, HFReference(tmp_path), tiny_models["llama"].prompts)
    monkeypatch.setattr(cpu_decode_graph, "LAYERS_PER_GRAPH", 2)
    runner, eager = _runner(m, graph=True), _runner(m, graph=False)
    graph = runner.decode_graph
    assert graph is not None and graph.skip_guards
    assert [len(layers) for layers, *_ in graph._groups] == [2, 1]
    calls: list[int] = []
    real = graph._layers
    monkeypatch.setattr(graph, "_layers", lambda layers, *args: calls.append(len(layers))
                        or real(layers, *args))
    got_logits = _decode_alone_and_compare(m, runner, eager, "llama graph, runs of 2 and 1")
    assert calls == [2, 1] * len(m.prompts) * (MAX_NEW_TOKENS - 1)
    ref = m.hf.greedy(m.prompts, MAX_NEW_TOKENS)
    # a batch runs the batched graphs over the same runs
    batch_calls: list[int] = []
    real_batch = graph._batch_layers
    monkeypatch.setattr(graph, "_batch_layers", lambda layers, *args: batch_calls.append(
        len(layers)) or real_batch(layers, *args))
    with torch._dynamo.config.patch(error_on_recompile=True):
        together = _generate_together(runner, m.prompts, MAX_NEW_TOKENS)
    assert batch_calls == [2, 1] * (MAX_NEW_TOKENS - 1)
    assert_greedy_equal(together, ref, m.prompts, m.hf,
                        lambda seqs: [runner.forward(_probe(runner, s))[0].numpy()
                                      for s in seqs], "llama batched graph, runs of 2 and 1")
    graph.skip_guards = False
    _, guarded = _generate(runner, m.prompts[0], MAX_NEW_TOKENS)
    np.testing.assert_array_equal(np.stack(got_logits[0]), np.stack(guarded))


def test_qk_norm_and_bias_models_match_too(tiny_models: dict[str, TinyModel]) -> None:
    for name in ("qwen2", "qwen3"):  # q/k/v bias; q/k norms and a head_dim of its own
        m = tiny_models[name]
        runner = _runner(m, graph=True)
        assert runner.decode_graph is not None
        ref = m.hf.greedy(m.prompts[:1], MAX_NEW_TOKENS)
        tokens, _ = _generate(runner, m.prompts[0], MAX_NEW_TOKENS)
        assert_greedy_equal([tokens], ref, m.prompts[:1], m.hf,
                            lambda seqs, r=runner: [r.forward(_probe(r, s))[0].numpy()
                                                    for s in seqs], f"{name} decode graph")


def test_models_the_graph_does_not_cover_run_eagerly_and_say_why(
        feature_models, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="raydix.workers.cpu_decode_graph")
    m = feature_models("mistral")  # a sliding window
    runner = _runner(m, graph=True)
    assert runner.decode_graph is None
    assert "sliding window" in caplog.text
    assert any(mod.packed_weight is not None for mod in runner.model.modules()
               if hasattr(mod, "packed_weight")) or not torch.backends.mkldnn.is_available()
    assert cpu_decode_graph.eligible(runner.model, "auto", 2).startswith("tp 2")
    assert "double-sparse" in cpu_decode_graph.eligible(runner.model, "double-sparse", 1)
