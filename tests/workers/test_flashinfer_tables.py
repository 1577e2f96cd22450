"""The flashinfer backend's own half on CPU: page tables, plans and padded CUDA-graph plans.

flashinfer's kernels need a GPU, so here its two wrappers are the plain-torch reading of its
documented paged-KV format (flashinfer_reference.py). What is checked is our code: the page
tables built from the request->token table, the choice of wrapper per step, the padded plan each
CUDA-graph replay makes and the static buffers it fills. Greedy output must equal the torch
backend's on the same weights, whole prompts, chunked prompts and reused prefixes alike.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from raydix.workers.attention import flashinfer_backend
from raydix.workers.attention.flashinfer_backend import FlashInferAttentionBackend
from raydix.workers.attention.page_table import PageTable, PageTableView
from raydix.workers.config import WorkerConfig
from raydix.workers.runner import ModelRunner
from raydix.workers.step import GREEDY, ScheduledRequest, StepPlan, TableWrite

from . import flashinfer_reference
from .conftest import TinyModel
from .driver import run_greedy, scenario
from .flashinfer_reference import EagerGraphRunner, EagerReplay, with_flashinfer

MAX_CONTEXT = 64


@pytest.fixture
def reference_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_reference.module())
    yield


def _runner(model: TinyModel, page_size: int) -> ModelRunner:
    return ModelRunner(WorkerConfig(str(model.folder), page_size=page_size,
                                    max_running_requests=8, max_context_len=MAX_CONTEXT,
                                    max_total_tokens=2048))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mode", ["whole", "chunked", "prefix"])
def test_page_tables_give_the_torch_backends_tokens(
        tiny_models: dict[str, TinyModel], reference_flashinfer: None, page_size: int,
        mode: str) -> None:
    model = tiny_models["llama"]  # GQA 4:2
    expected = run_greedy(_runner(model, page_size).step,
                          scenario(mode, model.prompts, 8, page_size), page_size)
    runner = _runner(model, page_size)
    backend = with_flashinfer(runner)
    got = run_greedy(runner.step, scenario(mode, model.prompts, 8, page_size), page_size)
    assert got == expected
    assert backend.decode_wrapper.plans > 0  # type: ignore[attr-defined]
    assert backend.prefill_wrapper.plans > 0  # type: ignore[attr-defined]


def test_logits_of_extend_and_decode_match_the_torch_backend(
        tiny_models: dict[str, TinyModel], reference_flashinfer: None) -> None:
    model, page_size = tiny_models["qwen2"], 4  # one KV head: every query head reads it
    ref, runner = _runner(model, page_size), _runner(model, page_size)
    with_flashinfer(runner)
    seqs = [p + [7, 8] for p in model.prompts]
    firsts = [page_size * (1 + i * (MAX_CONTEXT // page_size)) for i in range(len(seqs))]
    extend = StepPlan.build(0, [ScheduledRequest(i, 0, s, list(range(f, f + len(s))), GREEDY)
                                for i, (s, f) in enumerate(zip(seqs, firsts, strict=True))])
    decode = StepPlan.build(1, [ScheduledRequest(i, len(s), [5], [f + len(s)], GREEDY)
                                for i, (s, f) in enumerate(zip(seqs, firsts, strict=True))])
    for plan in (extend, decode):
        torch.testing.assert_close(runner.forward(plan), ref.forward(plan), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("graph_plan", ["once", "every_step"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_graph_replay_pads_plans_and_matches_the_torch_backend(
        tiny_models: dict[str, TinyModel], reference_flashinfer: None, page_size: int,
        graph_plan: str) -> None:
    model = tiny_models["llama"]  # GQA 4:2: the CUDA-core kernel, unless the plan is pinned
    prompts = model.prompts  # three requests: decode replays the graph of batch 4, padded
    expected = {m: run_greedy(_runner(model, page_size).step, scenario(m, prompts, 10, page_size),
                              page_size) for m in ("whole", "chunked", "prefix")}
    for mode, tokens in expected.items():
        runner = _runner(model, page_size)
        backend = with_flashinfer(runner, graph_plan)
        graphs = EagerGraphRunner(runner.model, backend, 8, MAX_CONTEXT, runner.device)
        runner.graph_runner = graphs
        assert graphs.batch_sizes == [1, 2, 4, 8]
        replays = EagerReplay.replays
        assert backend.graph_table is not None
        rebuilds = backend.graph_table.num_rebuilds
        got = run_greedy(runner.step, scenario(mode, prompts, 10, page_size), page_size)
        assert got == tokens, mode
        replays = EagerReplay.replays - replays
        assert replays > 0
        # decodes went through the graph wrappers, never the eager decode wrapper
        assert backend.decode_wrapper.plans == 0  # type: ignore[attr-defined]
        wrappers = list(backend._graph_wrappers.values())
        if graph_plan == "once":  # planned at start, split off, on the tensor-core kernel
            assert all(w.plans == 1 and w.partition is None  # type: ignore[attr-defined]
                       and w.use_tensor_cores for w in wrappers)  # type: ignore[attr-defined]
        else:  # split on (the CUDA-core kernel for this group), planned before every replay
            assert sum(w.plans - 1 for w in wrappers) == replays  # type: ignore[attr-defined]
            assert not any(w.use_tensor_cores for w in wrappers)  # type: ignore[attr-defined]
        # the graph page table was updated in place between most replays, not rebuilt
        rebuilds = backend.graph_table.num_rebuilds - rebuilds
        assert rebuilds < replays / 2


class _SplitNotPinned(FlashInferAttentionBackend):
    """Plans each graph once but leaves flashinfer's KV split on."""

    def _plan_graph_wrapper(self, bs: int, kind: int, view: PageTableView) -> None:
        self.graph_plan = "every_step"  # plan without disable_split_kv
        super()._plan_graph_wrapper(bs, kind, view)
        self.graph_plan = "once"


def test_a_graph_planned_once_with_the_split_on_is_caught(
        tiny_models: dict[str, TinyModel], reference_flashinfer: None) -> None:
    """The stand-in flashinfer refuses a replay over page counts its plan's split-KV partition
    was not made for, so planning once is only right with the split off."""
    model, page_size = tiny_models["llama"], 4
    runner = _runner(model, page_size)
    backend = with_flashinfer(runner, "once", _SplitNotPinned)
    runner.graph_runner = EagerGraphRunner(runner.model, backend, 8, MAX_CONTEXT, runner.device)
    with pytest.raises(RuntimeError, match="split-KV partition"):
        run_greedy(runner.step, scenario("whole", model.prompts, 10, page_size), page_size)


class _IgnoresRowVersions(PageTable):
    def _can_update(self, row_idx: np.ndarray, versions: np.ndarray | None,
                    num_pages: np.ndarray, num_padding: int) -> bool:
        return super()._can_update(row_idx, self._versions if versions is not None else None,
                                   num_pages, num_padding)


def _rewrite_plans() -> list[StepPlan]:
    """Row 0 decodes twice after its prompt; before its second decode a table write points its
    prompt at row 1's (freed) slots, which hold other K/V (as when the prefix cache swaps a row's
    slots for the tree's and its own are reused)."""
    return [StepPlan.build(0, [ScheduledRequest(0, 0, [3, 4, 5, 6, 7, 8, 9, 10],
                                                list(range(4, 12)), GREEDY),
                               ScheduledRequest(1, 0, [20, 21, 22, 23, 24, 25, 26, 27],
                                                list(range(16, 24)), GREEDY)]),
            StepPlan.build(1, [ScheduledRequest(0, 8, [11], [12], GREEDY)], freed_rows=[1]),
            StepPlan.build(2, [ScheduledRequest(0, 9, [12], [13], GREEDY)]),
            StepPlan.build(3, [ScheduledRequest(0, 10, [13], [14], GREEDY)],
                           [TableWrite(0, 0, np.arange(16, 24, dtype=np.int32))])]


@pytest.mark.parametrize("graphs", [False, True])
def test_a_rewritten_row_is_read_anew(tiny_models: dict[str, TinyModel],
                                      reference_flashinfer: None, graphs: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept page tables follow a table write to a running row (its version changes);
    one that ignores the versions reads the row's old pages and gives other logits."""
    model, page_size = tiny_models["llama"], 4
    ref = _runner(model, page_size)
    want = [ref.forward(p) for p in _rewrite_plans()]

    def logits() -> list[torch.Tensor]:
        runner = _runner(model, page_size)
        backend = with_flashinfer(runner)
        if graphs:
            runner.graph_runner = EagerGraphRunner(runner.model, backend, 8, MAX_CONTEXT,
                                                   runner.device)
        return [runner.forward(p).clone() for p in _rewrite_plans()]  # a graph's is static

    for got, expected in zip(logits(), want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(flashinfer_backend, "PageTable", _IgnoresRowVersions)
    stale = logits()
    torch.testing.assert_close(stale[2], want[2], atol=1e-4, rtol=1e-4)  # before the write
    assert not torch.allclose(stale[3], want[3], atol=1e-2)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3"])
def test_windows_and_soft_caps_give_the_torch_backends_tokens(
        feature_models: Callable[[str], TinyModel], reference_flashinfer: None, name: str,
        page_size: int) -> None:
    """Windowed, soft-capped and rescaled layers get wrappers of their own kind, planned
    with `window_left`, `logits_soft_cap` and `sm_scale`; eager and graph decode alike."""
    model = feature_models(name)
    for mode in ("whole", "chunked", "prefix"):
        expected = run_greedy(_runner(model, page_size).step,
                              scenario(mode, model.prompts, 8, page_size), page_size)
        runner = _runner(model, page_size)
        backend = with_flashinfer(runner)
        assert len(backend.kinds) == (1 if name == "mistral" else 2)
        assert {a.window for a in backend.kinds} == {5} | ({0} if name != "mistral" else set())
        if mode == "prefix":  # decode through the graph wrappers of each kind
            runner.graph_runner = EagerGraphRunner(runner.model, backend, 8, MAX_CONTEXT,
                                                    runner.device)
        got = run_greedy(runner.step, scenario(mode, model.prompts, 8, page_size), page_size)
        assert got == expected, (name, mode)
