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
"""

from __future__ import annotations

import numpy as np
import torch

from ..kv_pool import KVPool
from .base import AttentionBackend, ForwardBatch

WORKSPACE_BYTES = 256 << 20


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, num_q_heads: int,
                 head_dim: int) -> None:
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
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self._use_tensor_cores)
        self._graph_wrappers: dict[int, object] = {}
        self._graph_indices: torch.Tensor | None = None
        self._wrapper: object | None = None
        self._out_cache_loc: torch.Tensor | None = None

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
        rows_t = torch.from_numpy(row_idx[owner]).to(self.device, non_blocking=True)
        cols_t = torch.from_numpy(cols).to(self.device, non_blocking=True)
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
        self._out_cache_loc = batch.out_cache_loc
        indptr, indices, last = self._page_table(batch.row_idx, batch.seq_lens)
        dtype = self.pool.config.dtype
        if batch.is_decode:
            self.decode_wrapper.plan(indptr, indices, last, self.num_q_heads, self.num_kv_heads,
                                     self.head_dim, self.page_size, q_data_type=dtype,
                                     kv_data_type=dtype)
            self._wrapper = self.decode_wrapper
        else:
            qo = np.concatenate([[0], np.cumsum(batch.extend_lens)]).astype(np.int32)
            self.prefill_wrapper.plan(torch.from_numpy(qo), indptr, indices, last,
                                      self.num_q_heads, self.num_kv_heads, self.head_dim,
                                      self.page_size, causal=True, q_data_type=dtype,
                                      kv_data_type=dtype)
            self._wrapper = self.prefill_wrapper

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        if self._wrapper is None or self._out_cache_loc is None:
            raise RuntimeError("prepare(batch) (or plan_graph) must run before forward")
        self.pool.set_kv(layer_id, self._out_cache_loc, k, v)
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        k_cache = self.pool.k_buffers[layer_id].view(shape)
        v_cache = self.pool.v_buffers[layer_id].view(shape)
        out = self._wrapper.run(q.contiguous(), (k_cache, v_cache))  # type: ignore[attr-defined]
        return out.view(q.shape[0], -1)

    # ---- CUDA graphs ------------------------------------------------------------------------

    def init_graph_state(self, batch_sizes: list[int], max_context_len: int) -> None:
        """Make one graph-safe decode wrapper per batch size, over shared static buffers."""
        max_bs = max(batch_sizes)
        max_pages = max_bs * (-(-max_context_len // self.page_size))
        self._graph_indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        for bs in batch_sizes:
            self._graph_wrappers[bs] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self._use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32,
                                                         device=self.device))

    def plan_graph(self, graph_bs: int, row_idx: np.ndarray, seq_lens: np.ndarray,
                   out_cache_loc: torch.Tensor) -> None:
        """Plan a decode of len(row_idx) requests padded to `graph_bs` on the graph wrapper.
        `out_cache_loc` is the graph's static slot buffer."""
        wrapper = self._graph_wrappers[graph_bs]
        indptr, indices, last = self._page_table(row_idx, seq_lens, graph_bs - len(row_idx))
        dtype = self.pool.config.dtype
        wrapper.plan(indptr, indices, last, self.num_q_heads,  # type: ignore[attr-defined]
                     self.num_kv_heads, self.head_dim, self.page_size, q_data_type=dtype,
                     kv_data_type=dtype)
        self._wrapper = wrapper
        self._out_cache_loc = out_cache_loc
