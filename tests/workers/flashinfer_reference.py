"""FlashInfer's paged-KV wrappers, written out in plain torch from its documented format (CPU).

This is what lets the CPU tests check the half of the flashinfer backend that is ours: the page
tables it builds from the request->token table, the plan of each step, the padded plans of the
CUDA-graph decode. The kernels themselves only run on a GPU (tests/workers/test_gpu.py).

The format, as flashinfer 0.7 documents it for `BatchDecodeWithPagedKVCacheWrapper` and
`BatchPrefillWithPagedKVCacheWrapper` with the "NHD" layout:

- the cache is `(k, v)`, each `[num_pages, page_size, num_kv_heads, head_dim]`;
- request i's pages are `indices[indptr[i]:indptr[i + 1]]`, in order, and its last page holds
  `last_page_len[i]` tokens (1..page_size); all three are int32;
- prefill: request i's queries are rows `qo_indptr[i]:qo_indptr[i + 1]` of q; with `causal`, the
  mask is aligned to the end of the KV (query j of n sits at KV position kv_len - n + j);
- decode: one query row per request;
- query head h reads KV head h // (num_qo_heads // num_kv_heads); the scale is `sm_scale`,
  1/sqrt(head_dim) when not given;
- `window_left` w >= 0: the query at KV position i sees keys [i - w, i] only ("the left
  (inclusive) window size"); -1 is no window;
- `logits_soft_cap` c > 0: scores become c * tanh(scores / c) before the softmax;
- with `use_cuda_graph`, the batch size is fixed by the buffers given to the constructor, `plan`
  copies the page tables into them (the page ids it is given: `indices[:len(indices)]`), and
  `run` (the replayed graph) reads only those buffers, as they are when it runs;
- a decode plan's work partition (which CTA reads which KV chunk of which request) follows the
  requests' page counts, except on the tensor-core kernel with `disable_split_kv=True`, where it
  is one chunk per request whatever its length (flashinfer's scheduler.cuh). A graph replayed
  over other page counts than its last plan's would read a stale partition: here that raises.
  The CUDA-core kernel (`use_tensor_cores=False`) takes neither split control (flashinfer
  raises for `fixed_split_size` there and ignores `disable_split_kv`).
"""

from __future__ import annotations

import math
import types

import numpy as np
import torch

from raydix.workers.attention.flashinfer_backend import FlashInferAttentionBackend
from raydix.workers.cuda_graph import CudaGraphRunner
from raydix.workers.runner import ModelRunner


def _int32(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    return t


class _Tables:
    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 window_left: int = -1, logits_soft_cap: float | None = None,
                 sm_scale: float | None = None) -> None:
        self.indptr = _int32("indptr", indptr).cpu()
        self.indices = _int32("indices", indices)
        self.last = _int32("last_page_len", last_page_len).cpu()
        batch = len(self.indptr) - 1
        if len(self.last) != batch:
            raise ValueError(f"last_page_len has {len(self.last)} entries for {batch} requests")
        if int(self.indptr[-1]) > len(self.indices):
            raise ValueError(f"indptr ends at {int(self.indptr[-1])}, past {len(self.indices)} "
                             "indices")
        if bool((self.indptr[1:] <= self.indptr[:-1]).any()):
            raise ValueError(f"every request needs a page: indptr {self.indptr.tolist()}")
        if bool(((self.last < 1) | (self.last > page_size)).any()):
            raise ValueError(f"last_page_len out of [1, {page_size}]: {self.last.tolist()}")
        if num_qo_heads % num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        self.group = num_qo_heads // num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        if not isinstance(window_left, int) or window_left < -1:
            raise ValueError(f"window_left must be an int >= -1, got {window_left!r}")
        self.window_left = window_left
        self.soft_cap = logits_soft_cap or 0.0
        self.scale = sm_scale if sm_scale is not None else 1 / math.sqrt(head_dim)

    def kv(self, i: int, cache: tuple[torch.Tensor, torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's K and V, [kv_len, Hk, D]."""
        pages = self.indices[int(self.indptr[i]): int(self.indptr[i + 1])].long()
        kv_len = (len(pages) - 1) * self.page_size + int(self.last[i])
        k, v = (c[pages].reshape(-1, *c.shape[2:])[:kv_len] for c in cache)
        return k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               causal: bool) -> torch.Tensor:
        """q [n, Hq, D] over k/v [L, Hk, D] -> [n, Hq, D], in fp32."""
        k = k.float().repeat_interleave(self.group, dim=1)
        v = v.float().repeat_interleave(self.group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * self.scale
        if self.soft_cap:
            scores = torch.tanh(scores / self.soft_cap) * self.soft_cap
        n, length = q.shape[0], k.shape[0]
        q_pos = torch.arange(n)[:, None] + (length - n)  # decode: the one query is the last
        kv_pos = torch.arange(length)[None, :]
        hidden = kv_pos > q_pos if causal else torch.zeros(n, length, dtype=torch.bool)
        if self.window_left >= 0:
            hidden = hidden | (kv_pos < q_pos - self.window_left)
        scores = scores.masked_fill(hidden, float("-inf"))
        return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        if kv_layout != "NHD":
            raise ValueError("only the NHD layout is modelled")
        self.use_cuda_graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        self.partition: list[int] | None = None  # the page counts the last plan split over
        self.attend: dict[str, object] = {}
        if use_cuda_graph:
            if (paged_kv_indptr_buffer is None or paged_kv_indices_buffer is None
                    or paged_kv_last_page_len_buffer is None):
                raise ValueError("use_cuda_graph needs the three page-table buffers")
            self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                            paged_kv_last_page_len_buffer)
        self.tables: _Tables | None = None
        self.plans = 0

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: torch.dtype | None = None,
             kv_data_type: torch.dtype | None = None, sm_scale: float | None = None,
             fixed_split_size: int | None = None, disable_split_kv: bool = False) -> None:
        if fixed_split_size is not None and not self.use_tensor_cores:
            raise ValueError("fixed_split_size is only supported by tensor core decode for now.")
        attend = dict(window_left=window_left, logits_soft_cap=logits_soft_cap,
                      sm_scale=sm_scale)
        self.attend = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, page_size=page_size, **attend)
        if self.use_cuda_graph:
            # flashinfer copies the tables into the wrapper's buffers: indptr and lengths whole,
            # the page ids given (a caller whose ids are in the buffer already may give none)
            indptr_buf, indices_buf, last_buf = self.buffers
            if len(indptr) != len(indptr_buf):
                raise ValueError(f"a graph wrapper's batch is fixed at {len(indptr_buf) - 1}, "
                                 f"planned with {len(indptr) - 1}")
            if len(indices) > len(indices_buf):
                raise ValueError(f"{len(indices)} pages overflow the {len(indices_buf)}-entry "
                                 "indices buffer")
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last_page_len)
            indptr, indices, last_page_len = self.buffers
        tables = _Tables(indptr, indices, last_page_len, **self.attend)  # type: ignore[arg-type]
        self.plans += 1
        pinned = self.use_tensor_cores and disable_split_kv
        self.partition = None if pinned else torch.diff(tables.indptr).tolist()
        self.tables = tables

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]
            ) -> torch.Tensor:
        tables = self.tables
        if tables is None:
            raise RuntimeError("run before plan")
        if self.use_cuda_graph:  # the replayed graph reads the static buffers as they are now
            tables = _Tables(*self.buffers, **self.attend)  # type: ignore[arg-type]
            if self.partition is not None and torch.diff(tables.indptr).tolist() != self.partition:
                raise RuntimeError(f"replayed over page counts {torch.diff(tables.indptr).tolist()}"
                                   f" but planned (split-KV partition) for {self.partition}")
        if q.shape[0] != len(tables.indptr) - 1:
            raise ValueError(f"{q.shape[0]} queries for a plan of {len(tables.indptr) - 1}")
        out = [tables.attend(q[i: i + 1], *tables.kv(i, paged_kv_cache), causal=False)
               for i in range(q.shape[0])]
        return torch.cat(out).to(q.dtype)


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        if kv_layout != "NHD":
            raise ValueError("only the NHD layout is modelled")
        self.tables: _Tables | None = None
        self.qo_indptr: torch.Tensor | None = None
        self.causal = False
        self.plans = 0

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
             packed_custom_mask: torch.Tensor | None = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: float | None = None, window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: torch.dtype | None = None,
             kv_data_type: torch.dtype | None = None) -> None:
        self.tables = _Tables(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                              num_qo_heads, num_kv_heads, head_dim_qk, page_size, window_left,
                              logits_soft_cap, sm_scale)
        self.qo_indptr = _int32("qo_indptr", qo_indptr).cpu()
        if len(self.qo_indptr) != len(self.tables.indptr):
            raise ValueError("qo_indptr and paged_kv_indptr disagree on the batch size")
        self.causal = causal
        self.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]
            ) -> torch.Tensor:
        tables, qo = self.tables, self.qo_indptr
        if tables is None or qo is None:
            raise RuntimeError("run before plan")
        if q.shape[0] != int(qo[-1]):
            raise ValueError(f"{q.shape[0]} query rows for a plan of {int(qo[-1])}")
        out = []
        for i in range(len(qo) - 1):
            k, v = tables.kv(i, paged_kv_cache)
            rows = q[int(qo[i]): int(qo[i + 1])]
            if len(rows) > len(k):
                raise ValueError(f"request {i} has {len(rows)} queries but {len(k)} keys")
            out.append(tables.attend(rows, k, v, self.causal))
        return torch.cat(out).to(q.dtype)


def module() -> types.ModuleType:
    """A stand-in `flashinfer` module holding the two wrappers."""
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    mod.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    return mod


# ---- the flashinfer backend on a CPU runner, with eager stand-ins for captured graphs ------

def with_flashinfer(runner: ModelRunner, graph_plan: str = "once",
                     kind: type[FlashInferAttentionBackend] = FlashInferAttentionBackend
                     ) -> FlashInferAttentionBackend:
    """The runner's torch backend swapped for the flashinfer backend (`kind`), over the same
    pool and request->token table; `flashinfer` must be this module (`module()`)."""
    torch_backend = runner.backend
    backend = kind(runner.kv_pool, runner.req_to_token,
                   torch_backend.num_q_heads,  # type: ignore[attr-defined]
                   torch_backend.head_dim,  # type: ignore[attr-defined]
                   runner.model.layer_attention(), graph_plan)
    runner.backend = backend
    return backend


class EagerReplay:
    """Stands in for one captured graph: replay reruns the captured call into its output."""

    replays = 0

    def __init__(self, runner: CudaGraphRunner, bs: int) -> None:
        self.runner, self.bs = runner, bs

    def replay(self) -> None:
        EagerReplay.replays += 1
        self.runner.logits[self.bs].copy_(self.runner._run(self.bs))


class EagerGraphRunner(CudaGraphRunner):
    """The CUDA-graph runner with capture swapped for eager calls; replay's padding, static
    buffers and graph plans are the real ones."""

    def _capture_all(self) -> None:
        empty = np.zeros(0, np.int64)
        for bs in self.batch_sizes:
            self.backend.plan_graph(bs, empty, empty, self.out_cache_loc[:bs])
            self.logits[bs] = self._run(bs)
            self.graphs[bs] = EagerReplay(self, bs)  # type: ignore[assignment]
