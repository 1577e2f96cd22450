"""Attention with `scaled_dot_product_attention`: runs on CPU, and on CUDA as a fallback.

Single-token requests (decode) are attended in padded batches: on CPU those that share a long
prefix through cascade groups (cascade.py), the rest in at most two batches split by length
(`split_by_length`), so that a few long requests do not pad every short one to their length.
Multi-token requests (extend) run one request at a time, with a causal mask shifted by the
request's prefix length; on CPU, plain causal layers' extends run in a kernel of their own
(extend_kernel.py: bf16 on the AMX tiles, else as AVX-512-BF16 dot products; float32 as AVX-512
multiply-adds) where the CPU has one, else in bf16 as row blocks of matrix products
(block_causal.py).
Windowed layers (`LayerAttention.window`) mask the
keys before their window; layers with a logit soft cap compute their scores explicitly.
Cascades serve models whose layers are all plain. Extend attention runs through the SDPA
kernels named in `SDPA_BACKENDS`: left to choose, torch picks cuDNN attention on recent GPUs,
whose first call for each new prompt length builds a plan (41-48 ms on an H100, against 0.05 ms
for flash or memory-efficient attention). On CPU the list changes nothing (its kernels are
flash and math).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..cpu_features import amx_tiles
from ..kv_pool import KVPool
from . import extend_kernel
from .base import AttentionBackend, ForwardBatch, LayerAttention
from .block_causal import block_causal_attention, blocks_faster
from .cascade import CascadeBatch, cascade_attention, find_groups
from .paged_decode import Kernel

SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class _ExtendEntry:
    token_start: int
    extend_len: int
    rows: torch.Tensor  # [Hk * seq_len] pool rows (slot * Hk + head), head-major
    mask: torch.Tensor | None  # [extend_len, seq_len] bool, None when plain causal
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask


@dataclass
class _DecodeGroup:
    token_idx: torch.Tensor  # [Bd] packed index of each decode token
    slots: torch.Tensor  # [Bd, max_len] int64, each request's slots (past its length: unused)
    lens: torch.Tensor  # [Bd] int64
    rows: torch.Tensor | None  # [Bd * Hk * max_len] pool rows (slot * Hk + head); None: paged
    max_len: int
    padding: torch.Tensor  # [Bd, 1, 1, max_len] bool, True = past the request's length
    window_padding: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> padding


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, num_q_heads: int,
                 head_dim: int, layers: Sequence[LayerAttention] | None = None) -> None:
        self.pool = pool
        self.layers = tuple(layers or [LayerAttention()] * pool.config.num_layers)
        self._windows = sorted({a.window for a in self.layers if a.window})
        self._all_plain = all(a.is_plain(head_dim) for a in self.layers)
        self.req_to_token = req_to_token
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.num_kv_heads = pool.config.num_kv_heads
        self.device = req_to_token.device
        self._out_cache_loc: torch.Tensor | None = None
        self._decodes: list[_DecodeGroup] = []
        self._extends: list[_ExtendEntry] = []
        self._cascade: CascadeBatch | None = None
        self._cascade_token_idx: torch.Tensor | None = None
        # decode attention of plain layers on the pages in place (paged_decode.py); None: the
        # keys and values are copied into dense tensors
        self.paged_kernel: Kernel | None = None
        # bf16 extends on CPU through block_causal.py, not torch's flash kernel (tests compare),
        # where the CPU has no AMX tiles: with them torch's kernel runs its products on the
        # tiles and takes half the row blocks' time (block_causal.py)
        self.block_causal = not amx_tiles()
        # and where the CPU has AMX tiles or AVX-512-BF16 (bf16) or AVX-512 (float32) through
        # the kernel on them (extend_kernel.py): 0.55-0.71x flash's time on the tiles, against
        # the row blocks and float32's flash see extend_kernel.py (tests and
        # benchmarks/path_bench.py compare); the pool's dtype's kernel is built or loaded here,
        # not at the first prompt (loading it is tens of ms: the compiler's version is read)
        self.extend_kernel = self.device.type == "cpu"
        if self.extend_kernel:
            extend_kernel.available(dtype=pool.config.dtype)

    def prepare(self, batch: ForwardBatch) -> None:
        self._out_cache_loc = batch.out_cache_loc
        starts = batch.token_starts
        seq_lens = batch.seq_lens
        single = np.flatnonzero(batch.extend_lens == 1)
        self._decodes = []
        self._cascade = None
        if len(single) > 1 and self.device.type == "cpu" and self._all_plain:
            single = self._prepare_cascades(batch, single)
        paged = self._decodes_on_pages()  # no dense copy: one group, no pool rows
        parts = [single] if paged and len(single) else split_by_length(single, seq_lens[single])
        for part in parts:
            max_len = int(seq_lens[part].max())
            rows = torch.from_numpy(batch.row_idx[part]).to(self.device)
            lens = torch.from_numpy(seq_lens[part]).to(self.device)
            slots = self.req_to_token[rows, :max_len].long()  # [Bd, L]
            cols = torch.arange(max_len, device=self.device)[None, :]
            padding = cols >= lens[:, None]
            windowed = {w: (padding | (cols < lens[:, None] - w))[:, None, None, :]
                        for w in self._windows}
            self._decodes.append(_DecodeGroup(
                torch.from_numpy(starts[part]).to(self.device), slots, lens,
                None if paged else self._pool_rows(slots[:, None, :]).reshape(-1), max_len,
                padding[:, None, None, :], windowed))
        self._extends = []
        for i in np.flatnonzero(batch.extend_lens > 1):
            prefix, ext = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
            slots = self.req_to_token[int(batch.row_idx[i]), : prefix + ext].long()
            pool_rows = self._pool_rows(slots[None, :]).reshape(-1)  # [Hk * L]
            mask = None
            q_pos = torch.arange(ext, device=self.device)[:, None] + prefix
            kv_pos = torch.arange(prefix + ext, device=self.device)[None, :]
            if prefix:
                mask = kv_pos <= q_pos
            windowed = {w: (kv_pos <= q_pos) & (kv_pos > q_pos - w) for w in self._windows}
            self._extends.append(_ExtendEntry(int(starts[i]), ext, pool_rows, mask, windowed))

    def _decodes_on_pages(self) -> bool:
        """Every layer's decode attention reads the pages in place (the paged kernel)."""
        return self.paged_kernel is not None and self._all_plain

    def _prepare_cascades(self, batch: ForwardBatch, single: np.ndarray) -> np.ndarray:
        """Put decode requests that share a long prefix into cascade groups; return the rest."""
        seq_lens = batch.seq_lens[single]
        rows = torch.from_numpy(batch.row_idx[single])
        slots = self.req_to_token[rows, : int(seq_lens.max())].numpy()
        groups = find_groups(slots, seq_lens)
        if not groups:
            return single
        self._cascade = CascadeBatch.build(slots, seq_lens, groups, self.num_kv_heads)
        grouped = single[self._cascade.members]
        self._cascade_token_idx = torch.from_numpy(batch.token_starts[grouped])
        return np.setdiff1d(single, grouped)

    def _pool_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's pool viewed as [num_slots * Hk, D] for slots [..., 1, L]:
        [..., Hk, L], so one index_select yields K already in head-major order (no transpose
        copies before the matmuls)."""
        heads = torch.arange(self.num_kv_heads, device=self.device)[:, None]
        return slots * self.num_kv_heads + heads

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        if self._out_cache_loc is None:
            raise RuntimeError("prepare(batch) must run before forward")
        self.pool.set_kv(layer_id, self._out_cache_loc, k, v)
        return self.attend(q, self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id],
                           self.layers[layer_id])

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               attn: LayerAttention) -> torch.Tensor:
        """The step's attention for one layer whose new K/V are in `k_buf`/`v_buf` already
        (`forward` writes them; the CPU step graph writes them in its compiled code):
        q [T, Hq, D] -> [T, Hq * D]."""
        if self._out_cache_loc is None:
            raise RuntimeError("prepare(batch) must run before attend")
        out = torch.empty_like(q)
        for d in self._decodes:
            padding = d.window_padding[attn.window] if attn.window else d.padding
            out[d.token_idx] = self._decode_attention(q[d.token_idx], k_buf, v_buf, d, padding,
                                                      attn)
        if self._cascade is not None and self._cascade_token_idx is not None:
            idx = self._cascade_token_idx
            out[idx] = cascade_attention(q[idx], k_buf, v_buf, self._cascade, self.num_kv_heads)
        with sdpa_kernel(SDPA_BACKENDS) if self._extends else contextlib.nullcontext():
            for e in self._extends:
                if self._in_kernel(q, attn) and k_buf.dtype == q.dtype:
                    # the kernel reads the request's keys and values on the pages
                    extend_kernel.attention(q[e.token_start: e.token_start + e.extend_len],
                                            k_buf, v_buf, attn.softmax_scale(self.head_dim),
                                            out[e.token_start: e.token_start + e.extend_len],
                                            rows=e.rows)
                    continue
                qe = q[e.token_start: e.token_start + e.extend_len].transpose(0, 1)  # [Hq, n, D]
                shape = (self.num_kv_heads, -1, self.head_dim)
                ke = _gather(k_buf, e.rows).view(shape).to(q.dtype)  # [Hk, L, D]
                ve = _gather(v_buf, e.rows).view(shape).to(q.dtype)
                if self._in_kernel(q, attn):
                    extend_kernel.attention(q[e.token_start: e.token_start + e.extend_len], ke,
                                            ve, attn.softmax_scale(self.head_dim),
                                            out[e.token_start: e.token_start + e.extend_len])
                    continue
                if self._blocks_faster(q, attn, ke.shape[1]):
                    out[e.token_start: e.token_start + e.extend_len] = block_causal_attention(
                        qe, ke, ve, ke.shape[1] - e.extend_len, attn.softmax_scale(self.head_dim))
                    continue
                # CPU's flash kernel takes GQA as it is (enable_gqa: 0.6-0.9x the time of
                # expanding K and V first, 512-token prompts and 64-token extends); elsewhere,
                # and for the soft-capped scores, K and V are expanded here
                gqa = ke.shape[0] != qe.shape[0]
                native_gqa = gqa and self.device.type == "cpu" and not attn.logit_softcap
                if gqa and not native_gqa:
                    group = qe.shape[0] // ke.shape[0]
                    ke, ve = ke.repeat_interleave(group, 0), ve.repeat_interleave(group, 0)
                mask = e.window_masks[attn.window] if attn.window else e.mask
                if attn.logit_softcap:
                    res = _capped_attention(qe[None], ke[None], ve[None], mask, attn, self.head_dim)
                else:  # 4-D inputs take the fused CPU kernel
                    res = F.scaled_dot_product_attention(
                        qe[None], ke[None], ve[None], attn_mask=mask, is_causal=mask is None,
                        scale=attn.softmax_scale(self.head_dim), enable_gqa=native_gqa)
                out[e.token_start: e.token_start + e.extend_len] = res[0].transpose(0, 1)
        return out.view(q.shape[0], -1)

    def _in_kernel(self, q: torch.Tensor, attn: LayerAttention) -> bool:
        """This extend's attention runs in a kernel (extend_kernel.py): plain causal layers (no
        window, no soft cap) whose queries a kernel takes."""
        return (self.extend_kernel and not attn.window and not attn.logit_softcap
                and extend_kernel.serves(q, self.num_kv_heads))

    def _blocks_faster(self, q: torch.Tensor, attn: LayerAttention, num_keys: int) -> bool:
        """This extend's attention runs as row blocks of bf16 products (block_causal.py):
        on CPU, in bf16, for plain causal layers (no window, no soft cap), past a few keys."""
        return (self.block_causal and q.dtype == torch.bfloat16 and self.device.type == "cpu"
                and not attn.window and not attn.logit_softcap and blocks_faster(num_keys))

    def _decode_attention(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                          d: _DecodeGroup, padding: torch.Tensor,
                          attn: LayerAttention) -> torch.Tensor:
        """One query per request: the query heads that share a KV head become rows of one
        matmul against that head's keys (no KV expansion; faster than SDPA here on CPU). Plain
        layers read the pages in place when the paged kernel is built (paged_decode.py: faster
        than the dense copies at every batch and length measured, from one request of 32
        keys); the others, or without it, go through dense copies of the keys and values."""
        num_req, num_q_heads, head_dim = q.shape
        num_kv_heads = self.num_kv_heads
        qg = q.view(num_req, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
        if self.paged_kernel is not None and attn.is_plain(head_dim):
            out = self.paged_kernel(qg, k_buf, v_buf, d.slots, d.lens)
            return out.view(num_req, num_q_heads, head_dim)
        assert d.rows is not None  # only groups of all-plain layers skip the rows
        shape = (num_req, num_kv_heads, d.max_len, head_dim)
        k = _gather(k_buf, d.rows).view(shape).to(q.dtype)  # [Bd, Hk, L, D]
        v = _gather(v_buf, d.rows).view(shape).to(q.dtype)
        scores = torch.matmul(qg, k.transpose(-1, -2)) * attn.softmax_scale(head_dim)
        scores = _soft_cap(scores.float(), attn.logit_softcap)  # [Bd, Hk, G, L]
        scores = scores.masked_fill_(padding, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, v).view(num_req, num_q_heads, head_dim)


MIN_SPLIT_SAVING = 0.15  # split a decode batch in two when that gathers 15% fewer keys


def split_by_length(idx: np.ndarray, lens: np.ndarray) -> list[np.ndarray]:
    """``idx`` as one batch, or as two (shorter requests, longer requests) when padding each
    to its own longest length instead of all to the longest saves MIN_SPLIT_SAVING of the
    keys gathered."""
    if len(idx) < 4:
        return [idx] if len(idx) else []
    order = np.argsort(lens, kind="stable")
    s = lens[order]
    num = len(s)
    first = np.arange(1, num)  # requests in the shorter batch
    padded = first * s[first - 1] + (num - first) * s[-1]
    best = int(padded.argmin())
    if padded[best] > (1 - MIN_SPLIT_SAVING) * num * s[-1]:
        return [idx]
    cut = int(first[best])
    return [idx[np.sort(order[:cut])], idx[np.sort(order[cut:])]]


def _soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(scores / cap) * cap if cap else scores


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, attn: LayerAttention,
                      head_dim: int) -> torch.Tensor:
    """Attention with soft-capped scores (SDPA has no cap); q [1, H, n, D], k/v [1, H, L, D],
    `mask` [n, L] True = attend, None = causal."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * attn.softmax_scale(head_dim)
    scores = _soft_cap(scores, attn.logit_softcap)
    if mask is None:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def _gather(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """K or V at pool rows (see `_pool_rows`): [len(rows), head_dim], contiguous."""
    return buf.view(-1, buf.shape[-1]).index_select(0, rows)
