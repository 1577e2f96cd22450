"""Decode under CUDA graphs: one graph per bucketed batch size, captured once at start-up.

Static buffers hold the graph's inputs (token ids, positions, slots) and its output (logits). A
decode batch of n requests replays the smallest captured size >= n; the padding entries read
and write the padding page (slot 0). Needs the flashinfer backend, whose graph wrappers read their
page tables from static buffers too, updated before each replay from what changed since the last
(and planned once, or before each replay: flashinfer_backend.py, `graph_plan`).
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from .attention.base import ForwardBatch
from .attention.flashinfer_backend import FlashInferAttentionBackend
from .models import LlamaForCausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to `max_batch` (always included)."""
    if max_batch < 1:
        raise ValueError(f"cuda_graph_max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: LlamaForCausalLM, backend: FlashInferAttentionBackend,
                 max_batch: int, max_context_len: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.batch_sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.batch_sizes[-1]
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        # int32: the fused K/V append's index type (the copy in `replay` casts)
        self.out_cache_loc = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        backend.init_graph_state(self.batch_sizes, max_context_len)
        self._capture_all()

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.max_batch

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        start = time.perf_counter()
        # largest first, so smaller ones reuse its memory
        for bs in tqdm(list(reversed(self.batch_sizes)), desc="capturing CUDA graphs",
                       unit="graph"):
            rows, lens = np.zeros(0, np.int64), np.zeros(0, np.int64)
            self.backend.plan_graph(bs, rows, lens, self.out_cache_loc[:bs])
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph (allocator, lazy inits)
                    self._run(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[bs] = self._run(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs: %d decode batch sizes up to %d captured in %.1f s",
                    len(self.batch_sizes), self.max_batch, time.perf_counter() - start)

    def _run(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.backend)
        return self.model.compute_logits(hidden)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [n, vocab] of a decode batch of n <= max_batch requests."""
        n = batch.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.out_cache_loc[:n].copy_(batch.out_cache_loc, non_blocking=True)
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.out_cache_loc[n:bs].zero_()
        self.backend.plan_graph(bs, batch.row_idx, batch.seq_lens, self.out_cache_loc[:bs],
                                batch.row_versions)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
