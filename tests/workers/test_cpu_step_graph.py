"""The CPU step graph (workers/cpu_step_graph.py): steps the decode graphs do not take (prompts,
chunks after a cached prefix, prompts beside decode tokens) run their layers compiled, one
compile for every token count; their logits equal transformers' and the eager step's (within
1e-4 in fp32, within bf16's rounding in bf16), the fused steps leave no eager operator behind,
and one-token steps run eagerly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydix.workers import cpu_step_graph
from raydix.workers.attention import torch_backend
from raydix.workers.config import WorkerConfig
from raydix.workers.runner import ModelRunner
from raydix.workers.step import ScheduledRequest, StepPlan

from .conftest import TinyModel

TOLERANCES = {"bfloat16": dict(atol=0.1, rtol=0.05),  # two bf16 paths rounding differently
              "float32": dict(atol=1e-4, rtol=0.0)}
LONG = 150  # a prompt this long takes the bf16 row-block attention (block_causal.MIN_KEYS)
# where the CPU has no AMX tiles (patched so below: with them, the flash kernel, as float32's)


def _runner(m: TinyModel, graphs: bool, dtype: str) -> ModelRunner:
    return ModelRunner(WorkerConfig(str(m.folder), dtype=dtype, max_running_requests=6,
                                    max_context_len=256, max_total_tokens=1024,
                                    cpu_decode_graph=graphs, cpu_step_graph=graphs))


def _steps(prompts: list[list[int]], long: list[int], decode: list[int]) -> list[StepPlan]:
    """Every kind of step the step graph takes: the prompts in one step; a long prompt's two
    chunks (the second after its first as a prefix) beside a decode token of each prompt; one
    more decode step of all (the decode graph's)."""
    page = 8
    first = 2 * page
    slots = []
    for p in [*prompts, long]:
        slots.append(list(range(first, first + len(p) + len(decode))))
        first += len(p) + len(decode) + page
    half = len(long) // 2
    n = len(prompts)
    plans = [StepPlan.build(0, [ScheduledRequest(1 + i, 0, p, slots[i][:len(p)])
                                for i, p in enumerate(prompts)])]
    plans.append(StepPlan.build(1, [ScheduledRequest(1 + n, 0, long[:half], slots[n][:half])]))
    plans.append(StepPlan.build(2, [
        *(ScheduledRequest(1 + i, len(p), [decode[0]], [slots[i][len(p)]])
          for i, p in enumerate(prompts)),
        ScheduledRequest(1 + n, half, long[half:], slots[n][half:len(long)])]))
    plans.append(StepPlan.build(3, [
        *(ScheduledRequest(1 + i, len(p) + 1, [decode[1]], [slots[i][len(p) + 1]])
          for i, p in enumerate(prompts)),
        ScheduledRequest(1 + n, len(long), [decode[1]], [slots[n][len(long)]])]))
    return plans


@pytest.mark.parametrize(("kind", "dtype"), [("llama", "float32"), ("qwen3", "float32"),
                                             ("llama", "bfloat16")])
def test_prompt_steps_run_the_step_graph_and_agree_with_the_eager_step(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch, kind: str,
        dtype: str) -> None:
    m = tiny_models[kind]
    monkeypatch.setattr(torch_backend, "amx_tiles", lambda: False)
    runner, eager = _runner(m, True, dtype), _runner(m, False, dtype)
    graph = runner.step_graph
    assert graph is not None and eager.step_graph is None
    ran: list[int] = []
    real = graph.forward
    monkeypatch.setattr(graph, "forward", lambda batch, rows: ran.append(batch.num_tokens)
                        or real(batch, rows))
    long = torch.randint(3, 250, (LONG,), generator=torch.Generator().manual_seed(5)).tolist()
    plans = _steps(m.prompts, long, [17, 23])
    with torch._dynamo.config.patch(error_on_recompile=True):  # the warm-up compiled it
        got = [runner.forward(p).float().numpy() for p in plans]
    want = [eager.forward(p).float().numpy() for p in plans]
    num_prompt_tokens = sum(map(len, m.prompts))
    assert ran == [num_prompt_tokens, LONG // 2, len(m.prompts) + LONG - LONG // 2]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOLERANCES[dtype])
    if dtype == "float32":  # and transformers' own logits of each sequence's last token
        ref = m.hf.last_logits([*m.prompts, long[:LONG // 2]])
        np.testing.assert_allclose(np.concatenate(got[:2]), np.stack(ref), atol=1e-4, rtol=0)


def test_fused_steps_leave_no_eager_operator(tiny_models: dict[str, TinyModel]) -> None:
    """The norms, rotary embedding, activation and K/V write compile into the graph's
    loops: a prompt step calls none of their torch operators but the final norm's (eager, on
    the sampled row), and the backend's attention once a layer."""
    m = tiny_models["llama"]
    runner = _runner(m, True, "float32")
    prompt = m.prompts[1]
    plan = StepPlan.build(0, [ScheduledRequest(1, 0, prompt, list(range(16, 16 + len(prompt))))])
    with torch.profiler.profile() as prof:
        runner.forward(plan)
    names = [e.name for e in prof.events()]
    assert names.count("raydix::step_attention") == runner.model_config.num_layers
    eager_ops = {"aten::silu", "aten::cat", "aten::index_copy_"}
    assert not eager_ops & set(names), sorted(eager_ops & set(names))
    assert names.count("aten::rsqrt") == names.count("aten::pow") == 1  # the final norm


def test_one_token_steps_run_eagerly(tiny_models: dict[str, TinyModel],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_models["llama"]
    runner = _runner(m, True, "float32")
    graph = runner.step_graph
    assert graph is not None
    monkeypatch.setattr(graph, "forward", lambda batch, rows: pytest.fail(
        "a one-token step ran the step graph"))
    eager = _runner(m, False, "float32")
    plan = StepPlan.build(0, [ScheduledRequest(1, 0, [42], [16])])
    np.testing.assert_allclose(runner.forward(plan).numpy(), eager.forward(plan).numpy(),
                               atol=1e-4, rtol=0)


def test_both_dtypes_are_served_with_the_step_graph(tiny_models: dict[str, TinyModel]) -> None:
    m = tiny_models["llama"]
    assert cpu_step_graph.serves(torch.float32) and cpu_step_graph.serves(torch.bfloat16)
    assert _runner(m, True, "float32").step_graph is not None
    assert _runner(m, True, "bfloat16").step_graph is not None
    assert _runner(m, False, "float32").step_graph is None  # without the graphs, eager
