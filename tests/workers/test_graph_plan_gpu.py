"""CUDA only: planning a CUDA-graph decode once (`cuda_graph_plan="once"`) is right.

- flashinfer's plan with the KV split off writes the same plan and the same int workspace
  whatever the requests' page counts (and with the split on it does not: the check can tell);
- captured graphs replayed over a page table kept in place (requests crossing pages, one
  leaving, padding) give the attention of a plain fp32 reference, planned once or every replay,
  and the once-planned wrappers are never planned again;
- the runner's greedy tokens with either plan agree with eager decode.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from raydix.workers.config import WorkerConfig
from raydix.workers.step import GREEDY, ScheduledRequest, StepPlan
from raydix.workers.worker import TPWorker

from .driver import run_greedy, scenario
from .greedy_agreement import assert_greedy_agrees
from .test_gpu import BF16_LOGITS
from .tp_group import probe_plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HEADS_Q, HEADS_KV, DIM = 32, 4, 64  # TinyLlama-1.1B's attention


def _graph_wrapper(bs: int, tensor_cores: bool = True) -> object:
    flashinfer = pytest.importorskip("flashinfer")
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indices_buffer=torch.zeros(8192, dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device="cuda"))


def _plan(wrapper: object, page_counts: list[int], page_size: int, window_left: int,
          **split: bool) -> tuple[list[int], torch.Tensor]:
    """(plan info, int workspace) after planning these page counts."""
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(page_counts)]), dtype=torch.int32)
    indices = torch.arange(1, int(indptr[-1]) + 1, dtype=torch.int32, device="cuda")
    last = torch.full((len(page_counts),), max(1, page_size // 2), dtype=torch.int32)
    wrapper.plan(indptr, indices, last, HEADS_Q, HEADS_KV, DIM,  # type: ignore[attr-defined]
                 page_size, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                 window_left=window_left, **split)
    torch.cuda.synchronize()
    info = [int(x) for x in wrapper._plan_info]  # type: ignore[attr-defined]
    return info, wrapper._int_workspace_buffer.clone()  # type: ignore[attr-defined]


@pytest.mark.parametrize("window_left", [-1, 7])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_plan_with_the_split_off_does_not_depend_on_lengths(page_size: int,
                                                              window_left: int) -> None:
    short, long = [1, 1, 1, 1], [3000 // page_size, 2, 700 // page_size, 1]
    pinned = _graph_wrapper(4)
    info_a, work_a = _plan(pinned, short, page_size, window_left, disable_split_kv=True)
    info_b, work_b = _plan(pinned, long, page_size, window_left, disable_split_kv=True)
    assert info_a == info_b
    assert torch.equal(work_a, work_b)
    if window_left >= 0:  # a window caps the KV a split sees: these lengths split alike
        return
    split = _graph_wrapper(4)  # flashinfer's own split: the partition follows the page counts
    info_c, work_c = _plan(split, short, page_size, window_left)
    info_d, work_d = _plan(split, long, page_size, window_left)
    assert info_c != info_d or not torch.equal(work_c, work_d)


def _reference(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               table: torch.Tensor, rows: np.ndarray, lens: np.ndarray) -> torch.Tensor:
    out = []
    for i, (row, n) in enumerate(zip(rows.tolist(), lens.tolist(), strict=True)):
        slots = table[row, :n].long()
        k = k_buf[slots].float().repeat_interleave(HEADS_Q // HEADS_KV, dim=1)
        v = v_buf[slots].float().repeat_interleave(HEADS_Q // HEADS_KV, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * DIM ** -0.5
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("graph_plan", ["once", "every_step"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_replays_over_a_kept_page_table_match_the_reference(graph_plan: str,
                                                            page_size: int) -> None:
    pytest.importorskip("flashinfer")
    from raydix.workers.attention.flashinfer_backend import FlashInferAttentionBackend
    from raydix.workers.kv_pool import KVPool, KVPoolConfig

    torch.manual_seed(0)
    num_rows, max_len, bs = 8, 512, 4
    pages_each = max_len // page_size
    pool = KVPool(KVPoolConfig(num_rows * pages_each, page_size, 1, HEADS_KV, DIM,
                               torch.bfloat16), "cuda")
    for buf in pool.buffers:
        buf.normal_()
    pages = (torch.randperm(num_rows * pages_each) + 1).view(num_rows, pages_each)
    pos = torch.arange(max_len)
    table = (pages[:, pos // page_size] * page_size + pos % page_size).int().cuda()
    backend = FlashInferAttentionBackend(pool, table, HEADS_Q, DIM, graph_plan=graph_plan)
    backend.init_graph_state([bs], max_len)
    q = torch.zeros(bs, HEADS_Q, DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(bs, HEADS_KV, DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    slots = torch.zeros(bs, dtype=torch.int32, device="cuda")
    empty = np.zeros(0, np.int64)
    backend.plan_graph(bs, empty, empty, slots)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(0, q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(0, q, k, v)
    if graph_plan == "once":  # a replay writes the page table; planning again is a bug
        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("a once-planned graph wrapper was planned again")
        backend._graph_wrappers[bs, 0].plan = refuse  # type: ignore[attr-defined]
    rows, lens = np.array([1, 4, 6]), np.array([5, 3 * page_size - 2, 17])
    versions = np.zeros(8, np.int64)
    assert backend.graph_table is not None
    rebuilds = backend.graph_table.num_rebuilds
    for step in range(3 * page_size + 8):
        if step == 2 * page_size:  # a request leaves: the table is rebuilt
            rows, lens = rows[[0, 2]], lens[[0, 2]]
        n = len(rows)
        slots.zero_()
        slots[:n] = table[torch.from_numpy(rows).cuda(), torch.from_numpy(lens - 1).cuda()]
        q.normal_()
        k.normal_()
        v.normal_()
        backend.plan_graph(bs, rows, lens, slots, versions[rows])
        graph.replay()
        want = _reference(q[:n], pool.k_buffers[0], pool.v_buffers[0], table, rows, lens)
        torch.testing.assert_close(out[:n].view(n, HEADS_Q, DIM).float(), want,
                                   atol=2e-2, rtol=2e-2)
        lens = lens + 1
    assert backend.graph_table is not None
    # rebuilt at the first step and when the request left; updated in place otherwise
    assert backend.graph_table.num_rebuilds - rebuilds == 2


def _worker(folder: Path, cuda_graph: bool, plan: str = "once") -> TPWorker:
    return TPWorker(WorkerConfig(str(folder), device="cuda", dtype="bfloat16",
                                 attention_backend="flashinfer", cuda_graph=cuda_graph,
                                 cuda_graph_max_batch=8, cuda_graph_plan=plan,
                                 max_running_requests=8, max_context_len=128,
                                 max_total_tokens=4096))


PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [1, 5, 9, 13, 40, 41, 42, 43, 44], [1, 5, 9, 100]]


def _decode_logits(worker: TPWorker) -> torch.Tensor:
    """Logits of one decode step (a graph replay when graphs are on) after the prompts."""
    seqs = [p + [7, 8, 9] for p in PROMPTS]
    worker.runner.forward(probe_plan(seqs, 1))
    slot = 1 + sum(len(s) for s in seqs)
    decode = StepPlan.build(10_001, [ScheduledRequest(i, len(s), [5], [slot + i], GREEDY)
                                     for i, s in enumerate(seqs)])
    return worker.runner.forward(decode).float()


def test_graph_plans_give_eager_decodes_tokens(gpu_model: Path) -> None:
    """every_step replays flashinfer's own decode kernels: the eager tokens exactly; once
    runs the tensor-core kernel without a split: the same logits to bf16 rounding."""
    eager = _worker(gpu_model, False)
    once, every = _worker(gpu_model, True, "once"), _worker(gpu_model, True, "every_step")
    # a few logits 0.045 apart on an H200: rounding (test_gpu.py, BF16_LOGITS)
    torch.testing.assert_close(_decode_logits(once), _decode_logits(eager), **BF16_LOGITS)
    for mode in ("whole", "chunked", "prefix"):
        want = run_greedy(eager.step, scenario(mode, PROMPTS, 10))
        assert run_greedy(every.step, scenario(mode, PROMPTS, 10)) == want, mode
        got = run_greedy(once.step, scenario(mode, PROMPTS, 10))
        assert_greedy_agrees(eager, PROMPTS, want, got)
