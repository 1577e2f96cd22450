"""Whether the CPU decode graph's float32 LM head is packed (workers/graph_head.py): timed on the
model's head, packed only where oneDNN's one-row product is clearly faster than the graph's
multiply-and-sum; a graph with the head packed still decodes as transformers does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydix.workers import graph_head
from raydix.workers.config import WorkerConfig
from raydix.workers.layers import packed_gemv
from raydix.workers.layers.packed import MIN_MEASURED_WEIGHTS, packing_supported
from raydix.workers.runner import ModelRunner

from .conftest import TinyModel
from .reference import assert_greedy_equal
from .test_cpu_decode_graph import _generate, _plain_layers_packed_head, _probe

pytestmark = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN linear ops")


def _no_timing(*args: object) -> dict[str, float]:
    raise AssertionError("timed the head")


@pytest.mark.parametrize(("packed_ms", "plain_ms", "expected"),
                         [(8.0, 10.0, True), (9.5, 10.0, False), (12.0, 10.0, False)])
def test_the_head_is_packed_only_where_onednn_is_clearly_faster(
        monkeypatch: pytest.MonkeyPatch, packed_ms: float, plain_ms: float,
        expected: bool) -> None:
    monkeypatch.setattr(graph_head, "_time_both", lambda weight, rounds, calls: {
        "packed": packed_ms / 1e3, "plain": plain_ms / 1e3})
    assert graph_head.packed_head_pays(torch.zeros(1024, 576)) is expected


def test_small_heads_and_other_dtypes_are_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph_head, "_time_both", _no_timing)
    assert MIN_MEASURED_WEIGHTS > 64 * 64
    assert not graph_head.packed_head_pays(torch.zeros(64, 64))  # too small to tell
    assert not graph_head.packed_head_pays(torch.zeros(1024, 576, dtype=torch.bfloat16))
    assert graph_head.head_packed(torch.nn.Module(), torch.bfloat16)  # bf16: packed always


def test_the_timing_runs_both_products(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger=graph_head.__name__)
    weight = torch.randn(MIN_MEASURED_WEIGHTS // 512 + 1, 512)
    best = graph_head._time_both(weight, rounds=2, calls=1)
    assert set(best) == {"packed", "plain"} and all(0 < s < 1 for s in best.values())
    assert isinstance(graph_head.packed_head_pays(weight, rounds=2, calls=1), bool)
    assert "multiply-and-sum" in caplog.text and "oneDNN packed" in caplog.text


def test_a_graph_with_the_float32_head_packed_decodes_as_transformers_does(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_models["llama"]
    monkeypatch.setattr(graph_head, "packed_head_pays", lambda weight: True)
    # the decoder layers plain, as where the float32 packed-weight kernel does not run (no
    # AVX-512): only the head is packed
    monkeypatch.setattr(packed_gemv, "warm_up", lambda: False)
    config = WorkerConfig(str(m.folder), dtype="float32", max_running_requests=4,
                          max_context_len=64, max_total_tokens=256, cpu_decode_graph=True)
    runner = ModelRunner(config)
    eager = ModelRunner(WorkerConfig(**{**config.__dict__, "cpu_decode_graph": False}))
    assert runner.decode_graph is not None
    _plain_layers_packed_head(runner, head_packed=True)  # the packed head is its only copy
    ref = m.hf.greedy(m.prompts, 8)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, got_logits = zip(*(_generate(runner, p, 8) for p in m.prompts), strict=True)
    assert_greedy_equal(list(got), ref, m.prompts, m.hf,
                        lambda seqs: [runner.forward(_probe(runner, s))[0].numpy()
                                      for s in seqs], "llama decode graph, packed fp32 head")
    for p, logits in zip(m.prompts, got_logits, strict=True):
        _, eager_logits = _generate(eager, p, 8)
        np.testing.assert_allclose(np.stack(logits), np.stack(eager_logits), atol=1e-4, rtol=0)
