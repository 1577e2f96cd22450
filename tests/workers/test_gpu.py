"""CUDA only: the flashinfer backend and CUDA-graph decode agree with the torch backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raydix.workers.config import WorkerConfig
from raydix.workers.worker import TPWorker

from .driver import run_greedy, scenario
from .greedy_agreement import assert_greedy_agrees
from .tp_group import probe_plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _worker(folder: Path, backend: str, cuda_graph: bool = False,
            graph_plan: str = "once") -> TPWorker:
    return TPWorker(WorkerConfig(str(folder), device="cuda", dtype="bfloat16",
                                 attention_backend=backend, cuda_graph=cuda_graph,
                                 cuda_graph_max_batch=8, cuda_graph_plan=graph_plan,
                                 max_running_requests=8,
                                 max_context_len=128, max_total_tokens=4096))


PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [1, 5, 9, 13, 40, 41, 42, 43, 44], [1, 5, 9, 100]]
# bf16 logits of this model (magnitude up to ~8) are 1/32 apart; the two paths round at other
# points (flashinfer's norms keep their sums in float32), and on an H200 a few of 1,536 logits
# were up to 0.051 apart. A wrong slot, position or head moves logits by whole units.
BF16_LOGITS = dict(atol=0.1, rtol=0.05)


def test_flashinfer_matches_torch_backend(gpu_model: Path) -> None:
    torch_worker, fi_worker = _worker(gpu_model, "torch"), _worker(gpu_model, "flashinfer")
    seqs = [p + [7, 8, 9] for p in PROMPTS]
    a = torch_worker.runner.forward(probe_plan(seqs, 1)).float()
    b = fi_worker.runner.forward(probe_plan(seqs, 1)).float()
    torch.testing.assert_close(b, a, **BF16_LOGITS)
    for mode in ("whole", "chunked", "prefix"):
        ref = run_greedy(torch_worker.step, scenario(mode, PROMPTS, 8))
        got = run_greedy(fi_worker.step, scenario(mode, PROMPTS, 8))
        # bf16 kernels differ in rounding: tokens may part only at a near tie (on an H100 the
        # prefix case parted at its third token, where the two paths picked 309 and 137)
        assert_greedy_agrees(torch_worker, PROMPTS, ref, got)


def test_cuda_graph_decode_matches_eager(gpu_model: Path) -> None:
    """The graphs replay the eager kernels (planned every replay) exactly; the graphs planned
    once run another kernel (test_graph_plan_gpu.py)."""
    eager = _worker(gpu_model, "flashinfer")
    graphed = _worker(gpu_model, "flashinfer", True, "every_step")
    assert graphed.runner.graph_runner is not None
    assert graphed.runner.graph_runner.batch_sizes == [1, 2, 4, 8]
    for mode in ("whole", "chunked"):
        assert (run_greedy(graphed.step, scenario(mode, PROMPTS, 10))
                == run_greedy(eager.step, scenario(mode, PROMPTS, 10)))


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2's layout at a flashinfer head size: alternating windows of 4, soft caps and a
    softmax scale other than head_dim ** -0.5."""
    pytest.importorskip("flashinfer")
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, max_position_embeddings=512, initializer_range=0.1,
                          sliding_window=4, query_pre_attn_scalar=32,
                          attn_logit_softcapping=5.0, final_logit_softcapping=10.0)
    folder = tmp_path_factory.mktemp("gpu") / "gemma2"
    Gemma2ForCausalLM(config).save_pretrained(folder)
    return folder


def test_flashinfer_windows_and_soft_caps_match_torch_backend(windowed_model: Path) -> None:
    torch_worker = _worker(windowed_model, "torch")
    fi_worker = _worker(windowed_model, "flashinfer")
    graphed = _worker(windowed_model, "flashinfer", cuda_graph=True)
    seqs = [p + [7, 8, 9] for p in PROMPTS]  # longer than the window
    a = torch_worker.runner.forward(probe_plan(seqs, 1)).float()
    b = fi_worker.runner.forward(probe_plan(seqs, 1)).float()
    torch.testing.assert_close(b, a, **BF16_LOGITS)
    for mode in ("whole", "chunked", "prefix"):
        ref = run_greedy(torch_worker.step, scenario(mode, PROMPTS, 8))
        for worker in (fi_worker, graphed):
            got = run_greedy(worker.step, scenario(mode, PROMPTS, 8))
            same = sum(x == y for r, g in zip(ref, got, strict=True)
                       for x, y in zip(r, g, strict=True))
            assert same >= 0.8 * 24, (mode, ref, got)
