"""FlashInfer paged attention (CUDA only; `flashinfer` is imported when this backend is made).

The KV pool's per-layer `[num_slots, heads, head_dim]` tensors are viewed as
`[num_pages + 1, page_size, heads, head_dim]` (FlashInfer's "NHD" paged layout). That view is only
right when the engine allocates page-aligned slots: position p of a request lives in slot
`page(p) * page_size + p % page_size`, which the paged allocator guarantees. Page ids of a request
are read from its request->token row at positions 0, page_size, 2 * page_size, ...

Decode-only batches use the decode wrapper; batches with any extend use the prefill wrapper
(FlashInfer's causal mask is aligned to the end of the KV, so cached prefixes just work).
The page tables are kept between steps and updated from what changed (page_table.py).

CUDA graphs (`init_graph_state` / `plan_graph`): one graph-safe decode wrapper per captured batch
size and kind, all reading one set of static page-table buffers that the graph page table keeps
up to date. What each replay plans depends on `graph_plan`:

- "once" (the default): every graph wrapper is planned once, at start, with flashinfer's KV split
  off (`disable_split_kv`, on the tensor-core decode kernel: the only one with the control).
  A plan's output is the work partition the kernels read from the wrapper's int workspace;
  without a split it is one work item per (request, KV head), whatever the requests' lengths:
  flashinfer's scheduler (`PrefillSplitQOKVIndptr`, include/flashinfer/attention/scheduler.cuh)
  then makes one KV chunk per request, so `request_indices` = 0..B-1, every q and kv tile index
  0, `o_indptr` = 0..B, no merge, and `padded_batch_size` and the valid-block mask from the
  batch size and head counts alone. The kernels read each request's length from the indptr /
  last-page buffers at run time. So a replay only needs those buffers written: no `plan`, no
  host copies of indptr, no workspace upload. The cost: one CTA works through a request's whole
  KV per KV head, so a batch of few long requests leaves most SMs idle (batch 1, 4 KV heads
  per rank: 4 CTAs); flashinfer's split would spread a 32k context over the GPU.
- "every_step": the graph wrappers keep flashinfer's own split (and its CUDA-core kernel for
  small GQA groups), and each replay plans again, since the split's partition follows the
  requests' page counts (`DecodeSplitKVIndptr` / `PrefillBinarySearchKVChunkSize`), as in
  SGLang's and vLLM's graph decode; the page table is still kept, not rebuilt.

Layers that attend differently (a sliding window, a soft cap, another softmax scale: each
distinct `LayerAttention` is a "kind") get wrappers of their own, planned with the same page
tables and their kind's `window_left` (window - 1: flashinfer counts the keys left of the
query), `logits_soft_cap` and `sm_scale`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..kv_pool import KVPool
from .base import AttentionBackend, ForwardBatch, LayerAttention
from .page_table import PageTable, PageTableView

WORKSPACE_BYTES = 256 << 20
GRAPH_PLANS = ("once", "every_step")
EAGER_PAGES = 1 << 14  # the eager page table's first size (int32 entries)


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, num_q_heads: int,
                 head_dim: int, layers: Sequence[LayerAttention] | None = None,
                 graph_plan: str = "once") -> None:
        if graph_plan not in GRAPH_PLANS:
            raise ValueError(f"graph_plan must be one of {GRAPH_PLANS}, got {graph_plan!r}")
        import flashinfer

        self._flashinfer = flashinfer
        self.pool = pool
        self.req_to_token = req_to_token
        self.device = req_to_token.device
        self.num_q_heads = num_q_heads
        self.num_kv_heads = pool.config.num_kv_heads
        self.head_dim = head_dim
        self.page_size = pool.config.page_size
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        group = num_q_heads // self.num_kv_heads
        self._use_tensor_cores = group >= 4
        layers = tuple(layers or [LayerAttention()] * pool.config.num_layers)
        self.kinds = sorted(set(layers), key=layers.index)  # distinct ways layers attend
        self.layer_kind = [self.kinds.index(a) for a in layers]
        self.prefill_wrappers = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD") for _ in self.kinds]
        self.decode_wrappers = [flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self._use_tensor_cores) for _ in self.kinds]
        self.prefill_wrapper, self.decode_wrapper = self.prefill_wrappers[0], self.decode_wrappers[0]
        self.graph_plan = graph_plan
        self._graph_wrappers: dict[tuple[int, int], object] = {}  # (batch size, kind)
        self.graph_table: PageTable | None = None
        max_rows, max_len = req_to_token.shape
        # eager steps' table: its indices grow to the largest batch's pages
        self.table = PageTable(req_to_token, self.page_size, max_rows,
                               min(EAGER_PAGES, max_rows * -(-max_len // self.page_size)),
                               growable=True)
        self._wrappers: list[object] = []  # this step's wrapper of each kind
        self._out_cache_loc: torch.Tensor | None = None

    def _kind_args(self, kind: int) -> dict[str, object]:
        a = self.kinds[kind]
        return dict(window_left=a.window - 1 if a.window else -1,
                    logits_soft_cap=a.logit_softcap or None,
                    sm_scale=a.softmax_scale(self.head_dim))

    # ---- eager steps ------------------------------------------------------------------------

    def prepare(self, batch: ForwardBatch) -> None:
        self._out_cache_loc = batch.out_cache_loc.to(torch.int32)  # once a step, not a layer
        indptr, indices, last = self.table.update(batch.row_idx, batch.seq_lens, 0,
                                                  batch.row_versions)
        dtype = self.pool.config.dtype
        if batch.is_decode:
            for kind, wrapper in enumerate(self.decode_wrappers):
                wrapper.plan(indptr, indices, last, self.num_q_heads, self.num_kv_heads,
                             self.head_dim, self.page_size, q_data_type=dtype,
                             kv_data_type=dtype, **self._kind_args(kind))
            self._wrappers = list(self.decode_wrappers)
        else:
            qo = torch.from_numpy(
                np.concatenate([[0], np.cumsum(batch.extend_lens)]).astype(np.int32))
            for kind, wrapper in enumerate(self.prefill_wrappers):
                wrapper.plan(qo, indptr, indices, last, self.num_q_heads, self.num_kv_heads,
                             self.head_dim, self.page_size, causal=True, q_data_type=dtype,
                             kv_data_type=dtype, **self._kind_args(kind))
            self._wrappers = list(self.prefill_wrappers)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        if not self._wrappers or self._out_cache_loc is None:
            raise RuntimeError("prepare(batch) (or plan_graph) must run before forward")
        self.pool.set_kv(layer_id, self._out_cache_loc, k, v)
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        k_cache = self.pool.k_buffers[layer_id].view(shape)
        v_cache = self.pool.v_buffers[layer_id].view(shape)
        wrapper = self._wrappers[self.layer_kind[layer_id]]
        # q may be a strided view of the qkv projection: the kernels read its row and head
        # strides (the last dim is contiguous), so it is not copied
        out = wrapper.run(q, (k_cache, v_cache))  # type: ignore[attr-defined]
        return out.view(q.shape[0], -1)

    # ---- CUDA graphs ------------------------------------------------------------------------

    def init_graph_state(self, batch_sizes: list[int], max_context_len: int) -> None:
        """Make the graph page table and one graph-safe decode wrapper per batch size and kind,
        over its buffers; with `graph_plan="once"` plan each of them now."""
        max_bs = max(batch_sizes)
        table = PageTable(self.req_to_token, self.page_size, max_bs,
                          max_bs * -(-max_context_len // self.page_size))
        self.graph_table = table
        once = self.graph_plan == "once"
        for bs in batch_sizes:
            for kind in range(len(self.kinds)):
                self._graph_wrappers[bs, kind] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True,
                    use_tensor_cores=once or self._use_tensor_cores,
                    paged_kv_indptr_buffer=table.indptr[: bs + 1],
                    paged_kv_indices_buffer=table.indices,
                    paged_kv_last_page_len_buffer=table.last[:bs])
            if once:  # on a table of padding only: the plan does not depend on it
                view = table.update(np.zeros(0, np.int64), np.zeros(0, np.int64), bs)
                for kind in range(len(self.kinds)):
                    self._plan_graph_wrapper(bs, kind, view)
        table.invalidate()  # the plans copied their tables into the buffers

    def _plan_graph_wrapper(self, bs: int, kind: int, view: PageTableView) -> None:
        dtype = self.pool.config.dtype
        split = dict(disable_split_kv=True) if self.graph_plan == "once" else {}
        # the page ids are in the wrapper's buffer already (the graph table writes them there):
        # given none, plan does not copy the buffer onto itself (vLLM's fast plan skips that
        # copy too); it copies indptr and the lengths, the same values, from the host
        self._graph_wrappers[bs, kind].plan(  # type: ignore[attr-defined]
            view.indptr, view.indices[:0], view.last, self.num_q_heads, self.num_kv_heads,
            self.head_dim, self.page_size, q_data_type=dtype, kv_data_type=dtype,
            **self._kind_args(kind), **split)

    def plan_graph(self, graph_bs: int, row_idx: np.ndarray, seq_lens: np.ndarray,
                   out_cache_loc: torch.Tensor, row_versions: np.ndarray | None = None) -> None:
        """Make the graph of `graph_bs` ready for a decode of len(row_idx) requests padded to
        its size: the page table updated in its buffers, and (graph_plan="every_step") the
        wrappers planned. `out_cache_loc` is the graph's static slot buffer (int32: the paged
        append's index type)."""
        if self.graph_table is None:
            raise RuntimeError("init_graph_state must run before plan_graph")
        view = self.graph_table.update(row_idx, seq_lens, graph_bs - len(row_idx), row_versions)
        if self.graph_plan == "every_step":
            for kind in range(len(self.kinds)):
                self._plan_graph_wrapper(graph_bs, kind, view)
        self._wrappers = [self._graph_wrappers[graph_bs, kind] for kind in range(len(self.kinds))]
        self._out_cache_loc = out_cache_loc
