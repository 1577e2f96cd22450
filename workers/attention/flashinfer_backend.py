"""FlashInfer paged attention (CUDA only; `flashinfer` is imported when this backend is made).

The KV pool's per-layer `[num_slots, heads, head_dim]` tensors are viewed as
`[num_pages + 1, page_size, heads, head_dim]` (FlashInfer's "NHD" paged layout). That view is only
right when the engine allocates page-aligned slots: position p of a request lives in slot
`page(p) * page_size + p % page_size`, which the paged allocator guarantees. Page ids of a request
are read from its request->token row at positions 0, page_size, 2 * page_size, ...

Decode-only batches use the decode wrapper; batches with any extend use the prefill wrapper
(FlashInfer's causal mask is aligned to the end of the KV, so cached prefixes just work).
`plan_graph` / `graph_wrapper` serve the CUDA-graph runner: one decode wrapper per captured batch
size, with static index buffers that `plan` refills before each replay.

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
from ..req_table import to_device
from .base import AttentionBackend, ForwardBatch, LayerAttention

WORKSPACE_BYTES = 256 << 20


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, num_q_heads: int,
                 head_dim: int, layers: Sequence[LayerAttention] | None = None) -> None:
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
        self._graph_wrappers: dict[tuple[int, int], object] = {}  # (batch size, kind)
        self._graph_indices: torch.Tensor | None = None
        self._wrappers: list[object] = []  # this step's wrapper of each kind
        self._out_cache_loc: torch.Tensor | None = None

    def _kind_args(self, kind: int) -> dict[str, object]:
        a = self.kinds[kind]
        return dict(window_left=a.window - 1 if a.window else -1,
                    logits_soft_cap=a.logit_softcap or None,
                    sm_scale=a.softmax_scale(self.head_dim))

    # ---- page tables ------------------------------------------------------------------------

    def _page_table(self, row_idx: np.ndarray, seq_lens: np.ndarray,
                    num_padding: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_indptr [host], kv_indices [device], kv_last_page_len [host]) for the requests,
        plus `num_padding` padding requests of one token each on page 0."""
        ps = self.page_size
        num_pages = (seq_lens + ps - 1) // ps
        starts = np.cumsum(num_pages) - num_pages
        owner = np.repeat(np.arange(len(row_idx)), num_pages)
        cols = (np.arange(int(num_pages.sum())) - np.repeat(starts, num_pages)) * ps
        rows_t = to_device(row_idx[owner], self.device)  # pinned staging, no host sync
        cols_t = to_device(cols, self.device)
        indices = torch.div(self.req_to_token[rows_t, cols_t], ps, rounding_mode="floor").int()
        last = seq_lens - (num_pages - 1) * ps
        if num_padding:
            indices = torch.cat([indices, torch.zeros(num_padding, dtype=torch.int32,
                                                      device=self.device)])
            num_pages = np.concatenate([num_pages, np.ones(num_padding, np.int64)])
            last = np.concatenate([last, np.ones(num_padding, np.int64)])
        indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
        # indptr and last-page lengths stay on the host: `plan` reads them there, and a device
        # copy would cost a device->host sync inside `plan`
        return torch.from_numpy(indptr), indices, torch.from_numpy(last.astype(np.int32))

    # ---- eager steps ------------------------------------------------------------------------

    def prepare(self, batch: ForwardBatch) -> None:
        self._out_cache_loc = batch.out_cache_loc.to(torch.int32)  # once a step, not a layer
        indptr, indices, last = self._page_table(batch.row_idx, batch.seq_lens)
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
        """Make one graph-safe decode wrapper per batch size, over shared static buffers."""
        max_bs = max(batch_sizes)
        max_pages = max_bs * (-(-max_context_len // self.page_size))
        self._graph_indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        for bs in batch_sizes:
            for kind in range(len(self.kinds)):
                self._graph_wrappers[bs, kind] = self._graph_wrapper(bs)

    def _graph_wrapper(self, bs: int) -> object:
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._use_tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=self.device))

    def plan_graph(self, graph_bs: int, row_idx: np.ndarray, seq_lens: np.ndarray,
                   out_cache_loc: torch.Tensor) -> None:
        """Plan a decode of len(row_idx) requests padded to `graph_bs` on the graph wrapper.
        `out_cache_loc` is the graph's static slot buffer (int32: the paged append's index
        type)."""
        indptr, indices, last = self._page_table(row_idx, seq_lens, graph_bs - len(row_idx))
        dtype = self.pool.config.dtype
        self._wrappers = []
        for kind in range(len(self.kinds)):
            wrapper = self._graph_wrappers[graph_bs, kind]
            wrapper.plan(indptr, indices, last, self.num_q_heads,  # type: ignore[attr-defined]
                         self.num_kv_heads, self.head_dim, self.page_size, q_data_type=dtype,
                         kv_data_type=dtype, **self._kind_args(kind))
            self._wrappers.append(wrapper)
        self._out_cache_loc = out_cache_loc
