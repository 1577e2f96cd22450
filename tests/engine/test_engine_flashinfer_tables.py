"""The flashinfer backend's page tables and CUDA-graph plans under the whole engine (CPU).

flashinfer's kernels are replaced by their plain-torch reading (tests/workers/
flashinfer_reference.py) and each captured graph by an eager rerun; what runs is ours: the
engine's plans (shared prefixes, chunked prefill, the prefix cache rewriting a row's slots with
the tree's, eviction, retraction), the rank's request table and its row versions, the page
tables kept between steps, and graph decode planned once or every replay. Greedy tokens must
equal the torch backend's on the same weights, request by request. (What a row rewrite does to
a kept table is shown where it can be forced: tests/workers/test_flashinfer_tables.py.)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from tests.engine.conftest import EngineFactory, random_prompts
from tests.workers import flashinfer_reference
from tests.workers.flashinfer_reference import EagerGraphRunner, with_flashinfer


@pytest.fixture
def reference_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_reference.module())
    yield


def _tokens(engine: Engine, prompts: list[list[int]],
            max_new_tokens: int = 10) -> list[list[int]]:
    rids = [engine.add_request(p, GenerationParams(max_new_tokens=max_new_tokens,
                                                   ignore_eos=True)) for p in prompts]
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    while engine.has_work:
        for o in engine.step():
            out[o.rid] += list(o.new_token_ids)
    return [out[rid] for rid in rids]


def _on_flashinfer(engine: Engine, graph_plan: str) -> None:
    runner = engine.executor.worker.runner  # type: ignore[attr-defined]
    backend = with_flashinfer(runner, graph_plan)
    runner.graph_runner = EagerGraphRunner(runner.model, backend, 8,
                                           runner.config.max_context_len, runner.device)


CASES: dict[str, dict[str, object]] = {  # the engine's settings
    "chunked-prefix": dict(page_size=4, chunked_prefill_size=8, max_prefill_tokens=32),
    "page-1": dict(page_size=1, chunked_prefill_size=16, max_prefill_tokens=64),
    # a pool too small for every request: the prefix cache evicts, running requests retract
    "retraction": dict(page_size=4, max_total_tokens=200, init_new_token_ratio=0.0,
                       min_new_token_ratio=0.0),
}


@pytest.mark.parametrize("graph_plan", ["once", "every_step"])
@pytest.mark.parametrize("case", list(CASES))
def test_engine_on_kept_page_tables_gives_the_torch_backends_tokens(
        make_engine: EngineFactory, reference_flashinfer: None, case: str,
        graph_plan: str) -> None:
    settings = CASES[case]
    if case == "retraction":
        prompts = random_prompts(seed=2, groups=2, per_group=8, prefix_len=24,
                                 question_len=(8, 16))
        new_tokens = 24
    else:
        prompts = random_prompts(seed=11, groups=3, per_group=4, prefix_len=24,
                                 question_len=(2, 9))
        new_tokens = 10
    want = _tokens(make_engine(**settings), prompts, new_tokens)
    engine = make_engine(**settings)
    _on_flashinfer(engine, graph_plan)
    assert _tokens(engine, prompts, new_tokens) == want
    if case == "retraction":
        assert engine.metrics().num_retractions > 0
